"""Times the Gated DeltaNet's Mosaic GPU gradient kernel with persistent CTAs (`mosaic_wy_grads.grads(ctas=...)`)
against one CTA per (chunk, head) item on the same residuals, and compares their outputs element by element.

    MOSAIC_GPU_DUMP_PTXAS=1 python experiments/bench_persistent_grads.py --sizes=8x2048x16x128 \\
        --variants=staged:iota:132:loop,end:iota:132:loop,staged:iota:2048:unroll

A variant is SCHEDULE:MASKS:CTAS:LOOP. SCHEDULE, where warpgroup 0 refills the input groups with the next item's
tiles (`mosaic_wy_grads.REFILL_STAGES`): "staged" (dx, dS_end, u and the vectors once warpgroup 1 is done with its
state terms, S_0 and dO after dq's state term, q and k at the end), "early" (the first two groups early, the rest
at the end) or "end" (all at the end: the loop without the overlap). MASKS: "iota" or "pos" (the chunk's masks
from token positions in SMEM instead of index iotas, `POSITION_MASKS`). LOOP: "loop" (`pl.loop` over the items)
or "unroll" (`UNROLL_ITEMS`: the items traced one after the other). Columns: marginal device time (ms) and, per
output, how many elements differ from the one-CTA-per-item kernel's and the largest difference relative to the
output's largest magnitude.
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu import mosaic_wy_grads
import _timing as timing  # experiments/
from _kernel_inputs import kernel_inputs  # experiments/
from bench_mosaic_grads import residuals  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", ["staged:iota:132:loop"], "SCHEDULE:MASKS:CTAS:LOOP (module docstring).")

SCHEDULES = dict(staged=dict(early=("dx_dend", "u_vectors"), state=("s0_do",), keys=("q_k",)),
                 early=dict(early=("dx_dend", "u_vectors"), state=(), keys=("s0_do", "q_k")),
                 end=dict(early=(), state=(), keys=("dx_dend", "u_vectors", "s0_do", "q_k")))
OUTPUTS = ("dq", "dk", "dv", "dbeta", "dlog")


def main(argv):
    del argv
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        _, _, res = residuals(B, T, H, D, *kernel_inputs(B, T, H, D, per_channel=False))
        res = res[:11] + tuple(jax.jit(mosaic_wy_grads.as_pair)(x) for x in res[11:])
        run = lambda ctas: jax.jit(lambda *a: mosaic_wy_grads.grads(*a, scale=D ** -0.5, segmented=False,
                                                                    interpret=False, ctas=ctas))
        one_per_item = run(None)
        expected = [np.asarray(x.astype(jnp.float32)) for x in one_per_item(*res)]
        ms = lambda fn: timing.marginal_ms(fn, *res, iters=FLAGS.iters)
        print(f"| {size} | one CTA per item | {ms(one_per_item):.3f} | |", flush=True)
        for variant in FLAGS.variants:
            schedule, masks, ctas, loop = variant.split(":")
            mosaic_wy_grads.REFILL_STAGES = SCHEDULES[schedule]
            mosaic_wy_grads.POSITION_MASKS = masks == "pos"
            mosaic_wy_grads.UNROLL_ITEMS = loop == "unroll"
            fn = run(int(ctas))
            outs = [np.asarray(x.astype(jnp.float32)) for x in fn(*res)]
            diffs = [f"{name} {int((a != e).sum())} ({float(np.abs(a - e).max() / np.abs(e).max()):.1e})"
                     for name, a, e in zip(OUTPUTS, outs, expected)]
            print(f"| {size} | {variant} | {ms(fn):.3f} | {', '.join(diffs)} |", flush=True)


if __name__ == "__main__":
    app.run(main)
