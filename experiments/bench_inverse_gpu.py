"""Where the in-chunk inverse kernel spends its time, and candidate ways to spend less.

    python experiments/bench_inverse_gpu.py --sizes=8x2048x16x128

Times `wy_chunk._inverse` (T of every chunk, fp32) with the kernel body swapped for variants of "blocks16":

- how the 4 diagonal 16 x 16 blocks are inverted: "substitute" (forward substitution, 15 serial steps each, the
  kernel's), "merge" (recursive block merges 2 -> 4 -> 8 -> 16, IEEE fp32 dots: 3 levels of two products),
  "merge_split" (the same with `_exact_dot`, six bf16 tensor-core products each), and the ablation "none" (I - A);
  "together" (the kernel's substitution for all 4 blocks in one loop, `substitutions_in_one_loop`) and
  "unrolled" (the same written out as straight-line code), "first" (all diagonal blocks of A first, then
  inverted in one loop each);
- the off-diagonal blocks: "ieee" (16 IEEE fp32 16 x 16 x 16 products), "split" (`_exact_dot`, the kernel's for
  16-bit inputs), "tf32x3" (three TF32 tensor-core products per product, Triton's `tf32x3` input precision, ~2^-21
  relative), and the ablation "none" (zeros).

A variant named `method=NAME` times a method of `wy_chunk.INVERSE_METHODS` as it ships (with `--pair`, writing T's
bf16 pair as the Mosaic forward pass reads it).

Ablations compute a wrong T: their rows only say what the skipped step costs. The other rows also print T's largest
relative error (per 16-row block, Frobenius) against an fp64 inverse of the same A, on correlated keys with beta
near 2, where fp32 substitution and merges differ most.
"""

from __future__ import annotations

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu import common, wy_chunk
import _timing  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (K = D, Hv = H).")
flags.DEFINE_list("variants", ["substitute/ieee", "together/ieee", "unrolled/ieee", "none/ieee", "substitute/none",
                               "together/none", "none/none", "together/split"], "diagonal/off-diagonal.")
flags.DEFINE_list("warps", ["1"], "Warps per program.")
flags.DEFINE_bool("pair", False, "Time T written as its bf16 pair (what the Mosaic forward pass reads) instead of "
                  "fp32 T (errors are always of fp32 T).")
flags.DEFINE_integer("iters", 50, "Calls per timed queue (`_timing.time_ms`).")
flags.DEFINE_enum("timing", "marginal", sorted(_timing.METHODS), "How calls are timed (`_timing.time_ms`).")
flags.DEFINE_bool("interpret", False, "Pallas interpreter (a CPU smoke test).")

SUB = wy_chunk.SUB
F32 = jnp.float32


def merged_unit_lower_inverse(a, exact_dot):
    """(I + a)^-1 of a strictly lower 16 x 16 a by block merges: 2 x 2 blocks are exact (I - a there), then
    T_2n = T_n - T_n (a inside the 2n-blocks, outside the n-blocks) T_n."""
    n = a.shape[0]
    row, col = common.iota2(n, n, 0), common.iota2(n, n, 1)
    t = jnp.where(row == col, 1.0, 0.0).astype(F32) - jnp.where(row // 2 == col // 2, a, 0.0)
    m = 2
    while m < n:
        inside = (row // (2 * m) == col // (2 * m)) & (row // m != col // m)
        t = t - exact_dot(t, exact_dot(jnp.where(inside, a, 0.0), t))
        m *= 2
    return t


def substitutions_in_one_loop(mats, unroll):
    """`common.unit_lower_inverse` of every matrix of `mats` in the same loop steps (their latencies may overlap),
    or with `unroll` the steps written out as straight-line code."""
    n = mats[0].shape[0]
    rows, cols = common.iota2(n, n, 0), common.iota2(n, n, 1)

    def step(i, xs):
        out = []
        for a, x in zip(mats, xs):
            a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)
            out.append(x - jnp.where(rows == i, jnp.sum(a_i[:, None] * x, axis=0)[None, :], 0.0))
        return tuple(out)

    xs = tuple(jnp.where(rows == cols, 1.0, 0.0).astype(F32) for _ in mats)
    if unroll:
        for i in range(1, n):
            xs = step(i, xs)
        return xs
    return jax.lax.fori_loop(1, n, step, xs)


def make_body(diagonal, off_diagonal):
    ieee = lambda a, b: common.dot(a, b, mode="highest")
    split = lambda a, b: wy_chunk._exact_dot(a, b, False)
    tf32x3 = lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32,
                                              precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    inverses = {"substitute": common.unit_lower_inverse,
                "merge": lambda a: merged_unit_lower_inverse(a, ieee),
                "merge_split": lambda a: merged_unit_lower_inverse(a, split),
                "none": lambda a: jnp.where(common.iota2(SUB, SUB, 0) == common.iota2(SUB, SUB, 1), 1.0, 0.0) - a}
    together = diagonal in ("together", "unrolled", "first")
    invert = None if together else inverses[diagonal]
    product = {"ieee": ieee, "split": split, "tf32x3": tf32x3, "none": None}[off_diagonal]

    def body(k_ref, beta_ref, g_ref, doc_ref, t_refs, cfg):
        nb = cfg.chunk_size // SUB
        blocks = [slice(i * SUB, (i + 1) * SUB) for i in range(nb)]
        row, col = common.iota2(SUB, SUB, 0), common.iota2(SUB, SUB, 1)
        t = {}

        def a_block(i, j):
            mask = row > col if i == j else row >= 0
            kk = common.dot(k_ref[blocks[i], :], k_ref[blocks[j], :], tb=True)
            return beta_ref[blocks[i]][:, None] * kk * wy_chunk._pair_decay(
                wy_chunk._gates(g_ref, blocks[i]), wy_chunk._gates(g_ref, blocks[j]), mask)

        if together:  # every diagonal block first, inverted in one loop (or straight-line code)
            a_diagonal = tuple(a_block(i, i) for i in range(nb))
            if diagonal == "first":  # computed first, inverted one loop after another
                diagonals = tuple(common.unit_lower_inverse(a) for a in a_diagonal)
            else:
                diagonals = substitutions_in_one_loop(a_diagonal, unroll=diagonal == "unrolled")
            t.update({(i, i): x for i, x in enumerate(diagonals)})
        for i in range(nb):
            a = {j: a_block(i, j) for j in range(i if together else i + 1)}
            if not together:
                t[i, i] = invert(a[i])
            for j in range(i - 1, -1, -1):
                if product is None:
                    t[i, j] = a[j]
                    continue
                acc = product(a[j], t[j, j])
                for m in range(j + 1, i):
                    acc = acc + product(a[m], t[m, j])
                t[i, j] = -product(t[i, i], acc)
            for j in range(nb):
                wy_chunk._store_inverse(t_refs, blocks[i], blocks[j],
                                        t[i, j] if j <= i else jnp.zeros((SUB, SUB), F32))

    return body


def inputs(B, T, H, D, correlated):
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    k = jax.random.normal(ks[0], (B, T, H, D))
    if correlated:  # every key near one shared direction
        k = k * 0.1 + jax.random.normal(ks[1], (1, 1, H, D))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    beta = 1.99 * jax.nn.sigmoid(8.0 + jax.random.normal(ks[2], (B, T, H))) if correlated else \
        jax.nn.sigmoid(jax.random.normal(ks[2], (B, T, H)))
    log_decay = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H)) + 3.0)
    return k, beta, log_decay


def reference_error(t, k, beta, g, C):
    """Largest relative error of T's 16-row blocks against the fp64 inverse of the same A."""
    B, Tp, H, K = k.shape
    kc = np.float64(k).reshape(B, Tp // C, C, H, K).transpose(0, 1, 3, 2, 4)
    bc = np.float64(beta).reshape(B, Tp // C, C, H).transpose(0, 1, 3, 2)
    gc = (np.float64(g[0]) + np.float64(g[1])).reshape(B, Tp // C, C, H).transpose(0, 1, 3, 2)
    a = bc[..., :, None] * (kc @ np.swapaxes(kc, -1, -2)) * np.exp(
        np.minimum(gc[..., :, None] - gc[..., None, :], 0.0))
    a = np.tril(a, -1)
    ref = np.linalg.inv(np.eye(C) + a)
    got = np.float64(t).reshape(B, Tp // C, C, H, C).transpose(0, 1, 3, 2, 4)
    worst = 0.0
    for r in range(C // SUB):
        rows = slice(r * SUB, (r + 1) * SUB)
        num = np.linalg.norm(got[..., rows, :] - ref[..., rows, :], axis=(-2, -1))
        worst = max(worst, float(np.max(num / np.linalg.norm(ref[..., rows, :], axis=(-2, -1)))))
    return worst


def main(argv):
    del argv
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| size | diagonal/off-diagonal | warps | ms | T error (correlated, beta ~2) |")
    print("|---|---|---|---|---|")
    original = wy_chunk._inverse_blocks16
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        k, beta, log_decay = inputs(B, T, H, D, correlated=False)
        ck, cbeta, clog = inputs(2, 256, 2, D, correlated=True)
        for name in FLAGS.variants:
            for warps in FLAGS.warps:
                cfg = wy_chunk.default_config(k, k, scale=D ** -0.5, chunk_size=64, delta=True, segmented=False,
                                              interpret=FLAGS.interpret)
                if name.startswith("method="):  # a shipped method as it is (`wy_chunk.INVERSE_METHODS`)
                    cfg = wy_chunk.replace_config(cfg, inverse_method=name[len("method="):], inverse_warps=int(warps))
                else:
                    cfg = wy_chunk.replace_config(cfg, inverse_method="blocks16", inverse_warps=int(warps))
                    wy_chunk._inverse_blocks16 = make_body(*name.split("/"))
                try:
                    def run(k, beta, log_decay, cfg=cfg, pair=False):
                        g = wy_chunk._in_chunk_cumsum(cfg, log_decay)
                        doc = jnp.zeros(k.shape[:2], jnp.int32)
                        return wy_chunk._inverse(cfg, k, beta, g, doc, pair=pair, fp32=not pair)
                    fn = jax.jit(functools.partial(run, pair=FLAGS.pair))
                    ms = _timing.time_ms(fn, k, beta, log_decay, iters=FLAGS.iters, method=FLAGS.timing)
                    ccfg = wy_chunk.replace_config(cfg, key_heads=2, value_heads=2)
                    t = jax.jit(lambda *a: run(*a, cfg=ccfg))(ck, cbeta, clog)
                    err = reference_error(t, ck, cbeta, wy_chunk._in_chunk_cumsum(ccfg, clog), 64)
                    print(f"| {size} | {name} | {warps} | {ms:.4f} | {err:.2e} |", flush=True)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a row, not the end
                    print(f"| {size} | {name} | {warps} | failed: {type(e).__name__}: {str(e)[:200]} | |",
                          flush=True)
                finally:
                    wy_chunk._inverse_blocks16 = original


if __name__ == "__main__":
    app.run(main)
