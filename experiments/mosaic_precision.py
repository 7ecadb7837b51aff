"""Where the Mosaic GPU forward pass (`kernels/gpu/mosaic_wy.py`) loses precision: relative errors of o and of the
final state against the fp32 scan, next to the Triton forward pass, on cases that switch the kernel's pieces on one
at a time, with the split products' lo terms accumulated with hi*hi ("shared") or apart ("separate",
`mosaic_wy.LO_ACCUMULATORS`).

    python experiments/mosaic_precision.py               # on the H100: the compiled kernels
    python experiments/mosaic_precision.py --time_size=8x2048x16   # ... and their forward times there
    python experiments/mosaic_precision.py --interpret   # on CPU: the Mosaic GPU and Pallas interpreters

Cases (bf16 q/k/v, K = V = 128; the scan sees the same rounded values in fp32):
  one_chunk      T = 64, no initial state, no decay: S_0 = 0, so KS = QS = 0; only u = T diag(beta) v, P u and the
                 state update K^T u act.
  one_chunk_gate T = 64, scalar decay: adds the gate factors (to_end, from_start, survive) and exp in P.
  two_chunks     T = 128, no initial state: the second chunk reads the first one's state (K S_0, Q S_0 split).
  initial_state  T = 64 with an initial state: the state's load, survive * S_0 and K S_0 from it.
  long           T = 1000, packed documents, initial state, beta up to 2 (the GPU test's case).
On the H100 (2026-11-23) every case gave the final state 9e-5 to 5e-4 from the scan for both options, against
2.5e-6 to 4e-6 for Triton: T's lo half had been folded to zero by XLA (docs/mosaic.md, "Cause found"), since fixed
by `common.split_bf16_in_xla`.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu.mosaic_wy import HEAD_DIM, LO_ACCUMULATORS, chunk_wy_mosaic, default_config
from deltajax.kernels.gpu.wy_chunk import chunk_wy
from deltajax.rules.scan import recurrent_scan
from _timing import times_ms  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["one_chunk", "one_chunk_gate", "two_chunks", "initial_state", "long"], "Names of CASES.")
flags.DEFINE_integer("draws", 2, "Random draws per case.")
flags.DEFINE_bool("interpret", False, "Run the kernels in the interpreters (CPU).")
flags.DEFINE_string("time_size", "", "BxTxH (D = 128, bf16, scalar decay): also time the forward passes there "
                    "(median of --iters runs; GPU only). Empty: errors only.")
flags.DEFINE_integer("iters", 20, "Timed runs per kernel for --time_size.")

# name: (B, T, H, decay, initial state, packed, beta_max)
CASES = {
    "one_chunk": (1, 64, 2, False, False, False, 1.0),
    "one_chunk_gate": (1, 64, 2, True, False, False, 1.0),
    "two_chunks": (1, 128, 2, False, False, False, 1.0),
    "initial_state": (1, 64, 2, False, True, False, 1.0),
    "long": (2, 1000, 4, True, True, True, 2.0),
}


def _inputs(key, B, T, H, decay, init, packed, beta_max):
    D = HEAD_DIM
    ks = jax.random.split(key, 7)
    k = jax.random.normal(ks[1], (B, T, H, D))
    x = dict(q=jax.random.normal(ks[0], (B, T, H, D)).astype(jnp.bfloat16),
             k=(k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16),
             v=jax.random.normal(ks[2], (B, T, H, D)).astype(jnp.bfloat16),
             beta=beta_max * jax.random.uniform(ks[3], (B, T, H)),
             log_decay=-0.5 * jax.random.uniform(ks[4], (B, T, H)) if decay else None,
             initial_state=jax.random.normal(ks[5], (B, H, D, D)) if init else None,
             segment_ids=jnp.cumsum(jax.random.bernoulli(ks[6], 0.01, (B, T)), axis=1) if packed else None)
    return x


def _run(fn, x, **kwargs):
    call = lambda x: fn(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], scale=0.3,
                        initial_state=x["initial_state"], segment_ids=x["segment_ids"], **kwargs)
    return jax.jit(call)(x)


def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv):
    del argv
    interpret = FLAGS.interpret or jax.default_backend() != "gpu"
    print(f"# backend {jax.default_backend()}, jax {jax.__version__}, interpret={interpret}")
    print("| case | draw | bf16 floor of o | mosaic o | mosaic state | mosaic o, separate | mosaic state, separate "
          "| triton o | triton state |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in FLAGS.cases:
        for draw in range(FLAGS.draws):
            x = _inputs(jax.random.PRNGKey(draw), *CASES[name])
            reference = dict(x, **{n: x[n].astype(jnp.float32) for n in ("q", "k", "v")})
            o_ref, s_ref = _run(recurrent_scan, reference)
            floor = _relative(o_ref.astype(jnp.bfloat16), o_ref)
            errors = []
            for lo_accumulators in LO_ACCUMULATORS:
                o, s = _run(chunk_wy_mosaic, x, interpret=interpret, config=dataclasses.replace(
                    default_config(interpret), lo_accumulators=lo_accumulators))
                errors += [_relative(o, o_ref), _relative(s, s_ref)]
            o, s = _run(chunk_wy, x, interpret=interpret)
            errors += [_relative(o, o_ref), _relative(s, s_ref)]
            print(f"| {name} | {draw} | {floor:.2e} | " + " | ".join(f"{e:.2e}" for e in errors) + " |", flush=True)
    if FLAGS.time_size and not interpret:
        _time(*(int(n) for n in FLAGS.time_size.split("x")))


def _time(B, T, H):
    """Forward-pass medians (ms) of both Mosaic options and of the Triton pass on one input."""
    x = _inputs(jax.random.PRNGKey(0), B, T, H, True, True, False, 1.0)
    print(f"\n| forward pass, {B}x{T}x{H}x{HEAD_DIM} bf16 | median ms | min ms |\n|---|---:|---:|")
    kernels = [(f"mosaic, {lo}", functools.partial(chunk_wy_mosaic,
                                                      config=dataclasses.replace(default_config(), lo_accumulators=lo)))
               for lo in LO_ACCUMULATORS]
    for label, fn in kernels + [("triton", chunk_wy)]:
        step = jax.jit(lambda x, fn=fn: fn(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], scale=0.3,
                                           initial_state=x["initial_state"], segment_ids=None))
        times = times_ms(step, x, iters=FLAGS.iters)
        print(f"| {label} | {statistics.median(times):.3f} | {min(times):.3f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
