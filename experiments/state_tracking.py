"""State tracking with negative eigenvalues (seed 003; Grazzi et al., ICLR 2025): parity and modular arithmetic.

Train on short sequences, test on longer ones, and report the scaled accuracy (acc - chance) / (1 - chance)
(1 = solved, 0 = chance) for DeltaNet and Gated DeltaNet with beta in [0, 1] (sigmoid) and in [0, 2]
(2 sigmoid: the transition I - beta k k^T then has an eigenvalue in (-1, 1], which parity needs).

    # the recorded CPU-sized run (docs/results.md)
    python experiments/state_tracking.py
    # the published setting (2 layers, d_model 128, train lengths 3-40, test 40-256), a GPU-sized budget
    python experiments/state_tracking.py --steps=5000 --batch_size=256 --tasks=parity,modular,modular_brackets
    # at most 5000 steps, each run's schedule fitted to its share of 300 s; runs split over processes, then merged
    python experiments/state_tracking.py --steps=5000 --batch_size=256 --time_budget_s=300 --data_workers=3 \
        --variants=deltanet,deltanet_neg --out=/tmp/st_a.json --plot=
    python experiments/state_tracking.py --tabulate=/tmp/st_a.json,/tmp/st_b.json --plot=/tmp/st.png

Parity targets are the running parity at every position, so one sequence of length 40 trains every length
3..40 at once; accuracy "train" is over prefix lengths 3-40 and "test" over 40-256 of separate length-256
sequences. Modular arithmetic scores only the answer after "="; its test set keeps the expressions of 40-256
tokens. Writes a JSON record (after every run, so an interrupted script keeps the runs it finished) and a bar
plot. `--time_budget_s`, `--train_seconds` and `--data_workers`: see experiments/_synthetic.py.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _run_flags  # noqa: E402  (experiments/)

FLAGS = flags.FLAGS
flags.DEFINE_list("tasks", ["parity"], "Any of parity, modular, modular_brackets.")
flags.DEFINE_list("variants", ["deltanet", "deltanet_neg", "gated_deltanet", "gated_deltanet_neg"],
                  "Models (see _synthetic.VARIANTS); *_neg use beta in [0, 2].")
flags.DEFINE_integer("d_model", 128, "Residual width.")
flags.DEFINE_integer("n_layers", 2, "Blocks.")
flags.DEFINE_integer("train_len", 40, "Longest training sequence.")
flags.DEFINE_integer("min_len", 3, "Shortest length scored as 'train'.")
flags.DEFINE_integer("test_len", 256, "Longest test sequence; test lengths are train_len..test_len.")
flags.DEFINE_integer("modulus", 5, "Modulus of the arithmetic tasks.")
flags.DEFINE_integer("steps", 300, "Optimiser steps per run.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
flags.DEFINE_integer("eval_batches", 4, "Evaluation batches (of --batch_size) per length range.")
flags.DEFINE_string("impl", None, "Rule implementation (default: scan on CPU, auto elsewhere).")
flags.DEFINE_integer("chunk_size", 64, "Chunk of the chunked forms (64: what the Pallas GPU kernels take).")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Compute dtype of the models.")
_run_flags.define_run_flags()
flags.DEFINE_string("out", "docs/figures/state_tracking.json", "JSON record of the runs.")
flags.DEFINE_string("plot", "docs/figures/state_tracking.png", "Bar plot of scaled test accuracy ('' for none).")
flags.DEFINE_list("tabulate", [], "Train nothing: merge the runs of these JSON records (e.g. one per process), print "
                  "the table and plot.")


def task_sources(task, seq_len, modulus, seed):
    from deltajax.data import ModularArithmetic, Parity

    if task == "parity":
        return Parity(seq_len, seed=seed), 0.5
    if task in ("modular", "modular_brackets"):
        return ModularArithmetic(seq_len, modulus=modulus, brackets=task == "modular_brackets", seed=seed), \
            1.0 / modulus
    raise app.UsageError(f"unknown task {task!r}")


def length_window(batches, task, low, high):
    """Keeps the weight of scored positions whose prefix length (index + 1) lies in [low, high]."""
    import numpy as np

    out = []
    for batch in batches:
        lengths = np.arange(1, batch["inputs"].shape[1] + 1)[None, :]
        keep = (lengths >= low) & (lengths <= high)
        out.append(dict(batch, weights=batch["weights"] * keep))
    return out


def scaled(accuracy, chance):
    return (accuracy - chance) / (1.0 - chance)


def label(variant):
    name = variant.removesuffix("_neg").replace("gated_deltanet", "GDN").replace("deltanet", "DeltaNet")
    return name + (" beta in [0,2]" if variant.endswith("_neg") else " beta in [0,1]")


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = sorted({r["task"] for r in records}, key=[r["task"] for r in records].index)
    variants = sorted({r["variant"] for r in records}, key=[r["variant"] for r in records].index)
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = {r["variant"]: r for r in records if r["task"] == task}
        x = np.arange(len(variants))
        train = [rows[v]["scaled_accuracy"]["train"] if v in rows else np.nan for v in variants]
        test = [rows[v]["scaled_accuracy"]["test"] if v in rows else np.nan for v in variants]
        ax.bar(x - 0.2, train, 0.4, label="train lengths")
        ax.bar(x + 0.2, test, 0.4, label="test lengths")
        ax.set_xticks(x, [label(v) for v in variants], rotation=30, ha="right", fontsize=8)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_ylim(-0.2, 1.25)
        ax.set_title(task, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("scaled accuracy")
    axes[0][0].legend(fontsize=8, loc="upper left")
    import _synthetic as common

    common.save_figure(fig, path)


def print_table(records):
    low_high = lambda r, split: r.get("lengths", {}).get(split)
    first = records[0]
    train_range = "-".join(map(str, low_high(first, "train") or ("train",)))
    test_range = "-".join(map(str, low_high(first, "test") or ("test",)))
    print(f"\n| task | model | params | steps | train loss | acc {train_range} | acc {test_range} | "
          f"scaled {train_range} | scaled {test_range} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        a, s = r["accuracy"], r["scaled_accuracy"]
        steps = f"{r.get('steps', '?')}" + (" (cut)" if r.get("stopped_early") else "")
        print(f"| {r['task']} | {r['variant']} | {r['parameters']:,} | {steps} | {r['final_loss']:.3f} | "
              f"{a['train']:.3f} | {a['test']:.3f} | {s['train']:.2f} | {s['test']:.2f} |")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import _synthetic as common

    if FLAGS.tabulate:
        common.tabulate(FLAGS.tabulate, print_table, plot, FLAGS.plot)
        return
    common.start_data_workers(FLAGS.data_workers)  # forks: before JAX starts a backend
    try:
        impl = common.default_impl(FLAGS.impl)
        header = common.run_header()
        settings = {name: FLAGS[name].value for name in ("tasks", "variants", "d_model", "n_layers", "train_len",
                                                          "min_len", "test_len", "modulus", "steps", "batch_size",
                                                          "learning_rate", "eval_batches", "seed", "chunk_size",
                                                          "compute_dtype", "time_budget_s", "train_seconds",
                                                          "data_workers")}
        base = dict(header, impl=impl, settings=settings)
        records = []
        started = time.perf_counter()
        budget = common.RunBudget(FLAGS.time_budget_s, len(FLAGS.tasks) * len(FLAGS.variants))
        for task in FLAGS.tasks:
            train_source, chance = task_sources(task, FLAGS.train_len, FLAGS.modulus, seed=2 * FLAGS.seed)
            test_source, _ = task_sources(task, FLAGS.test_len, FLAGS.modulus, seed=2 * FLAGS.seed + 1)
            short = common.fixed_batches(task_sources(task, FLAGS.train_len, FLAGS.modulus, 2 * FLAGS.seed + 1)[0],
                                         FLAGS.batch_size, FLAGS.eval_batches)
            long = common.fixed_batches(test_source, FLAGS.batch_size, FLAGS.eval_batches)
            eval_sets = {"train": length_window(short, task, FLAGS.min_len, FLAGS.train_len),
                         "test": length_window(long, task, FLAGS.train_len, FLAGS.test_len)}
            for variant in FLAGS.variants:
                config = common.model_config(variant, vocab_size=train_source.vocab_size, d_model=FLAGS.d_model,
                                             n_layers=FLAGS.n_layers, impl=impl, chunk_size=FLAGS.chunk_size,
                                             compute_dtype=FLAGS.compute_dtype)
                result = common.train_in_budget(f"{task} / {variant}", config, train_source, eval_sets, budget,
                                                steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                                                learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                                                train_seconds=FLAGS.train_seconds)
                result.update(task=task, variant=variant, chance=chance,
                              lengths={"train": [FLAGS.min_len, FLAGS.train_len],
                                       "test": [FLAGS.train_len, FLAGS.test_len]},
                              scaled_accuracy={k: scaled(v, chance) for k, v in result["accuracy"].items()})
                records.append(result)
                print(f"  accuracy {result['accuracy']}, scaled {result['scaled_accuracy']} "
                      f"({result['steps']} steps, {result['rule_impl']}, {result['train_seconds']:.0f} s)", flush=True)
                common.write_runs(FLAGS.out, base, records, started)
    finally:  # a stuck or failed worker must not keep the process from exiting
        common.stop_data_workers()

    common.finish_runs(records, base, started, out=FLAGS.out, plot_path=FLAGS.plot, print_table=print_table,
                       plot_fn=plot)


if __name__ == "__main__":
    app.run(main)
