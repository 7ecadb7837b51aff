"""Runs the KDA kernels a fixed number of times, for a profiler (Nsight Compute) to capture.

    ncu --kernel-name regex:kda --launch-skip 7 --launch-count 7 --metrics launch__registers_per_thread,\
gpu__time_duration.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum python3 experiments/profile_kda_gpu.py \
        --size=8x2048x16x128 --calls=2 --variant=previous

Each call runs the forward alone and then forward+backward, so skipping the first call's launches profiles a warm
second call: 7 launches per call with "inline" operands (prepare and forward pass; then prepare, forward pass,
reverse pass, the two gradient kernels), 10 with "stored" ones (the operand kernel before each pass group).
`--variant` applies a variant of `bench_kda_gpu.py` to `--config`, the Triton kernels' default or the dispatch's
"mosaic" config. (On 2026-11-25 this ran under ncu with the "previous" kernels; with the stored operands, skipping
10, ncu ended in a segmentation fault, not investigated.)
"""

from __future__ import annotations

from absl import app, flags

from deltajax.kernels.gpu import kda
from bench_kda_gpu import inputs, make_config  # experiments/
import _timing as timing  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_string("size", "8x2048x16x128", "BxTxHxD (K = V = D, Hv = H).")
flags.DEFINE_integer("calls", 2, "Calls of the forward and of forward+backward.")
flags.DEFINE_string("variant", "default", "A name from bench_kda_gpu.VARIANTS.")


def main(argv):
    del argv
    B, T, H, D = (int(x) for x in FLAGS.size.split("x"))
    q, k, v, beta, log_decay = inputs(B, T, H, D)
    cfg = make_config(FLAGS.variant, q, v, D)  # `--config` (bench_kda_gpu.py's flag)
    run = lambda *a: kda.kda_chunk(*a, scale=D ** -0.5, initial_state=None, segment_ids=None, config=cfg)
    timing.run_for_profiler(run, (q, k, v, beta, log_decay), FLAGS.calls)
    print("done", FLAGS.size, FLAGS.variant, cfg)


if __name__ == "__main__":
    app.run(main)
