"""The jitted calls of `impl="mosaic"` that the Mosaic GPU benchmarks and the profiling script time."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltajax.kernels.gpu import mosaic_wy


def training_step(cfg, D):
    """The gradients of sum(o) + sum(final state) with respect to q, k, v, beta and the log-decay, jitted: a
    forward+backward with `mosaic_wy.Config` cfg (no initial state, no documents)."""
    def loss(q, k, v, beta, log_decay):
        o, final = mosaic_wy.chunk_wy_mosaic(q, k, v, beta, log_decay, scale=D ** -0.5, initial_state=None,
                                             segment_ids=None, config=cfg)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)
    return jax.jit(jax.grad(loss, argnums=range(5)))


def training_step_cells(ms, configs, D, args):
    """A table cell per config: the time of its training step on `args` (`ms(fn, *args)`, formatted), or why it
    failed."""
    cells = []
    for cfg in configs:
        try:
            cells.append(f"{ms(training_step(cfg, D), *args):.3f}")
        except Exception as e:  # a config that does not compile or run is a row entry, not the end of the table
            cells.append(f"failed: {type(e).__name__}: {str(e)[:200]}")
    return cells
