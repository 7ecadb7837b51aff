"""Byte-level language modelling with the step-size rules of seed 000: Gated DeltaNet vs DeltaNet vs relaxed
Kaczmarz vs Longhorn vs EFLA (the last three are Gated DeltaNet layers with that write strength), at equal model
shape and equal training tokens; validation loss and perplexity at the training length (@1x) and at twice it (@2x).

    # the recorded CPU-sized runs (docs/results.md): two seeds, then the merged table and curves
    python experiments/lm_compare.py
    python experiments/lm_compare.py --seed=1 --out=docs/figures/lm_compare_seed1.json --plot=
    python experiments/lm_compare.py --tabulate=docs/figures/lm_compare.json,docs/figures/lm_compare_seed1.json
    # a GPU-sized run (seed 000 used 100M tokens at length 2048 on SlimPajama); any text corpus works
    python experiments/lm_compare.py --data=~/corpus/ --d_model=512 --n_layers=8 --seq_len=2048 \
        --batch_size=32 --steps=1500 --learning_rate=1e-3 --eval_every=250

Every run goes through `deltajax.train.train` (metrics.jsonl, checkpoints and loss.png in --run_root/<variant>).
Writes a JSON record (after every run, so an interrupted script keeps the runs it finished), a table and the
validation curves. `--time_budget_s` splits a wall budget evenly over the variants; a run that reaches its share
stops there (evaluated, marked "stopped early", fewer tokens): pick --steps that fit, the budget is a guard.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", ["gated_deltanet", "deltanet", "gdn_relaxed_kaczmarz", "gdn_longhorn", "gdn_efla"],
                  "Models (see _synthetic.VARIANTS).")
flags.DEFINE_list("data", [], "Corpus files, directories or globs; empty: the Python standard library's sources.")
flags.DEFINE_integer("d_model", 128, "Residual width.")
flags.DEFINE_integer("n_layers", 2, "Blocks.")
flags.DEFINE_integer("n_heads", 2, "Heads (key and value) of the recurrent layers.")
flags.DEFINE_integer("seq_len", 128, "Training length (evaluation at 1x and 2x).")
flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
flags.DEFINE_integer("steps", 200, "Optimiser steps (equal tokens for every model).")
flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
flags.DEFINE_integer("eval_every", 50, "Evaluate every this many steps.")
flags.DEFINE_integer("eval_batches", 8, "Evaluation batches per length.")
flags.DEFINE_string("impl", None, "Rule implementation (default: scan on CPU, auto elsewhere).")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Compute dtype of the models.")
flags.DEFINE_float("time_budget_s", None, "Wall seconds for all runs together, split evenly (what a run leaves goes "
                   "to the next); a run that reaches its share stops early and is evaluated there. Unset: no limit.")
flags.DEFINE_integer("seed", 0, "Initialisation and data order.")
flags.DEFINE_string("run_root", None, "Run directories go here (default: a new temporary directory).")
flags.DEFINE_string("out", "docs/figures/lm_compare.json", "JSON record of the runs.")
flags.DEFINE_string("plot", "docs/figures/lm_compare.png", "Validation curves ('' for none).")
flags.DEFINE_list("tabulate", [], "Train nothing: merge the runs of these JSON records (e.g. one per seed), print "
                  "the table (mean over seeds) and plot.")


def print_table(records):
    import math

    by_variant = {}
    for r in records:
        by_variant.setdefault(r["variant"], []).append(r)
    seeds = max(len(v) for v in by_variant.values())
    each = lambda runs, key: " (" + ", ".join(f"{r['summary'][key]:.4f}" for r in runs) + ")" if seeds > 1 else ""
    print(f"\n| model | params | tokens / run | val loss @1x{' (each seed)' if seeds > 1 else ''} | ppl @1x | "
          f"bits/byte @1x | val loss @2x{' (each seed)' if seeds > 1 else ''} | ppl @2x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for variant, runs in by_variant.items():
        loss1 = sum(r["summary"]["eval_loss@1x"] for r in runs) / len(runs)
        loss2 = sum(r["summary"]["eval_loss@2x"] for r in runs) / len(runs)
        cut = " (cut)" if any(r["summary"].get("stopped_early") for r in runs) else ""
        print(f"| {variant} | {runs[0]['parameters']:,} | {runs[0]['tokens']:,}{cut} | {loss1:.4f}"
              f"{each(runs, 'eval_loss@1x')} | {math.exp(loss1):.3f} | {loss1 / math.log(2):.3f} | {loss2:.4f}"
              f"{each(runs, 'eval_loss@2x')} | {math.exp(loss2):.3f} |")


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {}
    for r in records:
        color = colors.setdefault(r["variant"], f"C{len(colors)}")
        for ax, key in zip(axes, ("eval_loss@1x", "eval_loss@2x")):
            points = [(e["step"], e[key]) for e in r["evals"] if key in e]
            first = sum(1 for x in records[:records.index(r)] if x["variant"] == r["variant"]) == 0
            ax.plot(*zip(*points), "o-", ms=3, lw=1.2, color=color, label=r["variant"] if first else None)
    for ax, title in zip(axes, ("validation @1x", "validation @2x")):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / byte)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    import _synthetic as common

    common.save_figure(fig, path)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import _synthetic as common
    from deltajax.data import DataConfig, build_data
    from deltajax.train import OptimConfig, TrainConfig, train
    from deltajax.train.metrics import read_records

    if FLAGS.tabulate:
        common.tabulate(FLAGS.tabulate, print_table, plot, FLAGS.plot)
        return
    impl = common.default_impl(FLAGS.impl)
    header = common.run_header()
    data_config = DataConfig(task="bytes", paths=tuple(FLAGS.data), seed=FLAGS.seed)
    data = build_data(data_config, FLAGS.seq_len)
    print(data.description, flush=True)
    run_root = FLAGS.run_root or tempfile.mkdtemp(prefix="lm_compare_")
    settings = {name: FLAGS[name].value for name in ("variants", "data", "d_model", "n_layers", "n_heads",
                                                      "seq_len", "batch_size", "steps", "learning_rate",
                                                      "eval_every", "eval_batches", "seed", "compute_dtype",
                                                      "time_budget_s")}
    base = dict(header, impl=impl, corpus=data.description, settings=settings)
    records = []
    started = time.perf_counter()
    budget = common.RunBudget(FLAGS.time_budget_s, len(FLAGS.variants))
    for variant in FLAGS.variants:
        model = common.model_config(variant, vocab_size=data.vocab_size, d_model=FLAGS.d_model,
                                    n_layers=FLAGS.n_layers, impl=impl, chunk_size=64,
                                    compute_dtype=FLAGS.compute_dtype)
        model = model.replace(n_heads=FLAGS.n_heads, n_value_heads=FLAGS.n_heads,
                              head_dim=FLAGS.d_model // FLAGS.n_heads,
                              value_head_dim=FLAGS.d_model // FLAGS.n_heads).validate()
        run_dir = os.path.join(run_root, variant)
        config = TrainConfig(model=model, data=data_config,
                             optim=OptimConfig(learning_rate=FLAGS.learning_rate,
                                               warmup_steps=max(FLAGS.steps // 10, 1)),
                             seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, steps=FLAGS.steps,
                             log_every=max(FLAGS.steps // 20, 1), eval_every=FLAGS.eval_every,
                             eval_batches=FLAGS.eval_batches, checkpoint_every=0, async_checkpoints=False,
                             run_dir=run_dir, seed=FLAGS.seed, progress_bar=False)
        share = budget.next_share()
        # The stop is checked before the final evaluation (two lengths, each compiled once): keep time for it.
        train_budget = None if share is None else share - min(max(0.15 * share, 10.0), 0.5 * share)
        print(f"{variant}: {common.count_parameters(model):,} parameters, run_dir {run_dir}"
              + (f", {share:.0f} s budget" if share is not None else ""), flush=True)
        t0 = time.perf_counter()
        summary = train(config, data=data, time_budget_s=train_budget, log=lambda s: print("  " + s, flush=True))
        seconds = time.perf_counter() - t0
        logged = read_records(os.path.join(run_dir, "metrics.jsonl"))
        records.append(dict(variant=variant, parameters=common.count_parameters(model), seconds=seconds,
                            tokens=summary["step"] * FLAGS.batch_size * FLAGS.seq_len, summary=summary,
                            rule_impl=common.rule_impl(model, FLAGS.batch_size, FLAGS.seq_len),
                            evals=[r for r in logged if r.get("kind") == "eval"],
                            train=[(r["step"], r["loss"]) for r in logged if r.get("kind") == "train"]))
        common.write_runs(FLAGS.out, base, records, started)

    common.finish_runs(records, base, started, out=FLAGS.out, plot_path=FLAGS.plot, print_table=print_table,
                       plot_fn=plot)

if __name__ == "__main__":
    app.run(main)
