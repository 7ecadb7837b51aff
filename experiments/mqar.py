"""Multi-query associative recall (Zoology; Arora et al. 2023): recall accuracy against model width.

A sequence opens with key-value pairs and then queries the keys again; a model is scored on the value it predicts
after each queried key. Compared: linear attention, DeltaNet, Gated DeltaNet, KDA and Gated DeltaNet with the
step-size rules of seed 000 (Kaczmarz, relaxed Kaczmarz, Longhorn, EFLA), each 2 layers at every width.

    # the recorded CPU-sized runs (docs/results.md): vocab 64, sequence 32, 4 pairs, widths 16/64, two seeds
    python experiments/mqar.py
    python experiments/mqar.py --seed=1 --out=docs/figures/mqar_seed1.json --plot=
    python experiments/mqar.py --tabulate=docs/figures/mqar.json,docs/figures/mqar_seed1.json
    # the Zoology setting (vocab 8192, sequence 512, 64 key-value pairs, widths 64/128/256), a GPU-sized budget
    python experiments/mqar.py --vocab_size=8192 --seq_len=512 --num_kv_pairs=64 --widths=64,128,256 \
        --steps=4000 --batch_size=128 --learning_rate=1e-3
    # Zoology's training mixture of easier settings, tested at the hard one (gpu_reproduce.sh runs this)
    python experiments/mqar.py --vocab_size=8192 --seq_len=512 --num_kv_pairs=64 --widths=128 --steps=4000 \
        --train_mixture=64:4,128:8,256:16,256:32,256:64 --batch_size=128 --learning_rate=1e-3 --impl=chunk
    # the same, each run's schedule fitted to its share of 300 s (at most 4000 steps), one process per width
    python experiments/mqar.py --vocab_size=8192 --seq_len=512 --num_kv_pairs=64 --widths=256 --steps=4000 \
        --batch_size=128 --learning_rate=1e-3 --time_budget_s=300 --data_workers=4 --out=/tmp/mqar_256.json --plot=

Accuracy is measured on held-out sequences (a separate seed stream) of --seq_len / --num_kv_pairs; training uses
the same setting, or with --train_mixture a mixture of settings (deltajax.data.MQARMixture). Writes a JSON record
(after every run, so an interrupted script keeps the runs it finished) and a plot. `--time_budget_s`,
`--train_seconds` and `--data_workers`: see experiments/_synthetic.py.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _run_flags  # noqa: E402  (experiments/)

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", ["linear_attention", "deltanet", "gated_deltanet", "kda", "gdn_kaczmarz",
                               "gdn_relaxed_kaczmarz", "gdn_longhorn", "gdn_efla"],
                  "Models (see _synthetic.VARIANTS).")
flags.DEFINE_list("widths", ["16", "64"], "d_model values.")
flags.DEFINE_integer("n_layers", 2, "Blocks.")
flags.DEFINE_integer("vocab_size", 64, "Vocabulary: keys from the lower half, values from the upper half.")
flags.DEFINE_integer("seq_len", 32, "Sequence length.")
flags.DEFINE_integer("num_kv_pairs", 4, "Key-value pairs per sequence.")
flags.DEFINE_list("train_mixture", [], "Train on this mixture of seq_len:num_kv_pairs settings instead of the test "
                  "setting, e.g. Zoology's 64:4,128:8,256:16,256:32,256:64 (each drawn equally often, padded to the "
                  "longest; deltajax.data.MQARMixture). Testing stays at --seq_len / --num_kv_pairs.")
flags.DEFINE_integer("steps", 400, "Optimiser steps per run.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
flags.DEFINE_integer("eval_batches", 4, "Evaluation batches of --batch_size.")
flags.DEFINE_string("impl", None, "Rule implementation (default: scan on CPU, auto elsewhere).")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Compute dtype of the models.")
_run_flags.define_run_flags()
flags.DEFINE_string("out", "docs/figures/mqar.json", "JSON record of the runs.")
flags.DEFINE_string("plot", "docs/figures/mqar.png", "Accuracy against width ('' for none).")
flags.DEFINE_list("tabulate", [], "Train nothing: merge the runs of these JSON records (e.g. one per seed), print "
                  "the table (mean over seeds) and plot.")


def mean_accuracy(records):
    """{(variant, d_model): [test accuracy of every seed]}."""
    out = {}
    for r in records:
        out.setdefault((r["variant"], r["d_model"]), []).append(r["accuracy"]["test"])
    return out


def print_table(records):
    by_key = mean_accuracy(records)
    variants = list(dict.fromkeys(r["variant"] for r in records))
    widths = sorted({r["d_model"] for r in records})
    seeds = max(len(v) for v in by_key.values())
    note = f" (mean of {seeds} seeds: each seed)" if seeds > 1 else ""
    print(f"\n| model | " + " | ".join(f"d={w}{note}" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for variant in variants:
        cells = []
        for w in widths:
            values = by_key.get((variant, w), [])
            if not values:
                cells.append("-")
                continue
            mean = sum(values) / len(values)
            cells.append(f"{mean:.3f}" + (" (" + ", ".join(f"{x:.3f}" for x in values) + ")" if seeds > 1 else ""))
        print(f"| {variant} | " + " | ".join(cells) + " |")
    if any("steps" in r for r in records):  # runs fitted to a time budget train different numbers of steps
        print("\nsteps trained (cut: stopped at the deadline before the end of the schedule):")
        for r in records:
            print(f"  d={r['d_model']} {r['variant']}: {r.get('steps', '?')}"
                  + (" (cut)" if r.get("stopped_early") else "") + f", {r.get('rule_impl', '?')}")


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = mean_accuracy(records)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    widths = sorted({r["d_model"] for r in records})
    for variant in dict.fromkeys(r["variant"] for r in records):
        points = [(w, by_key[(variant, w)]) for w in widths if (variant, w) in by_key]
        line, = ax.plot([w for w, _ in points], [sum(v) / len(v) for _, v in points], "o-", label=variant)
        for w, values in points:
            if len(values) > 1:
                ax.scatter([w] * len(values), values, s=10, color=line.get_color(), alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("d_model")
    ax.set_ylabel("recall accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    import _synthetic as common

    common.save_figure(fig, path)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import _synthetic as common
    from deltajax.data import MQAR, MQARMixture

    if FLAGS.tabulate:
        common.tabulate(FLAGS.tabulate, print_table, plot, FLAGS.plot)
        return

    common.start_data_workers(FLAGS.data_workers)  # forks: before JAX starts a backend
    try:
        impl = common.default_impl(FLAGS.impl)
        header = common.run_header()
        settings = {name: FLAGS[name].value for name in ("variants", "widths", "n_layers", "vocab_size", "seq_len",
                                                          "num_kv_pairs", "train_mixture", "steps", "batch_size",
                                                          "learning_rate", "eval_batches", "seed", "compute_dtype",
                                                          "impl", "time_budget_s", "train_seconds", "data_workers")}
        test_source = MQAR(FLAGS.seq_len, vocab_size=FLAGS.vocab_size, num_kv_pairs=FLAGS.num_kv_pairs,
                           seed=2 * FLAGS.seed + 1)
        if FLAGS.train_mixture:
            settings_mix = [tuple(int(x) for x in item.split(":")) for item in FLAGS.train_mixture]
            train_source = MQARMixture(tuple(settings_mix), vocab_size=FLAGS.vocab_size, seed=2 * FLAGS.seed)
        else:
            train_source = MQAR(FLAGS.seq_len, vocab_size=FLAGS.vocab_size, num_kv_pairs=FLAGS.num_kv_pairs,
                                seed=2 * FLAGS.seed)
        print(f"train on {train_source!r}, test on {test_source!r}", flush=True)
        eval_sets = {"test": common.fixed_batches(test_source, FLAGS.batch_size, FLAGS.eval_batches)}
        base = dict(header, impl=impl, settings=settings)
        records = []
        started = time.perf_counter()
        budget = common.RunBudget(FLAGS.time_budget_s, len(FLAGS.widths) * len(FLAGS.variants))
        for width in (int(w) for w in FLAGS.widths):
            for variant in FLAGS.variants:
                config = common.model_config(variant, vocab_size=FLAGS.vocab_size, d_model=width,
                                             n_layers=FLAGS.n_layers, impl=impl, chunk_size=64,
                                             compute_dtype=FLAGS.compute_dtype)
                result = common.train_in_budget(f"d_model {width} / {variant}", config, train_source, eval_sets,
                                                budget, steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                                                learning_rate=FLAGS.learning_rate, seed=FLAGS.seed, log_every=100,
                                                train_seconds=FLAGS.train_seconds)
                result.update(variant=variant, d_model=width, train_data=repr(train_source))
                records.append(result)
                print(f"  accuracy {result['accuracy']['test']:.3f} ({result['steps']} steps, {result['rule_impl']}, "
                      f"{result['train_seconds']:.0f} s)", flush=True)
                common.write_runs(FLAGS.out, base, records, started)
    finally:  # a stuck or failed worker must not keep the process from exiting
        common.stop_data_workers()

    common.finish_runs(records, base, started, out=FLAGS.out, plot_path=FLAGS.plot, print_table=print_table,
                       plot_fn=plot)


if __name__ == "__main__":
    app.run(main)
