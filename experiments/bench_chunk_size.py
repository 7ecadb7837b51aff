"""Compile time and device time of each Triton forward kernel of Gated DeltaNet at other chunk sizes, each kernel
in a process of its own with a time limit.

    python experiments/bench_chunk_size.py --sizes=1x32768x16x128 --chunk_sizes=128 --variants=ps2 \
        --kernels=state,output --time_limit=150

Chunks of 128 halve the sequential steps of the passes (docs/kernels.md, "Chunks of 128: each kernel alone"). A
whole forward at C = 128 did not finish compiling in four minutes on two GPUs: compiled on a CPU by Triton 3.9, the
in-chunk inverse's compile grows (the default one took 882 s, the batched one 113 s) where the passes and the output
kernel take seconds. Here a compile that runs past `--time_limit` costs that kernel's row alone. Rows: the
in-chunk inverse (`_inverses`), the state pass ("split" output method's `_state_pass`, u saved as its bf16 pair as
training does), the chunk-parallel output kernel (`_output_pass`), and the whole forward pass (`_forward_pass` with
the call's output method). The passes and the output kernel read random T, start states and u of the right shapes
(their values do not change the time), so a slow inverse does not hold them up. Each variant is one of `VARIANTS`
below or a `bench_pallas_gpu` variant, applied over `wy_chunk.default_config` with the chunk size replaced.
"""

from __future__ import annotations

import subprocess
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from deltajax.kernels.gpu import wy_chunk
import bench_pallas_gpu  # experiments/; its flags --sizes, --variants, --dtype, --timing, --iters, --interpret

FLAGS = flags.FLAGS
FLAGS.set_default("sizes", ["1x32768x16x128"])
flags.DEFINE_list("chunk_sizes", ["64", "128"], "Chunk sizes C.")
flags.DEFINE_list("kernels", ["inverse", "state", "output", "forward"], "Which of KERNELS to time.")
flags.DEFINE_integer("time_limit", 150, "Seconds one kernel's process may take (compile and timing).")
flags.DEFINE_string("one", "", "Internal: time one kernel, KERNEL,C,SIZE,VARIANT, in this process.")

KERNELS = ("inverse", "state", "output", "forward")
# Layouts for C = 128 beside bench_pallas_gpu's "c128*" variants. A stage of the state pass (k, v and T's pair) takes
# ~100 KB at C = 128: three stages (the default at one program per SM) ask 314,368 bytes of shared memory, over the
# H100's 232,448, two ask 210,432 (Triton 3.9's compile for sm_90 on a CPU, 2026-12-07). The output kernel's C x C
# scores stay whole; its V block of 32 halves its other tiles.
VARIANTS = {
    "ps2": dict(pass_stages=2),
    "ps2_output_bv32": dict(pass_stages=2, output_block_v=32),
    "ps2_batched": dict(pass_stages=2, inverse_method="batched16"),
}


def _config(q, v, chunk_size, variant):
    D = q.shape[-1]
    cfg = wy_chunk.default_config(q, v, scale=D ** -0.5, chunk_size=64, delta=True, segmented=False,
                                  interpret=FLAGS.interpret)
    changes = dict(VARIANTS.get(variant) or bench_pallas_gpu.VARIANTS[variant])
    changes["chunk_size"] = chunk_size
    return wy_chunk.replace_config(cfg, **changes)


def _random_like(shapes, seed):
    """Random arrays of the shapes and dtypes of `shapes` (a pytree of ShapeDtypeStruct), small enough that no
    pass overflows."""
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [(0.05 * jax.random.normal(key, s.shape)).astype(s.dtype)
                                     for key, s in zip(keys, leaves)])


def time_one(kernel, chunk_size, size, variant):
    """Prints `compile S s` then `time MS ms` for one kernel (the parent process reads them)."""
    B, T, H, D = (int(x) for x in size.split("x"))
    q, k, v, beta, log_decay = bench_pallas_gpu.inputs(B, T, H, D)
    cfg = _config(q, v, chunk_size, variant)
    g = wy_chunk._in_chunk_cumsum(cfg, log_decay)
    doc = jnp.zeros((B, T), jnp.int32)
    ones = jnp.ones((B, T), jnp.float32)
    h0 = jnp.zeros((B, H, D, D), jnp.float32)
    inverse = lambda k, beta, g: wy_chunk._inverses(cfg, k, beta, g, doc)
    t = _random_like(jax.eval_shape(inverse, k, beta, g), 1)
    state = lambda k, v, beta, t, g: wy_chunk._state_pass(cfg, k, v, beta, t, g, ones, ones, h0, u_pair=True)
    if kernel == "inverse":
        fn, args = inverse, (k, beta, g)
    elif kernel == "state":
        fn, args = state, (k, v, beta, t, g)
    elif kernel == "output":
        _, starts, u = _random_like(jax.eval_shape(state, k, v, beta, t, g), 2)
        fn = lambda q, k, u, g, starts: wy_chunk._output_pass(cfg, q, k, u, g, doc, ones, starts, v.dtype)
        args = (q, k, u, g, starts)
    else:
        fn = lambda q, k, v, beta, t, g: wy_chunk._forward_pass(cfg, q, k, v, beta, t, g, doc, ones, ones, h0,
                                                                with_states=False)
        args = (q, k, v, beta, t, g)
    jitted = jax.jit(fn)
    start = time.perf_counter()
    jitted.lower(*args).compile()
    print(f"compile {time.perf_counter() - start:.1f} s", flush=True)
    print(f"time {bench_pallas_gpu.time_ms(jitted, *args, iters=FLAGS.iters):.3f} ms", flush=True)


def run_one(kernel, chunk_size, size, variant):
    """(compile seconds, ms) of one kernel in a child process, as cells; what stopped it where it did not finish."""
    argv = [sys.executable, __file__, f"--one={kernel},{chunk_size},{size},{variant}", f"--iters={FLAGS.iters}",
            f"--dtype={FLAGS.dtype}", f"--timing={FLAGS.timing}", f"--interpret={FLAGS.interpret}"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=FLAGS.time_limit)
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else stopped.stdout or ""
        compiled = [line.split()[1] for line in out.splitlines() if line.startswith("compile ")]
        return (compiled[0] if compiled else f"> {FLAGS.time_limit}"), f"stopped at {FLAGS.time_limit} s"
    cells = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()
             if line.startswith(("compile ", "time "))}
    if result.returncode != 0 or "time" not in cells:
        error = (result.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return cells.get("compile", "-"), f"failed: {error}"
    return cells["compile"], cells["time"]


def main(argv):
    del argv
    if FLAGS.one:
        kernel, chunk_size, size, variant = FLAGS.one.split(",")
        time_one(kernel, int(chunk_size), size, variant)
        return
    for kernel in FLAGS.kernels:
        if kernel not in KERNELS:
            raise ValueError(f"--kernels: each must be one of {KERNELS}, got {kernel!r}")
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {FLAGS.dtype}, each kernel in its own process "
          f"(limit {FLAGS.time_limit} s)")
    print("| size | C | variant | kernel | compile s | ms |")
    print("|---|---:|---|---|---:|---:|")
    for size in FLAGS.sizes:
        for chunk_size in FLAGS.chunk_sizes:
            for variant in FLAGS.variants:
                for kernel in FLAGS.kernels:
                    compile_s, ms = run_one(kernel, chunk_size, size, variant)
                    print(f"| {size} | {chunk_size} | {variant} | {kernel} | {compile_s} | {ms} |", flush=True)


if __name__ == "__main__":
    app.run(main)
