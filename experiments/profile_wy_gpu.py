"""Runs the Gated DeltaNet Triton kernels a fixed number of times, for a profiler (Nsight Compute) to capture.

    ncu --kernel-name regex:'inverse|forward|reverse|grad' --launch-skip 7 --launch-count 7 \
        python3 experiments/profile_wy_gpu.py --size=8x2048x16x128 --calls=2

Each call runs the forward alone (the inverse and the forward pass: 2 launches) and then forward+backward (inverse,
forward pass with states, reverse pass, the gradient kernels: 5 launches with "staged"), so skipping the first call's
7 launches profiles a warm second call. `--variant` applies a variant of `bench_pallas_gpu.py`.
"""

from __future__ import annotations

from absl import app, flags

from deltajax.kernels.gpu import wy_chunk
from bench_pallas_gpu import VARIANTS, inputs  # experiments/
import _timing as timing  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_string("size", "8x2048x16x128", "BxTxHxD (K = V = D, Hv = H).")
flags.DEFINE_integer("calls", 2, "Calls of the forward and of forward+backward.")
flags.DEFINE_string("variant", "default", "A name from bench_pallas_gpu.VARIANTS.")


def main(argv):
    del argv
    B, T, H, D = (int(x) for x in FLAGS.size.split("x"))
    q, k, v, beta, log_decay = inputs(B, T, H, D)
    cfg = wy_chunk.default_config(q, v, scale=D ** -0.5, chunk_size=64, delta=True, segmented=False,
                                  interpret=False)
    cfg = wy_chunk.replace_config(cfg, **VARIANTS[FLAGS.variant])
    run = lambda *a: wy_chunk.chunk_wy(*a, scale=D ** -0.5, initial_state=None, segment_ids=None, config=cfg)
    timing.run_for_profiler(run, (q, k, v, beta, log_decay), FLAGS.calls)
    print("done", FLAGS.size, FLAGS.variant, cfg)


if __name__ == "__main__":
    app.run(main)
