"""Times the L2 prefetches of the Mosaic GPU kernels on and off in one process: the Gated DeltaNet gradient kernel
alone (`mosaic_wy_grads.grads(..., prefetch_ahead=N)` on the Triton passes' residuals, outputs compared bit for bit
with the first setting's) and whole calls of `impl="mosaic"` for the Gated DeltaNet and KDA with
`mosaic_wy_grads.PREFETCH_AHEAD` and `mosaic_kda.PREFETCH_CHUNKS` set (marginal device time per call, ms).

    python experiments/bench_l2_prefetch.py [grads] [gdn] [kda]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

import deltajax
from deltajax.kernels.gpu import mosaic_kda, mosaic_wy_grads
import _timing  # experiments/
from _kernel_inputs import kernel_inputs  # experiments/
from bench_mosaic_grads import residuals  # experiments/


def ms(fn, *args):
    return _timing.marginal_ms(fn, *args, iters=10)


def rule_inputs(rule, B, T, H, D, seed=0):
    """bf16 q, k (unit rows), v; beta in (0, 1); log-decays near log(0.95), per channel for KDA."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, k, v = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in keys[:3])
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H)))
    gates = (B, T, H, D) if rule == "kda" else (B, T, H)
    log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[4], gates) + 3.0)
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), beta, log_decay


def gradient_kernel_alone(size, aheads):
    B, T, H, D = (int(x) for x in size.split("x"))
    _, _, res = residuals(B, T, H, D, *kernel_inputs(B, T, H, D, per_channel=False))
    res = res[:11] + tuple(jax.jit(mosaic_wy_grads.as_pair)(r) for r in res[11:])
    first = None
    for ahead in aheads:
        fn = jax.jit(lambda *r, a=ahead: mosaic_wy_grads.grads(*r, scale=D ** -0.5, segmented=False,
                                                               interpret=False, prefetch_ahead=a))
        out = fn(*res)
        first = out if first is None else first
        same = all(bool(jnp.array_equal(o, f)) for o, f in zip(out, first))
        print(f"gradient kernel {size} prefetch_ahead={ahead}: {ms(fn, *res):.3f} ms, bit-equal {same}", flush=True)


def whole_calls(rule, size, settings):
    B, T, H, D = (int(x) for x in size.split("x"))
    args = rule_inputs(rule, B, T, H, D)
    call = lambda q, k, v, beta, g: deltajax.delta_rule(q, k, v, beta, g, impl="mosaic")[0]
    for ahead, chunks in settings:
        mosaic_wy_grads.PREFETCH_AHEAD, mosaic_kda.PREFETCH_CHUNKS = ahead, chunks  # read when traced
        forward = jax.jit(lambda *a: call(*a))
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(call(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)))
        print(f"{rule} {size} PREFETCH_AHEAD={ahead} PREFETCH_CHUNKS={chunks}: forward {ms(forward, *args):.3f}, "
              f"forward+backward {ms(grad, *args):.3f}", flush=True)


def main(which):
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%H:%M:%S')}", flush=True)
    if "grads" in which:
        gradient_kernel_alone("8x2048x16x128", [0, 132, 264, 66, 0, 132])
        gradient_kernel_alone("1x32768x16x128", [0, 132, 264])
    if "gdn" in which:
        whole_calls("gated_deltanet", "8x2048x16x128", [(0, 0), (132, 0), (0, 0), (132, 0)])
        whole_calls("gated_deltanet", "1x32768x16x128", [(0, 0), (132, 0)])
    if "kda" in which:
        whole_calls("kda", "8x2048x16x128", [(0, 0), (0, 1), (0, 2), (0, 4), (0, 0), (0, 2), (132, 2)])


if __name__ == "__main__":
    main(sys.argv[1:] or ["grads", "gdn", "kda"])
