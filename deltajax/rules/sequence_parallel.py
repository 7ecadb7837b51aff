"""Sequence (context) parallelism for the delta rule and linear attention under `jax.shard_map`.

Device p of the sequence axis holds tokens [p T/P, (p+1) T/P). Every chunk is an affine map of the state,
S_end = M S_0 + E (`chunk_state_map`), and composing the maps of a device's chunks (`compose_state_maps`, an
associative operator) gives the map of its whole slice, (M_p, E_p). The P slice maps are all-gathered and device p
starts from the exclusive prefix

    S_start_p = [(M_{p-1}, E_{p-1}) o ... o (M_0, E_0)] S_init,

then runs the chunked form on its slice from S_start_p. A document that starts exactly at a slice boundary zeroes
the incoming state, which in map form is M_p <- 0 (and a zero start state for that slice); documents that start
inside a slice are already handled by the chunk maps. Communication per call is one all-gather of P maps
[B, Hv, K, K + V] and of P boundary segment ids, independent of T.

Two ways in:
  * `delta_rule`, `linear_attention`, `delta_rule_with_step_size`: the rules' signature plus `mesh`, `axis_name`
    and `batch_axis`; they wrap the local form in `shard_map`. With `mesh=None` they use the mesh set by
    `use_sequence_parallel(...)` and, if none is set (or its sequence axis has size 1), run the ordinary
    single-device rule, so a layer can call them unconditionally.
  * `delta_rule_local`, `linear_attention_local`: the per-device form for code that is already inside a
    `shard_map` with `axis_name` bound.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from deltajax.rules.checks import check_rule_inputs
from deltajax.rules.chunk import chunk_factors, chunk_outputs, chunk_state_map, compose_state_maps
from deltajax.rules.common import HIGHEST

AxisNames = Union[None, str, Sequence[str]]


@dataclasses.dataclass(frozen=True)
class SequenceSharding:
    """Where the sequence lives: `mesh`, its sequence axis, and the mesh axes (if any) that shard the batch."""

    mesh: Mesh
    axis_name: str = "seq"
    batch_axis: AxisNames = None

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis_name]


_ACTIVE: contextvars.ContextVar[Optional[SequenceSharding]] = contextvars.ContextVar("sequence_sharding",
                                                                                     default=None)


@contextlib.contextmanager
def use_sequence_parallel(mesh: Mesh, axis_name: str = "seq", batch_axis: AxisNames = None):
    """Within this context (at trace time), the functions of this module shard the sequence over `axis_name`."""
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    token = _ACTIVE.set(SequenceSharding(mesh, axis_name, batch_axis))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_sequence_sharding() -> Optional[SequenceSharding]:
    """The sharding set by `use_sequence_parallel`, or None."""
    return _ACTIVE.get()


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=HIGHEST)


def _apply(m, e, state):
    """M S + E for maps [..., K, K], [..., K, V] and states [..., K, V]."""
    return _einsum("...ij,...jv->...iv", m, state) + e


# Both prefixes below compose one map at a time: `lax.associative_scan` inside a differentiated `shard_map`
# crashes the XLA CPU compiler (segmentation fault, jax 0.11.2), and the sequential forms cost the same
# N (or P) compositions of [K, K] maps.


def _cumulative_chunk_maps(m, e):
    """Inclusive prefix over the chunk axis 2 of [B, Hv, N, K, K] / [B, Hv, N, K, V] maps (chunk 0 first)."""
    m_t, e_t = jnp.moveaxis(m, 2, 0), jnp.moveaxis(e, 2, 0)

    def step(acc, chunk_map):
        acc = compose_state_maps(acc, chunk_map)
        return acc, acc

    _, (m_rest, e_rest) = jax.lax.scan(step, (m_t[0], e_t[0]), (m_t[1:], e_t[1:]))
    m_cum = jnp.concatenate([m_t[:1], m_rest], axis=0)
    e_cum = jnp.concatenate([e_t[:1], e_rest], axis=0)
    return jnp.moveaxis(m_cum, 0, 2), jnp.moveaxis(e_cum, 0, 2)


def _inclusive_prefix(all_m, all_e):
    """Maps of slices 0..p for every p from the gathered slice maps [P, ...] (P is static and small)."""
    ms, es = [all_m[0]], [all_e[0]]
    for p in range(1, all_m.shape[0]):
        m, e = compose_state_maps((ms[-1], es[-1]), (all_m[p], all_e[p]))
        ms.append(m)
        es.append(e)
    return jnp.stack(ms), jnp.stack(es)


def _local(q, k, v, beta, log_decay, initial_state, segment_ids, *, axis_name, scale, chunk_size):
    """One device's slice: (o [B, T_local, Hv, V] float32, final_state [B, Hv, K, V] of the whole sequence)."""
    B, T_local = q.shape[:2]
    Hv, V = v.shape[2], v.shape[3]
    K = q.shape[3]
    p = jax.lax.axis_index(axis_name)

    factors = chunk_factors(q, k, v, beta, log_decay, segment_ids=segment_ids, chunk_size=chunk_size)
    m, e = chunk_state_map(factors)  # [B, Hv, N, K, K], [B, Hv, N, K, V]
    m_in, e_in = _cumulative_chunk_maps(m, e)  # maps of chunks 0..n of this slice

    slice_m, slice_e = m_in[:, :, -1], e_in[:, :, -1]
    if segment_ids is not None:
        last_ids = jax.lax.all_gather(segment_ids[:, -1], axis_name, to="invarying")  # [P, B]
        previous_last = last_ids[jnp.maximum(p - 1, 0)]
        keeps_state = (p == 0) | (segment_ids[:, 0] == previous_last)  # [B]
        keep = keeps_state.astype(jnp.float32)[:, None, None, None]
    else:
        keep = jnp.ones((B, 1, 1, 1), jnp.float32)
    slice_m = slice_m * keep

    # Invariant gathers: every device holds the same P maps, so the final state is replicated over the axis; the
    # device-dependent uses below (its own prefix) make autodiff sum their cotangents across devices.
    all_m = jax.lax.all_gather(slice_m, axis_name, to="invarying")  # [P, B, Hv, K, K]
    all_e = jax.lax.all_gather(slice_e, axis_name, to="invarying")
    prefix_m, prefix_e = _inclusive_prefix(all_m, all_e)

    if initial_state is None:
        initial_state = jnp.zeros((B, Hv, K, V), jnp.float32)
    before = _apply(prefix_m[jnp.maximum(p - 1, 0)], prefix_e[jnp.maximum(p - 1, 0)], initial_state)
    start = jnp.where(p == 0, initial_state, before) * keep
    final_state = _apply(prefix_m[-1], prefix_e[-1], initial_state)

    # Start state of every local chunk: the exclusive within-slice prefix applied to the slice's start state.
    after = _einsum("bhnij,bhjv->bhniv", m_in, start) + e_in
    starts = jnp.concatenate([start[:, :, None], after[:, :, :-1]], axis=2)
    o = chunk_outputs(factors, starts, scale)  # [B, Hv, N, C, V]
    N, C = o.shape[2], o.shape[3]
    o = jnp.moveaxis(o.reshape(B, Hv, N * C, V), 1, 2)[:, :T_local]
    return o, final_state


def delta_rule_local(q, k, v, beta, log_decay=None, *, axis_name, scale=None, initial_state=None, segment_ids=None,
                     chunk_size=64):
    """The delta rule on this device's slice of T, inside a `shard_map` over `axis_name` (see module docstring).

    q, k [B, T_local, H, K], v [B, T_local, Hv, V], beta [B, T_local, Hv], log_decay None / [B, T_local, Hv(, K)],
    segment_ids [B, T_local] (global ids, not renumbered per slice), initial_state [B, Hv, K, V] (the state before
    the first token of the whole sequence, the same on every device). Returns (o [B, T_local, Hv, V] in v.dtype,
    final_state [B, Hv, K, V] float32 after the last token of the whole sequence, identical on every device).
    """
    scale, initial_state, segment_ids = check_rule_inputs(
        q, k, v, beta, log_decay, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
        state_passing="associative", scale=scale, needs_beta=True)
    o, final_state = _local(q, k, v, beta, log_decay, initial_state, segment_ids, axis_name=axis_name,
                            scale=scale, chunk_size=chunk_size)
    return o.astype(v.dtype), final_state


def linear_attention_local(q, k, v, log_decay=None, *, axis_name, scale=None, initial_state=None,
                           segment_ids=None, chunk_size=64):
    """Linear attention on this device's slice of T, inside a `shard_map`; see `delta_rule_local`."""
    scale, initial_state, segment_ids = check_rule_inputs(
        q, k, v, None, log_decay, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
        state_passing="associative", scale=scale, needs_beta=False)
    o, final_state = _local(q, k, v, None, log_decay, initial_state, segment_ids, axis_name=axis_name,
                            scale=scale, chunk_size=chunk_size)
    return o.astype(v.dtype), final_state


def _pad_time(x, pad, mode="constant"):
    if x is None or pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def _resolve(mesh, axis_name, batch_axis) -> Optional[SequenceSharding]:
    if mesh is None:
        return active_sequence_sharding()
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    return SequenceSharding(mesh, axis_name, batch_axis)


def _sharded(op, q, k, v, beta, log_decay, *, sharding, scale, initial_state, segment_ids, chunk_size):
    scale, initial_state, segment_ids = check_rule_inputs(
        q, k, v, beta, log_decay, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
        state_passing="associative", scale=scale, needs_beta=op == "delta_rule")
    T = q.shape[1]
    # Padding tokens (k = 0, beta = 0, no decay, same document as the last token) leave the state unchanged.
    pad = -T % sharding.size
    q, k, v, beta, log_decay = (_pad_time(x, pad) for x in (q, k, v, beta, log_decay))
    segment_ids = _pad_time(segment_ids, pad, mode="edge")

    batch, seq = sharding.batch_axis, sharding.axis_name
    if isinstance(batch, list):
        batch = tuple(batch)
    time_major = lambda x: None if x is None else P(batch, seq, *([None] * (x.ndim - 2)))
    args = dict(q=q, k=k, v=v, beta=beta, log_decay=log_decay, initial_state=initial_state,
                segment_ids=segment_ids)
    present = {name: x for name, x in args.items() if x is not None}
    specs = {name: (P(batch, None, None, None) if name == "initial_state" else time_major(x))
             for name, x in present.items()}

    def per_device(arrays):
        full = {name: arrays.get(name) for name in args}
        return _local(full["q"], full["k"], full["v"], full["beta"], full["log_decay"], full["initial_state"],
                      full["segment_ids"], axis_name=seq, scale=scale, chunk_size=chunk_size)

    o, final_state = jax.shard_map(per_device, mesh=sharding.mesh, in_specs=(specs,),
                                   out_specs=(P(batch, seq, None, None), P(batch, None, None, None)))(present)
    return o[:, :T].astype(v.dtype), final_state


def delta_rule(q, k, v, beta, log_decay=None, *, mesh: Optional[Mesh] = None, axis_name: str = "seq",
               batch_axis: AxisNames = None, scale=None, initial_state=None, segment_ids=None,
               return_final_state=True, impl="auto", chunk_size=64, state_passing="sequential"):
    """`deltajax.delta_rule` with T sharded over `mesh` axis `axis_name` (and B over `batch_axis`, if given).

    Without a mesh (argument or `use_sequence_parallel` context) or with a sequence axis of size 1 this is the
    ordinary rule with the same arguments. Sharded, every device runs the chunked XLA form on its slice
    (`impl` must be "auto" or "chunk"; `state_passing` is associative across and within devices). T need not
    divide by the axis size. Returns (o [B, T, Hv, V], final_state [B, Hv, K, V] float32 or None).
    """
    sharding = _resolve(mesh, axis_name, batch_axis)
    if sharding is None or sharding.size == 1:
        from deltajax.rules.delta_rule import delta_rule as single_device

        return single_device(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                             segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                             chunk_size=chunk_size, state_passing=state_passing)
    _check_impl(impl)
    o, final_state = _sharded("delta_rule", q, k, v, beta, log_decay, sharding=sharding, scale=scale,
                              initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size)
    return o, (final_state if return_final_state else None)


def linear_attention(q, k, v, log_decay=None, *, mesh: Optional[Mesh] = None, axis_name: str = "seq",
                     batch_axis: AxisNames = None, scale=None, initial_state=None, segment_ids=None,
                     return_final_state=True, impl="auto", chunk_size=64, state_passing="sequential"):
    """`deltajax.linear_attention` with T sharded over `axis_name`; see `delta_rule` of this module."""
    sharding = _resolve(mesh, axis_name, batch_axis)
    if sharding is None or sharding.size == 1:
        from deltajax.rules.linear_attention import linear_attention as single_device

        return single_device(q, k, v, log_decay, scale=scale, initial_state=initial_state,
                             segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                             chunk_size=chunk_size, state_passing=state_passing)
    _check_impl(impl)
    o, final_state = _sharded("linear_attention", q, k, v, None, log_decay, sharding=sharding, scale=scale,
                              initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size)
    return o, (final_state if return_final_state else None)


def delta_rule_with_step_size(rule, q, k, v, param, log_decay=None, *, eps=0.0, mesh: Optional[Mesh] = None,
                              axis_name: str = "seq", batch_axis: AxisNames = None, scale=None, initial_state=None,
                              segment_ids=None, return_final_state=True, impl="auto", chunk_size=64,
                              state_passing="sequential"):
    """`deltajax.rules.delta_rule_with_step_size` (Kaczmarz, relaxed Kaczmarz, Longhorn, EFLA) sequence-parallel.

    Runs the normalised-key reduction (`normalise_keys`) and then the sequence-parallel delta rule.
    """
    from deltajax.rules.step_size import STEP_RULES, check_step_parameter, normalise_keys
    from deltajax.rules.step_size import delta_rule_with_step_size as single_device

    sharding = _resolve(mesh, axis_name, batch_axis)
    if sharding is None or sharding.size == 1:
        return single_device(rule, q, k, v, param, log_decay, eps=eps, scale=scale, initial_state=initial_state,
                             segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                             chunk_size=chunk_size, state_passing=state_passing)
    if rule not in STEP_RULES:
        raise ValueError(f"rule must be one of {STEP_RULES}, got {rule!r}")
    check_step_parameter(rule, param, eps)
    if param is not None:
        param = param.astype(jnp.float32)
    k_hat, v_hat, beta_hat = normalise_keys(rule, k, v, param, eps)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return delta_rule(q, k_hat, v_hat, beta_hat, log_decay, mesh=sharding.mesh, axis_name=sharding.axis_name,
                      batch_axis=sharding.batch_axis, scale=scale, initial_state=initial_state,
                      segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                      chunk_size=chunk_size)


def _check_impl(impl):
    if impl not in ("auto", "chunk"):
        raise ValueError(f"the sequence-parallel form runs the chunked XLA form on every device; impl must be "
                         f"'auto' or 'chunk', got {impl!r}")


# The named rules, mirroring `deltajax.rules`, so a layer can swap `rules.<name>` for
# `sequence_parallel.<name>` and keep its arguments.


def deltanet(q, k, v, beta, **kwargs):
    """`deltajax.deltanet` (no decay), sequence-parallel; keywords as in `delta_rule` of this module."""
    return delta_rule(q, k, v, beta, None, **kwargs)


def gated_deltanet(q, k, v, beta, log_decay, **kwargs):
    """`deltajax.gated_deltanet` (log_decay [B, T, Hv]), sequence-parallel."""
    if log_decay is None or log_decay.ndim != 3:
        raise ValueError(f"gated_deltanet needs log_decay of shape [B, T, Hv], got "
                         f"{None if log_decay is None else log_decay.shape}")
    return delta_rule(q, k, v, beta, log_decay, **kwargs)


def kda(q, k, v, beta, log_decay, **kwargs):
    """`deltajax.kda` (log_decay [B, T, Hv, K]), sequence-parallel."""
    if log_decay is None or log_decay.ndim != 4:
        raise ValueError(f"kda needs log_decay of shape [B, T, Hv, K], got "
                         f"{None if log_decay is None else log_decay.shape}")
    return delta_rule(q, k, v, beta, log_decay, **kwargs)


def kaczmarz(q, k, v, log_decay=None, **kwargs):
    """`deltajax.kaczmarz` (step 1 / |k|^2 on raw keys), sequence-parallel."""
    return delta_rule_with_step_size("kaczmarz", q, k, v, None, log_decay, **kwargs)


def relaxed_kaczmarz(q, k, v, rho, log_decay=None, *, eps=1e-6, **kwargs):
    """`deltajax.relaxed_kaczmarz`, sequence-parallel."""
    return delta_rule_with_step_size("relaxed_kaczmarz", q, k, v, rho, log_decay, eps=eps, **kwargs)


def longhorn(q, k, v, gamma, log_decay=None, **kwargs):
    """`deltajax.longhorn`, sequence-parallel."""
    return delta_rule_with_step_size("longhorn", q, k, v, gamma, log_decay, **kwargs)


def efla(q, k, v, eta, log_decay=None, **kwargs):
    """`deltajax.efla`, sequence-parallel."""
    return delta_rule_with_step_size("efla", q, k, v, eta, log_decay, **kwargs)
