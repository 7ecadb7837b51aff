"""Runs the Mosaic GPU Gated DeltaNet a fixed number of times, for Nsight Compute to capture.

    ncu --kernel-name regex:wy_forward_mosaic --launch-skip 1 --launch-count 1 --set full \
        python3 experiments/profile_mosaic_gpu.py --size=8x2048x16x128 --calls=2

One launch of the Mosaic pass per call (forward only), so skipping the first profiles a warm second call.
`--variant` applies a variant of `bench_mosaic_gpu.py`. With `--backward`, each call is forward+backward (`jax.grad`
of a sum of the outputs); every kernel's time in a warm call, the breakdown of a training step:

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 experiments/profile_mosaic_gpu.py --backward --calls=3
"""

from __future__ import annotations

from absl import app, flags
import jax

from bench_mosaic_gpu import config_of, forward, inputs  # experiments/
from _mosaic_calls import training_step  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_string("size", "8x2048x16x128", "BxTxHxD (D = 128, Hv = H).")
flags.DEFINE_integer("calls", 2, "Forward (or forward+backward) calls.")
flags.DEFINE_string("variant", "default", "A name from bench_mosaic_gpu.VARIANTS.")
flags.DEFINE_bool("backward", False, "Each call is forward+backward.")


def main(argv):
    del argv
    B, T, H, D = (int(x) for x in FLAGS.size.split("x"))
    args = inputs(B, T, H, D)
    cfg = config_of(FLAGS.variant, B * H, D)
    run = training_step(cfg, D) if FLAGS.backward else forward(cfg, D)
    for _ in range(FLAGS.calls):
        jax.block_until_ready(run(*args))
    print("done", FLAGS.size, FLAGS.variant, "forward+backward" if FLAGS.backward else "forward", cfg)


if __name__ == "__main__":
    app.run(main)
