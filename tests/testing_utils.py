"""Helpers shared by the tests: relative errors and fresh random inputs for every rule."""

from __future__ import annotations

import itertools
import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from deltajax.rules import chunk


# On a CPU the kernel tests run in the Pallas interpreters or lower for an abstract device, 10-40 s per case on a
# 2-core machine, and the full products of some parameter axes (every adversarial family under every kernel
# variant) would take most of a 90-minute CI run. There each axis's values are covered rather than crossed
# (`covering`); on an accelerator, where the kernels run compiled, and with DELTAJAX_FULL_MATRIX=1, every
# combination runs.
FULL_MATRIX = jax.default_backend() != "cpu" or os.environ.get("DELTAJAX_FULL_MATRIX") == "1"

# An abstract H100 for lowering the GPU kernels on a CPU: `with jax.sharding.use_abstract_mesh(H100):` around
# `jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`.
H100 = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                    abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                                   platform="gpu"))


def covering(*axes):
    """Parameter tuples over `axes` (sequences of values): their full product under `FULL_MATRIX`, else as many
    tuples as the longest axis has values, the i-th taking value i (cyclically) of every axis, so that every value
    of every axis appears and the shorter axes' values are spread evenly over the longer one's."""
    axes = [list(axis) for axis in axes]
    if FULL_MATRIX:
        return list(itertools.product(*axes))
    return [tuple(axis[i % len(axis)] for axis in axes) for i in range(max(map(len, axes)))]


def cpu_subset(cases, kept):
    """`cases`, or under a CPU run (not `FULL_MATRIX`) only those among `kept`: for parametrizations whose other
    cases repeat, in the interpreter, what further tests of the same kernel already cover (docs/testing.md says
    which and why)."""
    cases = list(cases)
    missing = [case for case in kept if case not in cases]
    assert not missing, missing
    return cases if FULL_MATRIX else [case for case in cases if case in kept]


def share(cases, index, parts):
    """The `index`-th of `parts` interleaved shares of `cases` (every `parts`-th case), or all of them under
    `FULL_MATRIX`: a test parametrized by index that loops over `cases` takes its share, and the shares of
    `parts` consecutive indices together hold every case."""
    cases = list(cases)
    return cases if FULL_MATRIX else cases[index % parts::parts]


def relative_error(x, ref):
    """||x - ref|| / ||ref|| in float64; inf when x has non-finite values."""
    x = np.asarray(jax.device_get(x), np.float64)
    ref = np.asarray(jax.device_get(ref), np.float64)
    if not np.all(np.isfinite(x)):
        return np.inf
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def chunk_form_bounds(run_chunk_form, o_ref, s_ref, floor):
    """(outputs, state) bounds for a chunked form on ill-conditioned inputs: `floor`, or twice the largest error
    against (o_ref, s_ref) of the XLA chunk form over C = 32, 64, 128 and both of its exact inverses
    (`run_chunk_form(chunk_size)` -> (o, final state), traced under each `chunk.INVERSE_METHOD`). One chunk form
    alone is one draw of the rounding a chunked algorithm meets there; the largest of the six is what fp32 allows."""
    out_error = state_error = 0.0
    for inverse, chunk_size in itertools.product(("solve", "blocked"), (32, 64, 128)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(chunk, "INVERSE_METHOD", inverse)  # read when the chunk form is traced
            o, s = run_chunk_form(chunk_size)
        out_error = max(out_error, relative_error(o, o_ref))
        state_error = max(state_error, relative_error(s, s_ref))
    return max(floor, 2.0 * out_error), max(floor, 2.0 * state_error)


def fresh_key():
    """A new PRNG key per call (inputs differ on every run); the seed is printed on failure by pytest's -l."""
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return jax.random.PRNGKey(seed)


def rule_inputs(key, *, B=2, T=65, H=2, Hv=None, K=16, V=8, decay="scalar", beta_max=1.0, packed=False,
                with_initial_state=False, normalise_keys=True, decay_scale=0.5, dtype=jnp.float32):
    """Random q, k, v, beta, log_decay, initial_state, segment_ids (never zeros), drawn from `key`.

    Drawn by numpy from the key's bits, not by jax.random: on a CPU each jax.random draw of a new shape compiles a
    program of its own (~0.6 s at the tests' LLVM level; 3-4 s per call of this function with new shapes, 2026-12-05),
    and a test run meets hundreds of shapes. The same key gives the same inputs, so a printed seed still replays."""
    Hv = Hv or H
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    q = rng.standard_normal((B, T, H, K), np.float32)
    k = rng.standard_normal((B, T, H, K), np.float32)
    if normalise_keys:
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, V), np.float32)
    beta = rng.uniform(0.05, beta_max, (B, T, Hv)).astype(np.float32)
    gate_shape = {"none": None, "scalar": (B, T, Hv)}.get(decay, (B, T, Hv, K))
    log_decay = None if gate_shape is None else (-decay_scale * rng.uniform(0.01, 1.0, gate_shape)).astype(np.float32)
    initial_state = rng.standard_normal((B, Hv, K, V), np.float32) if with_initial_state else None
    segment_ids = None
    if packed:
        # Documents of random lengths (some shorter than a chunk, some spanning chunk boundaries).
        starts = (rng.random((B, T)) < 0.04).astype(np.int32)
        segment_ids = np.cumsum(starts, axis=1, dtype=np.int32) + 3
    to_jax = lambda x, dtype=None: None if x is None else jnp.asarray(x if dtype is None else x.astype(dtype))
    return dict(q=to_jax(q, dtype), k=to_jax(k, dtype), v=to_jax(v, dtype), beta=to_jax(beta),
                log_decay=to_jax(log_decay), initial_state=to_jax(initial_state), segment_ids=to_jax(segment_ids))


def assert_tpu_lowering(forward, args, mesh_kind=None):
    """Lowers `forward(*args)` and its VJP for TPU (under an abstract mesh of `mesh_kind` chips when given), with
    the MLIR verifier on, and checks the Mosaic calls: one in the forward; the backward adds the chunk-state
    recomputation and the reverse pass."""

    def backward(*a):
        out, vjp = jax.vjp(forward, *a)
        return vjp(out)

    texts = []
    # enable_checks also runs the MLIR verifier over the Mosaic module that lowering serialises.
    with jax.enable_checks(True):
        for fn in (forward, backward):
            if mesh_kind is None:
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
            else:
                device = AbstractDevice(device_kind=mesh_kind, num_cores=1, platform="tpu")
                with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
                    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
            texts.append(lowered.as_text())
    assert texts[0].count("tpu_custom_call") == 1
    assert texts[1].count("tpu_custom_call") == 3
