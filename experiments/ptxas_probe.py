"""Compiles one forward call per Mosaic config at a small size, for ptxas's register and spill report.

    MOSAIC_GPU_DUMP_PTXAS=1 python experiments/ptxas_probe.py --variants=default,one_warpgroup 2>&1 \
        | grep -E "^===|registers|spill"

The variants are `bench_mosaic_gpu.VARIANTS`' names; each call is printed before it compiles.
"""

from __future__ import annotations

from absl import app, flags
import jax

import bench_mosaic_gpu  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_string("size", "8x256x16x128", "BxTxHxD; B*H sets the default config as in the benchmarks.")


def main(argv):
    del argv
    B, T, H, D = (int(x) for x in FLAGS.size.split("x"))
    args = bench_mosaic_gpu.inputs(B, T, H, D)
    for name in FLAGS.variants:
        cfg = bench_mosaic_gpu.config_of(name, B * H, D)
        print(f"=== {name}: {cfg}", flush=True)
        jax.block_until_ready(bench_mosaic_gpu.forward(cfg, D)(*args))


if __name__ == "__main__":
    app.run(main)
