"""Relative errors of the Pallas GPU WY kernels against the fp32 scan, per choice of product precision.

    python experiments/kernel_precision.py --variants=default,all_bf16 --cases=random,correlated
    python experiments/kernel_precision.py --interpret   # on CPU: bf16 rounding is emulated exactly
    python experiments/kernel_precision.py --size=8x600x4x256x128 --cases=random --worst_tokens=5 \
        --variants=default,part2_two_stages,bf16_products_fp32_states,part2_two_stages_bk64,\
part2_two_stages_k_warps4   # dq of the staged gradient kernels at K = 256 in two stages (docs/kernels.md)

Each case draws bf16 inputs (the scan sees the same rounded values in fp32) and prints the relative error of o, the
final state and every gradient (loss <o, W_o> + <S, W_s> with fixed non-constant weights). Bounds of the GPU tests:
o and state 3e-3, dq/dk/dv/d(initial state) 6e-3, dbeta/dlog_decay 1e-2.
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu import wy_chunk
from deltajax.rules.scan import recurrent_scan

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", ["default"], "Names from VARIANTS.")
flags.DEFINE_list("cases", ["random", "correlated", "strong_decay"], "Names from CASES.")
flags.DEFINE_string("size", "1x500x2x128", "BxTxHxD (K = V = D) or BxTxHxKxV (Hv = 2H, packed documents, an "
                    "initial state).")
flags.DEFINE_bool("interpret", False, "Run the kernels in Pallas's interpreter.")
flags.DEFINE_integer("worst_tokens", 0, "Also print the N tokens of largest relative dq error (by position in the "
                     "sequence, over batch and heads; the positions mod 64 say where in the chunk the error sits).")

VARIANTS = {
    "default": {},
    # Output methods (wy_chunk.OUTPUT_METHODS), each forced: "split" reads the saved (bf16) start states for Q S_0.
    "fused_output": dict(output_method="fused"),
    "split_output": dict(output_method="split"),
    # Storage between kernels (wy_chunk.INVERSE_STORAGES, STATE_STORAGES): "storage_fp32" is the default before
    # 2026-11-24 (T and the saved states in fp32).
    "storage_fp32": dict(inverse_storage="fp32", state_storage="fp32"),
    "inverse_fp32": dict(inverse_storage="fp32"),
    "states_fp32": dict(state_storage="fp32"),
    "all_split": dict(dots="split", state_dots="split", inverse_dots="split", grad_dots="split",
                      grad_k_dots="split"),
    "all_bf16": dict(dots="bf16", state_dots="bf16", inverse_dots="bf16", grad_dots="bf16",
                     grad_k_dots="bf16"),
    "all_tf32": dict(dots="tf32", state_dots="tf32", inverse_dots="tf32", grad_dots="tf32",
                     grad_k_dots="tf32"),
    "fwd_bf16": dict(dots="bf16", state_dots="bf16"),
    "inverse_bf16": dict(inverse_dots="bf16"),
    "grad_split": dict(grad_dots="split", grad_k_dots="split"),
    "grad_bf16": dict(grad_dots="bf16", grad_k_dots="bf16"),  # products with T stay "split"
    "grad_k_bf16": dict(grad_k_dots="bf16"),  # part 2's S_0 / dS_end / dA products only
    "state_bf16": dict(state_dots="bf16"),  # K S_0 and K dS only (passes and gradient part 1)
    "tolerant_bf16": dict(grad_k_dots="bf16", state_dots="bf16"),  # both
    # Gradient methods (wy_chunk.GRAD_METHODS) at the block sizes swept on the H100.
    "grad_fused": dict(grad_method="fused", grad_block_v=32, grad_block_k=256),
    "grad_fused_bk64": dict(grad_method="fused", grad_block_v=32, grad_block_k=64),
    "grad_staged": dict(grad_method="staged", grad_block_v=64, grad_block_k=64),
    "grad_staged_bk128": dict(grad_method="staged", grad_block_v=64, grad_block_k=128),
    # "staged" (K = 256): part 2 in two pipeline stages on bf16 saved states gave a wrong compiled dq (docs/kernels.md,
    # "dq of the staged gradient kernels at K = 256"; the default runs part 2 in one stage), and the variants that
    # located the fault: fp32 states with "split" products (the avoidance of 2026-12-04), bf16 products of fp32
    # states, narrower K blocks and fewer warps, each in two stages.
    "part2_two_stages": dict(grad_k_stages=2),
    "fp32_states": dict(grad_k_dots="split"),
    "bf16_products_fp32_states": dict(state_storage="fp32", grad_k_stages=2),
    "part2_two_stages_bk64": dict(grad_k_stages=2, grad_block_k=64),
    "part2_two_stages_k_warps4": dict(grad_k_stages=2, grad_k_warps=4),
}
CASES = ("random", "correlated", "strong_decay")
NAMES = ("o", "state", "dq", "dk", "dv", "dbeta", "dlog_decay", "dh0")


def case_inputs(name, B, T, H, D, seed=0, V=None):
    """Packed documents, an initial state, beta in (0, 2); `correlated`: near-identical keys, beta -> 2, decay ~ 0.
    K = D, V = `V` or D."""
    Hv, V = 2 * H, V or D
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, H, D))
    v = jax.random.normal(ks[2], (B, T, Hv, V))
    beta = jax.random.uniform(ks[3], (B, T, Hv), minval=0.0, maxval=2.0)
    log_decay = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, Hv)) + 3.0)
    if name == "correlated":
        k = jax.random.normal(ks[5], (1, 1, H, D)) + 0.02 * k
        beta = jax.random.uniform(ks[3], (B, T, Hv), minval=1.9, maxval=1.999)
        log_decay = -1e-6 * jax.random.uniform(ks[4], (B, T, Hv))
    elif name == "strong_decay":
        log_decay = -20.0 * jax.random.uniform(ks[4], (B, T, Hv))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    ids = jnp.cumsum(jax.random.bernoulli(ks[6], 3.0 / T, (B, T)), axis=1).astype(jnp.int32)
    h0 = 0.5 * jax.random.normal(ks[7], (B, Hv, D, V))
    rnd = lambda x: x.astype(jnp.bfloat16)
    return dict(q=rnd(q), k=rnd(k), v=rnd(v), beta=beta, log_decay=log_decay, initial_state=h0, segment_ids=ids)


def errors(fn, x, scale):
    names = ("q", "k", "v", "beta", "log_decay", "initial_state")

    def run(*args):
        a = dict(zip(names, args))
        return fn(a["q"], a["k"], a["v"], a["beta"], a["log_decay"], scale=scale, initial_state=a["initial_state"],
                  segment_ids=x["segment_ids"])

    def loss(*args):
        o, s = run(*args)
        wo = jnp.cos(0.37 * jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        ws = jnp.cos(0.37 * jnp.arange(s.size, dtype=jnp.float32) + 2.0).reshape(s.shape)
        return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(s * ws)

    args = [x[n] for n in names]
    o, s = jax.jit(run)(*args)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
    return [np.asarray(a, np.float64) for a in (o, s) + tuple(grads)]


def main(argv):
    del argv
    B, T, H, D, *V = (int(x) for x in FLAGS.size.split("x"))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, size {FLAGS.size} (Hv = 2H), relative errors")
    print("| case | variant | " + " | ".join(NAMES) + " |")
    print("|---|---|" + "---|" * len(NAMES))
    for case in FLAGS.cases:
        x = case_inputs(case, B, T, H, D, V=V[0] if V else None)
        ref_x = dict(x, **{n: x[n].astype(jnp.float32) for n in ("q", "k", "v")})
        ref = errors(recurrent_scan, ref_x, D ** -0.5)
        for name in FLAGS.variants:
            cfg = wy_chunk.default_config(x["q"], x["v"], scale=D ** -0.5, chunk_size=64, delta=True,
                                          segmented=True, interpret=FLAGS.interpret)
            cfg = wy_chunk.replace_config(cfg, **VARIANTS[name])
            kernel = lambda *a, **kw: wy_chunk.chunk_wy(*a, **kw, interpret=cfg.interpret, config=cfg)
            got = errors(kernel, x, D ** -0.5)
            rel = [np.linalg.norm(g - r) / np.linalg.norm(r) for g, r in zip(got, ref)]
            print(f"| {case} | {name} | " + " | ".join(f"{e:.1e}" for e in rel) + " |", flush=True)
            if FLAGS.worst_tokens:
                print(f"|   | worst dq tokens: {worst_tokens(got[2], ref[2], FLAGS.worst_tokens)} | |", flush=True)


def worst_tokens(got, ref, n):
    """The n positions t (descending error) of largest ||got[:, t] - ref[:, t]|| / ||ref[:, t]|| over batch and
    heads, as "t (error)"."""
    per_token = np.sqrt(((got - ref) ** 2).sum(axis=(0, 2, 3)) / np.maximum((ref ** 2).sum(axis=(0, 2, 3)), 1e-30))
    return ", ".join(f"{t} ({per_token[t]:.1e})" for t in np.argsort(per_token)[::-1][:n])


if __name__ == "__main__":
    app.run(main)
