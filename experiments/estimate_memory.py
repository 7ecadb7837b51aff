"""Decoding memory over context length (seed 004): KV cache of full attention vs the recurrent state of Gated
DeltaNet, and the 3:1 hybrid (three Gated DeltaNet layers per attention layer, as Qwen3-Next and Kimi Linear).

    python experiments/estimate_memory.py --emb_dim 2048 --n_heads 16 --n_layers 48 --dtype bf16
    # the seed's simplified formula (state in the cache dtype, no convolution tail)
    python experiments/estimate_memory.py --emb_dim 2048 --n_heads 16 --n_layers 48 --dtype bf16 \
        --state_dtype bf16 --conv_size 0

Per layer and sequence (head_dim = emb_dim / n_heads unless given):
    attention      batch x tokens x kv_heads x head_dim x 2 x bytes(dtype)          grows with tokens
    Gated DeltaNet batch x heads x head_dim x head_dim x bytes(state_dtype)         constant
                   + the short-convolution tail batch x (conv_size - 1) x 3 heads head_dim x bytes(dtype)
The defaults count what `deltajax.nn` allocates when decoding (float32 state, a 4-tap convolution).
"""

from __future__ import annotations

import os

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("emb_dim", 2048, "Model width.")
flags.DEFINE_integer("n_heads", 16, "Attention heads and Gated DeltaNet heads.")
flags.DEFINE_integer("n_kv_heads", None, "Key/value heads of attention (default n_heads: multi-head attention).")
flags.DEFINE_integer("head_dim", None, "Head width (default emb_dim / n_heads).")
flags.DEFINE_integer("n_layers", 48, "Layers.")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp16", "fp32"], "KV-cache and convolution-tail dtype.")
flags.DEFINE_enum("state_dtype", "fp32", ["bf16", "fp16", "fp32"], "Recurrent-state dtype (deltajax keeps fp32).")
flags.DEFINE_integer("conv_size", 4, "Short-convolution taps of the Gated DeltaNet layers (0: none).")
flags.DEFINE_integer("batch_size", 1, "Sequences decoded together.")
flags.DEFINE_integer("max_context", 131072, "Largest context length plotted.")
flags.DEFINE_list("table_contexts", ["4096", "32768", "131072", "262144", "1048576"], "Context lengths tabulated.")
flags.DEFINE_string("plot", "docs/figures/memory_estimates.png", "Output figure ('' for none).")

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PATTERNS = {"full attention": "A", "Gated DeltaNet": "G", "3:1 hybrid": "GGGA"}


def configs():
    from deltajax.nn import ModelConfig

    head_dim = FLAGS.head_dim or FLAGS.emb_dim // FLAGS.n_heads
    base = dict(vocab_size=1, d_model=FLAGS.emb_dim, n_layers=FLAGS.n_layers, n_heads=FLAGS.n_heads,
                head_dim=head_dim, n_attn_heads=FLAGS.n_heads, n_kv_heads=FLAGS.n_kv_heads or FLAGS.n_heads,
                attn_head_dim=head_dim, conv_size=FLAGS.conv_size, compute_dtype=NAMES[FLAGS.dtype])
    return {name: ModelConfig(layer_pattern=pattern, **base).validate() for name, pattern in PATTERNS.items()}


def memory_bytes(config, tokens):
    from deltajax.nn import decoding_memory

    return decoding_memory(config, FLAGS.batch_size, tokens, cache_bytes=BYTES[FLAGS.dtype],
                           state_bytes=BYTES[FLAGS.state_dtype])["total"]


def gib(n):
    return n / 2 ** 30


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    models = configs()
    g = models["Gated DeltaNet"]
    print(f"emb_dim {FLAGS.emb_dim}, {FLAGS.n_layers} layers, {FLAGS.n_heads} heads of {g.head_dim} "
          f"(kv heads {g.kv_heads}), batch {FLAGS.batch_size}, cache {FLAGS.dtype}, state {FLAGS.state_dtype}, "
          f"conv {FLAGS.conv_size}")
    contexts = [int(c) for c in FLAGS.table_contexts]
    print("\n| context | " + " | ".join(f"{n} (GiB)" for n in models) + " | hybrid / attention |")
    print("|---:|" + "---:|" * (len(models) + 1))
    for tokens in contexts:
        values = {n: memory_bytes(c, tokens) for n, c in models.items()}
        ratio = values["3:1 hybrid"] / values["full attention"]
        print(f"| {tokens:,} | " + " | ".join(f"{gib(v):.3f}" for v in values.values()) + f" | {ratio:.3f} |")
    state = memory_bytes(g, 1)
    per_token = memory_bytes(models["full attention"], 1)  # the KV cache is linear in tokens
    crossover = -(-state // per_token)
    print(f"\nGated DeltaNet needs {gib(state):.4f} GiB at any length; the KV cache of full attention passes it "
          f"at {crossover:,} tokens.")
    if FLAGS.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        xs = np.unique(np.linspace(1, FLAGS.max_context, 200).astype(int))
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for name, config in models.items():
            ax.plot(xs, [gib(memory_bytes(config, int(t))) for t in xs], lw=2, label=name)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decoding cache (GiB)")
        ax.set_title(f"d={FLAGS.emb_dim}, {FLAGS.n_layers} layers, {FLAGS.n_heads} heads, batch {FLAGS.batch_size}, "
                     f"cache {FLAGS.dtype}, state {FLAGS.state_dtype}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.plot)), exist_ok=True)
        fig.savefig(FLAGS.plot, dpi=110)
        plt.close(fig)
        print(f"plot: {FLAGS.plot}")


if __name__ == "__main__":
    app.run(main)
