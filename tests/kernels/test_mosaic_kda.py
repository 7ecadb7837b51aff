"""The Mosaic GPU passes of KDA (`kernels/gpu/mosaic_kda.py`): the forward pass (`kda.Config.pass_backend`) and the
reverse pass (`kda.Config.reverse_backend`).

On CPU: the passes in the Mosaic GPU interpreter against the fp32 scan (the bf16 bounds) and against the Triton
passes on the same stored operands (the same products, so equal up to fp32 summation order and the bf16 rounding
flips that moves: `test_gpu_kda._assert_equal_up_to_16_bit_rounding`), on random, packed and adversarial inputs,
with and without an initial state, at T not a multiple of 64, both layouts and state-block widths and both output
products; the forward's saved start states and u pair against the Triton pass's; T and P as the bf16 pairs prepare
writes for them; the gradients against the scan; the refusals; the dispatch; the whole call and its gradient
lowered for an abstract H100. On a GPU: the compiled passes against the scan, with gradients.
"""

import dataclasses
import itertools
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from deltajax.kernels import gpu as pallas_gpu
from deltajax.kernels.gpu import kda, mosaic_kda
from deltajax.kernels.gpu.common import split_bf16_in_xla
from deltajax.rules import dispatch
from test_gpu_kda import (ADVERSARIAL, BF16_OUT_TOL, H100, ON_GPU, _adversarial, _assert_equal_up_to_16_bit_rounding,
                          _bf16_grad_tol, _call, _check, _grads, _inputs, _round_trip_bf16)
from testing_utils import FULL_MATRIX, covering, cpu_subset, relative_error, share

warnings.filterwarnings("ignore", message=".*triton.*", category=DeprecationWarning)

D = 128


def _config(x, **overrides):
    cfg = kda.default_config(x["q"], x["v"], scale=x["scale"], chunk_size=64,
                             segmented=x["segment_ids"] is not None, interpret=not ON_GPU)
    return dataclasses.replace(cfg, **overrides)


def _fn(cfg):
    return lambda *a, **kw: kda.kda_chunk(*a, **kw, config=cfg)


def _bf16_case(x):
    x = _round_trip_bf16(x)
    x["scale"] = D ** -0.5
    return x


# The kernel variants: one warpgroup per V block of 64 or 32 columns (with a producer warpgroup beside it in both
# passes, or `emit_pipeline`), or one CTA per head (two consumers and a producer), with the output's state product
# "split" (the default) or plain bf16.
VARIANTS = {
    "bv64": dict(mosaic_block_v=64),
    "bv32": dict(mosaic_block_v=32),
    "bv32_producer": dict(mosaic_block_v=32, mosaic_producer=True, mosaic_reverse_producer=True),
    "bv64_producer": dict(mosaic_block_v=64, mosaic_producer=True, mosaic_reverse_producer=True),
    "shared_head": dict(mosaic_shared_head=True),
    "bv64_output_bf16": dict(mosaic_block_v=64, output_dots="bf16"),
    "shared_head_output_bf16": dict(mosaic_shared_head=True, output_dots="bf16"),
    "shared_heads": dict(mosaic_shared_head=True, mosaic_reverse_shared_head=True),
}

# Interpreting the producer layout (`kda.Config.mosaic_producer`) takes four threads in XLA's CPU intra-op pool. The
# Mosaic GPU interpreter runs each warpgroup of a CTA as its own XLA CPU program; XLA's CPU runtime hands parts of
# such programs to that pool (one thread per core unless PJRT_NPROC says otherwise), and a warpgroup blocked in a
# barrier wait holds the pool thread it runs on. With two threads (a 2-core machine) the grid loop's callback and
# the blocked warpgroup held both while the other warpgroup's program waited for one: `bv32_producer`'s interpreter
# tests hung in 2 of 3 runs beside busy loops (2026-12-06; gdb: both pool threads in Python callbacks, the other
# warpgroup's thread in `tsl::BlockUntilReady`); with PJRT_NPROC=4 beside the same loops, 4 of 4 passed. The
# shared-head layout's tests (three warpgroups) never hung with two threads; why the two differ was not found.
# Four threads leave one free (the callback and one per warpgroup); tests/conftest.py asks for them on a CPU.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
PRODUCER_INTERPRETABLE = int(os.environ.get("PJRT_NPROC") or os.environ.get("NPROC") or _CORES) >= 4
needs_four_threads = pytest.mark.skipif(not PRODUCER_INTERPRETABLE,
                                        reason="below four pool threads the interpreter can starve the producer layout")


def _interpreted(variants):
    """`variants` as parameters of an interpreter test: the producer layout's only where it cannot starve."""
    return [pytest.param(name, marks=needs_four_threads) if VARIANTS[name].get("mosaic_producer") else name
            for name in variants]


# The two passes' final states (fp32) to the bound of a flipped bf16 rounding rather than 1e-5: both read the
# state rounded to bf16 (y = V - (A.K) bf16(S)), and where their fp32 sums differ in the last bit, an element of
# bf16(S) near a rounding boundary rounds the other way (0-6 elements per chunk start state at K = V = 128). The
# flipped element moves y by an ulp of itself times a column of A.K, and the state after it by that through u.
# Measured on CPU (2026-12-03, T = 130, packed, Hv = 2, one CTA per head, 40 draws): 3.6e-7 at most in the 9 draws
# where no start state that reaches the final state had a flip, up to 3.9e-6 in the 31 where one had; CI on
# another CPU drew 1.85e-5 (seed 1881883527). The outputs too are held to the bound of a flipped operand
# (`per_element=False`, 5e-4 relative), not one ulp per element: the flip moves a column of the next chunk's outputs,
# several ulps of an output that cancels (`test_saved_states_and_u_equal_the_triton_pass_in_interpreter`).
FLIPPED_STATE_TOL = 5e-4


def _against_triton(x, label, **overrides):
    """The Mosaic pass against the fp32 scan (bf16 bounds, no gradients) and against the Triton pass on the same
    call (`overrides` on both)."""
    mosaic = _config(x, pass_backend="mosaic", **overrides)
    mosaic_outputs, _ = _check(x, BF16_OUT_TOL, None, fn=_fn(mosaic), label=label)
    triton = dataclasses.replace(mosaic, pass_backend="triton")
    _assert_equal_up_to_16_bit_rounding(mosaic_outputs, _call(_fn(triton), x), per_element=False,
                                        fp32_tol=FLIPPED_STATE_TOL)


@pytest.mark.parametrize("variant", _interpreted(name for name in VARIANTS if name != "shared_heads"))
def test_matches_scan_and_the_triton_pass_in_interpreter(variant):
    """T = 130 (a partial last chunk), packed documents, an initial state, beta up to 2, two value heads per key
    head."""
    x = _bf16_case(_inputs(T=130, B=1, H=1, Hv=2, K=D, V=D))
    _against_triton(x, f"mosaic-{variant}", **VARIANTS[variant])


@pytest.mark.parametrize("family,variant", covering(ADVERSARIAL, ("bv64", "shared_head")))
def test_adversarial_in_interpreter(family, variant):
    """-20 decays everywhere, -20 beside ~0 in one chunk, correlated keys with beta near 2. Against the Triton
    pass the outputs are held to 5e-4 relative rather than one ulp per element: where o cancels (correlated keys),
    a flipped bf16 operand rounding moves an element by more than its own ulp (seen on the H100 in 230 and 1745
    of 256,000 elements at 5e-5 and 1.8e-4 relative)."""
    x = _bf16_case(_adversarial(family, B=1, T=100, H=1, Hv=1, K=D, V=D))
    _against_triton(x, f"mosaic-{variant}-{family}", **VARIANTS[variant])


# K or V of 64, V of 256 (`mosaic_kda.DISPATCH_KEY_DIMS`, `VALUE_DIMS`), with the layouts each takes: V blocks of
# 64 or 32 columns, and at V = 128 one CTA per head.
OTHER_HEAD_DIMS = [(64, 64), (64, 128), (128, 64), (128, 256), (64, 256)]


def _other_dims_variants(V):
    return ["bv64", "bv32"] + (["shared_head"] if V == 2 * 64 else [])


@pytest.mark.parametrize("index,K,V", [(i, *dims) for i, dims in enumerate(OTHER_HEAD_DIMS)])
def test_other_head_dims_match_scan_and_the_triton_pass_in_interpreter(index, K, V):
    """K or V of 64, V of 256, in every layout (on a CPU V blocks of 64 and a `share` of the others, 20-30 s each
    on a 2-core machine): T = 130, packed documents, an initial state, beta up to 2, two value heads per key head.
    Against the Triton pass the outputs are held to the relative bound of a flipped bf16 operand rounding (as in
    `test_adversarial_in_interpreter`), not one ulp per element: the layouts run here in one test each."""
    x = _bf16_case(_inputs(T=130, B=1, H=1, Hv=2, K=K, V=V))
    first, *others = _other_dims_variants(V)
    for variant in [first, *share(others, index, 2)]:
        _against_triton(x, f"mosaic-{K}x{V}-{variant}", **VARIANTS[variant])


# On a CPU (70 s per case on a 2-core machine) each K, and V of 64 and 256 (V = 128: the other gradient tests).
GRADIENT_HEAD_DIMS = OTHER_HEAD_DIMS if FULL_MATRIX else [(64, 64), (128, 256)]


@pytest.mark.parametrize("K,V", GRADIENT_HEAD_DIMS)
def test_other_head_dims_gradients_through_both_mosaic_passes_in_interpreter(K, V):
    """K or V of 64, V of 256, both passes in Mosaic GPU (the layout `mosaic_config` picks by head count: one
    warpgroup per V block of 64): every gradient at the bf16 bounds against the scan, and equal to the gradients
    through the Triton passes up to the 16-bit rounding flips."""
    x = _bf16_case(_inputs(T=130, B=1, H=1, Hv=2, K=K, V=V))
    mosaic = _config(x, pass_backend="mosaic", reverse_backend="mosaic", mosaic_block_v=64)
    _, mosaic_grads = _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(mosaic), label=f"mosaic-reverse-{K}x{V}")
    triton = dataclasses.replace(mosaic, pass_backend="triton", reverse_backend="triton")
    _assert_equal_up_to_16_bit_rounding(mosaic_grads, _grads(_fn(triton), x), per_element=False)


def test_wide_keys_through_both_mosaic_passes_in_interpreter():
    """K = 256 (opt-in, state blocks of 16 columns: `mosaic_kda.WIDE_KEY_BLOCK_V`), both passes in Mosaic GPU:
    the outputs and every gradient at the bf16 bounds against the scan, and equal to those through the Triton passes
    up to the 16-bit rounding flips."""
    x = _bf16_case(_inputs(T=130, B=1, H=1, Hv=2, K=256, V=64))
    mosaic = _config(x, pass_backend="mosaic", reverse_backend="mosaic", mosaic_block_v=mosaic_kda.WIDE_KEY_BLOCK_V)
    mosaic_outputs, mosaic_grads = _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(mosaic),
                                          label="mosaic-reverse-256x64")
    triton = dataclasses.replace(mosaic, pass_backend="triton", reverse_backend="triton")
    _assert_equal_up_to_16_bit_rounding(mosaic_outputs, _call(_fn(triton), x), per_element=False,
                                        fp32_tol=FLIPPED_STATE_TOL)
    _assert_equal_up_to_16_bit_rounding(mosaic_grads, _grads(_fn(triton), x), per_element=False)


@pytest.mark.parametrize("block_v", [32, 64])
def test_wide_keys_refuse_wider_state_blocks(block_v):
    """At K = 256 one stage's operand tiles leave SMEM for state blocks of 16 columns only."""
    x = _bf16_case(_inputs(T=64, B=1, H=1, Hv=1, K=256, V=64))
    with pytest.raises(ValueError, match="at K=256 takes block_v=16"):
        _call(_fn(_config(x, pass_backend="mosaic", mosaic_block_v=block_v)), x)


def _pass_outputs(cfg, x):
    """The forward pass's (o, final state, start states, u's pair) on x, from the stored operands."""
    B, T = x["beta"].shape[:2]
    C = cfg.chunk_size
    pad = -T % C
    padded = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    ones = jnp.ones((B, T + pad), jnp.float32)
    q, k, v = (padded(x[n]) for n in ("q", "k", "v"))
    beta, log_decay = padded(x["beta"]), padded(x["log_decay"])
    doc = jnp.zeros((B, T + pad), jnp.int32)

    def run(q, k, v, beta, log_decay, h0):
        g, glo, src = kda._gates_and_operands(cfg, q, k, log_decay, ones, ones)
        t, p = kda._prepare(cfg, q, k, g, glo, beta, doc)
        return kda._forward_pass(cfg, src, v, beta, t, p, h0, with_states=True)

    return jax.jit(run)(q, k, v, beta, log_decay, x["initial_state"])


@pytest.mark.parametrize("variant", _interpreted(["bv64", "bv32_producer", "shared_head"]))
def test_saved_states_and_u_equal_the_triton_pass_in_interpreter(variant):
    """Differentiated, the pass writes every chunk's start state as bf16 and u as its bf16 pair, what the Triton
    pass writes with bf16 storage and `grads_from_passes`: the final and the start states equal up to the bf16
    rounding flips (the final state to `FLIPPED_STATE_TOL`), u (hi + lo; the lo halves alone differ where u differs
    in its last fp32 bits) to 1e-5, which u's hi half alone misses (a flip moves 64 of u's 25,600 elements: on CPU,
    19 draws, 8.6e-7 at most with flips, the hi half alone 1.6e-3). o is held to the bound for outputs downstream of
    a flipped bf16 operand (`per_element=False`): both passes read bf16(S) in (A.K) S, so a start state that rounds
    the other way moves a column of the next chunk's outputs by 2^-8 of one state term, several ulps of an output
    that cancels (CI, seed 843683923, shared_head: bf16(S) of chunk 1 flipped at row 119, column 11, 0.8164 against
    0.8125, and o at token 67, column 11 moved 3 ulps, -0.007324 against -0.007233; o 3.0e-6 relative)."""
    x = _bf16_case(_inputs(T=200, B=1, H=1, Hv=1, K=D, V=D, packed=False))
    mosaic = _config(x, pass_backend="mosaic", **VARIANTS[variant])
    triton = dataclasses.replace(mosaic, pass_backend="triton")
    (o, final, starts, u), (o_t, final_t, starts_t, u_t) = _pass_outputs(mosaic, x), _pass_outputs(triton, x)
    assert starts.dtype == u[0].dtype == u[1].dtype == jnp.bfloat16
    _assert_equal_up_to_16_bit_rounding((final, starts), (final_t, starts_t), fp32_tol=FLIPPED_STATE_TOL)
    _assert_equal_up_to_16_bit_rounding(o, o_t, per_element=False)
    u_sum, u_sum_t = (pair[0].astype(jnp.float32) + pair[1].astype(jnp.float32) for pair in (u, u_t))
    assert relative_error(u_sum, u_sum_t) <= 1e-5
    assert relative_error(u[0].astype(jnp.float32), u_sum_t) > 1e-5


@pytest.mark.parametrize("variant", ["bv64", "shared_head"])
def test_gradients_match_scan_in_interpreter(variant):
    """The Triton backward on the Mosaic pass's residuals: every gradient at the bf16 bounds against the scan, and
    equal to the gradients through the Triton pass up to the 16-bit rounding flips."""
    x = _bf16_case(_inputs(T=130, B=1, H=1, Hv=2, K=D, V=D))
    mosaic = _config(x, pass_backend="mosaic", **VARIANTS[variant])
    _, mosaic_grads = _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(mosaic), label="mosaic-grads")
    triton = dataclasses.replace(mosaic, pass_backend="triton")
    _assert_equal_up_to_16_bit_rounding(mosaic_grads, _grads(_fn(triton), x), per_element=False)


def _prepare_and_reverse(cfg, x):
    """(T, P, and the reverse pass's outputs on T and P) for one padded call without documents (dO = v)."""
    B, T = x["beta"].shape[:2]
    ones = jnp.ones((B, T), jnp.float32)
    doc = jnp.zeros((B, T), jnp.int32)

    def run(q, k, v, beta, log_decay, dfinal):
        g, glo, _ = kda._gates_and_operands(cfg, q, k, log_decay, ones, ones)
        t, p = kda._prepare(cfg, q, k, g, glo, beta, doc)
        src = kda._source(cfg, q, k, g, glo, ones, ones, "backward")
        return t, p, kda._reverse_pass(cfg, src, beta, t, p, v, dfinal)

    return jax.jit(run)(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"])


def test_prepare_writes_t_and_p_as_pairs_the_reverse_pass_reads():
    """With the Mosaic pass, prepare writes T and P as bf16 (hi, lo) pairs, bit for bit the split of the fp32 T and
    P it writes otherwise, and the Triton reverse pass reads the pairs: the same products ("split" takes back hi
    and lo from hi + lo, but for the rare hi + lo that rounds to hi's neighbour: then another exact pair of the same
    sum), so the same outputs to fp32 rounding: d(initial state) to 1e-6, the bf16 end-state cotangents up to
    rounding flips, and dx (hi + lo) to the relative bound of a term downstream of such a flip, as in
    `test_reverse_pass_equals_the_triton_one_in_interpreter`: dx takes (E.K) bf16(dS), and an element of bf16(dS)
    that rounds the other way moves a row of dx by up to 2^-9 of that term (CI, seed 295985219: 1.05e-5 relative
    against the 1e-6 it was held to, d(initial state) within 1e-6; on another CPU, 13 draws: 7.5e-7 at most)."""
    x = _bf16_case(_inputs(T=128, B=1, H=1, Hv=1, K=D, V=D, packed=False))
    mosaic = _config(x, pass_backend="mosaic")
    t_pair, p_pair, reverse_pairs = _prepare_and_reverse(mosaic, x)
    t, p, reverse = _prepare_and_reverse(dataclasses.replace(mosaic, pass_backend="triton"), x)
    assert t.dtype == jnp.float32 and t_pair[0].dtype == t_pair[1].dtype == jnp.bfloat16
    for pair, fp32 in ((t_pair, t), (p_pair, p)):
        for half, expected in zip(pair, split_bf16_in_xla(fp32)):
            assert jnp.array_equal(half, expected)
    (dh0, dends, dx), (dh0_t, dends_t, dx_t) = reverse_pairs, reverse
    assert relative_error(dh0, dh0_t) <= 1e-6
    _assert_equal_up_to_16_bit_rounding(dends, dends_t)
    _assert_equal_up_to_16_bit_rounding(*(pair[0].astype(jnp.float32) + pair[1].astype(jnp.float32)
                                          for pair in (dx, dx_t)), per_element=False)


@pytest.mark.parametrize("variant", _interpreted(["bv64", "bv32", "bv32_producer", "shared_heads"]))
def test_reverse_pass_equals_the_triton_one_in_interpreter(variant):
    """`Config.reverse_backend="mosaic"`: the reverse pass in Mosaic GPU on the same T and P pairs and stored
    operands as the Triton reverse pass: d(initial state) to 1e-5, the bf16 end-state cotangents up to rounding
    flips, and dx (hi + lo) to the relative bound of a term downstream of such a flip (T = 192:
    `_prepare_and_reverse` takes whole chunks). dx takes the product (E.K) bf16(dS) of the running state cotangent,
    whose bf16 rounding flips where the two passes' fp32 sums differ in the last bit; a flipped element moves that
    row's dx by up to 2^-9 of the term, far beyond the pair's own resolution (CI, seed 918596328, BV 32: dx differed
    in 421 of 24576 elements, the largest by 40 ulps of its bf16 hi, 1.02e-5 relative overall, over the 1e-5 it was
    held to; d(initial state) 5.4e-7). Both passes are held to the bf16 bounds against the fp32 scan below."""
    x = _bf16_case(_inputs(T=192, B=1, H=1, Hv=1, K=D, V=D, packed=False))
    mosaic = _config(x, pass_backend="mosaic", reverse_backend="mosaic", **VARIANTS[variant])
    _, _, (dh0, dends, dx) = _prepare_and_reverse(mosaic, x)
    _, _, (dh0_t, dends_t, dx_t) = _prepare_and_reverse(dataclasses.replace(mosaic, reverse_backend="triton"), x)
    assert dends.dtype == dx[0].dtype == jnp.bfloat16
    assert relative_error(dh0, dh0_t) <= 1e-5
    _assert_equal_up_to_16_bit_rounding(dends, dends_t)
    _assert_equal_up_to_16_bit_rounding(*(pair[0].astype(jnp.float32) + pair[1].astype(jnp.float32)
                                          for pair in (dx, dx_t)), per_element=False)


# On a CPU the two families that load the reverse pass most (-20 gates: the sub-chunk scheme; correlated keys with
# beta near 2: the largest cotangents), one per layout; random inputs reach it in the head-dim and wide-key tests.
@pytest.mark.parametrize("family,variant", cpu_subset(
    itertools.product([None, *ADVERSARIAL], ("bv64", "bv32", "shared_head")),
    [("decay_minus_20", "bv64"), ("correlated_keys_beta_near_2", "shared_head")]))
def test_gradients_through_the_mosaic_reverse_pass_in_interpreter(family, variant):
    """Both Mosaic passes (the forward with two CTAs or one CTA per head, as `mosaic_config` picks by head count):
    every gradient at the bf16 bounds against the scan, and equal to the gradients through the Triton reverse pass
    up to the 16-bit rounding flips, on random and adversarial inputs (on a CPU two families, 65 s per case on a
    2-core machine)."""
    shape = dict(B=1, T=130, H=1, Hv=2, K=D, V=D)
    x = _bf16_case(_inputs(**shape) if family is None else _adversarial(family, **shape))
    mosaic = _config(x, pass_backend="mosaic", reverse_backend="mosaic", **VARIANTS[variant])
    _, mosaic_grads = _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(mosaic), label=f"mosaic-reverse-{family}")
    triton = dataclasses.replace(mosaic, reverse_backend="triton")
    _assert_equal_up_to_16_bit_rounding(mosaic_grads, _grads(_fn(triton), x), per_element=False)


@pytest.mark.parametrize("overrides,match", [
    (dict(pass_backend="triton", reverse_backend="mosaic"), "pass_backend"),
    (dict(reverse_backend="cuda"), "reverse_backend"),
    (dict(state_dots="split", state_storage="fp32"), "state_dots"),
    (dict(operands="inline", cumsum="kernel"), "operands"),
    (dict(forward="split"), "forward"),
    (dict(prepare="blocks"), "prepare"),
    (dict(mosaic_block_v=16), "block_v"),
    (dict(mosaic_block_v=32, mosaic_shared_head=True), "block_v"),
    (dict(output_dots="highest"), "output_dots"),
])
def test_unsupported_configs_raise(overrides, match):
    """Refused on the forward call, or (the reverse pass's knobs) on its gradient."""
    x = _bf16_case(_inputs(T=70, B=1, H=1, Hv=1, K=D, V=D))
    cfg = _config(x, **dict(dict(pass_backend="mosaic"), **overrides))
    with pytest.raises(ValueError, match=match):
        _call(_fn(cfg), x)
        _grads(_fn(cfg), x)


def test_unsupported_inputs_raise():
    """K other than 64, 128 and 256, V other than 64, 128 and 256, and 16-bit inputs other than bf16 are named in
    the error (K = 256 with blocks wider than 16: `test_wide_keys_refuse_wider_state_blocks`)."""
    for K, V in ((32, D), (16, D), (D, 32)):
        x = _bf16_case(_inputs(T=70, B=1, H=1, Hv=1, K=K, V=V))
        with pytest.raises(ValueError, match=rf"K in \(64, 128, 256\) and V in \(64, 128, 256\), got K={K}, V={V}"):
            _call(_fn(_config(x, pass_backend="mosaic")), x)
    y = _inputs(T=70, B=1, H=1, Hv=1, K=D, V=D)
    y = dict(y, **{n: y[n].astype(jnp.float16) for n in ("q", "k", "v")}, scale=1.0)
    with pytest.raises(ValueError, match="bfloat16"):  # (fp16's default state products are "split": refused first)
        _call(_fn(_config(y, pass_backend="mosaic", state_dots="bf16", grad_k_dots="bf16")), y)


def test_unknown_pass_backend_raises():
    x = _bf16_case(_inputs(T=70, B=1, H=1, Hv=1, K=D, V=D))
    with pytest.raises(ValueError, match="pass_backend"):
        _call(_fn(_config(x, pass_backend="cuda")), x)


KDA_CALL = dispatch.RuleCall(op="delta_rule", batch=32, seq_len=100, key_heads=2, value_heads=4, key_dim=D,
                             value_dim=D, dtype="bfloat16", decay="channel", has_initial_state=True,
                             has_segment_ids=True, chunk_size=64, platform="gpu")


def test_dispatch_takes_kda_to_mosaic_on_hopper(monkeypatch):
    """"mosaic" takes KDA calls that `supports_kda` takes in bf16 with K of 64 or 128 and V of 64, 128 or 256, on
    Hopper only, and "auto" prefers it there (with few heads its config is the Triton one). K = 256 and float16
    go to "pallas"."""
    monkeypatch.setattr(pallas_gpu, "hopper_compute_capability", lambda: True)
    assert pallas_gpu.supports_mosaic_kda(KDA_CALL) and pallas_gpu.supports_mosaic_delta_rule(KDA_CALL)
    for K, V in OTHER_HEAD_DIMS:
        assert pallas_gpu.supports_mosaic_kda(KDA_CALL._replace(key_dim=K, value_dim=V)), (K, V)
    for change in (dict(platform="cpu"), dict(dtype="float32"), dict(dtype="float16"), dict(key_dim=32),
                   dict(key_dim=256), dict(key_dim=256, value_dim=256), dict(value_dim=512), dict(value_heads=3),
                   dict(chunk_size=32), dict(decay="scalar")):
        assert not pallas_gpu.supports_mosaic_kda(KDA_CALL._replace(**change)), change
    for other in (KDA_CALL._replace(key_dim=256), KDA_CALL._replace(dtype="float16")):
        assert pallas_gpu.supports_kda(other) and dispatch.select("delta_rule", "auto", other).name == "pallas"
    assert dispatch.select("delta_rule", "auto", KDA_CALL).name == "mosaic"
    monkeypatch.setattr(pallas_gpu, "hopper_compute_capability", lambda: False)
    assert not pallas_gpu.supports_mosaic_kda(KDA_CALL)
    assert dispatch.select("delta_rule", "auto", KDA_CALL).name == "pallas"


@pytest.mark.parametrize("batch,value_heads,dtype,K,V,expected,shared_head,block_v", [
    (8, 16, jnp.bfloat16, D, D, "mosaic", False, 64),  # 128 heads: the producer layout, not one CTA per head
    (4, 16, jnp.bfloat16, D, D, "mosaic", False, 64),  # 64 heads: 256 CTAs of 32 columns would be two waves
    (2, 16, jnp.bfloat16, D, D, "mosaic", False, 32),  # 32 heads: state blocks of 32, 128 CTAs
    (1, 16, jnp.bfloat16, D, D, "mosaic", False, 32),  # 16 heads: the threshold at K = V = 128
    (1, 8, jnp.bfloat16, D, D, "triton", False, 64),
    (8, 16, jnp.float32, D, D, "triton", False, 64),
    (8, 16, jnp.bfloat16, 64, 64, "mosaic", False, 64),  # K = V = 64: V blocks of 64, no shared head
    (8, 16, jnp.bfloat16, 64, D, "mosaic", True, 64),  # K = 64, V = 128 from 128 heads: one CTA per head
    (2, 16, jnp.bfloat16, 64, 64, "triton", False, 64),  # other head dims: from 64 heads (not timed below)
    (8, 16, jnp.bfloat16, D, 256, "mosaic", False, 64),  # V = 256: four V blocks of 64 per head
    (2, 16, jnp.bfloat16, D, 256, "triton", False, 64),
    (8, 16, jnp.bfloat16, 256, 256, "triton", False, 64),  # K = 256: the Triton passes
])
def test_mosaic_config_takes_the_mosaic_pass_from_the_threshold(batch, value_heads, dtype, K, V, expected,
                                                                 shared_head, block_v):
    q = jnp.zeros((batch, 64, value_heads, K), dtype)
    v = jnp.zeros((batch, 64, value_heads, V), dtype)
    cfg = kda.mosaic_config(q, v, scale=0.1, chunk_size=64, segmented=False, interpret=False)
    assert cfg.pass_backend == expected and cfg.reverse_backend == expected
    assert cfg.mosaic_shared_head == shared_head and cfg.mosaic_block_v == block_v
    # the producer layout where it was timed: K = V = 128, at every head count the Mosaic passes take
    producer_128 = expected == "mosaic" and K == V == D
    assert cfg.mosaic_producer == producer_128 and kda.MOSAIC_PRODUCER_AT_128
    assert cfg.mosaic_reverse_producer == (producer_128 and kda.MOSAIC_REVERSE_PRODUCER_AT_128)
    assert kda.MOSAIC_PASS_MIN_BATCH_HEADS == 64 and kda.MOSAIC_SHARED_HEAD_MIN_BATCH_HEADS == 128
    assert kda.MOSAIC_PASS_MIN_BATCH_HEADS_128 == 16 and kda.MOSAIC_NARROW_BLOCK_V == 32


def test_registered_function_matches_scan_in_interpreter(monkeypatch):
    """The dispatch's function on a KDA call above the threshold runs both Mosaic passes (interpreted here; with
    few heads in state blocks of 32 columns, with the producer layouts where `PRODUCER_INTERPRETABLE`): the outputs
    and the gradients against the scan."""
    monkeypatch.setattr(kda, "MOSAIC_PASS_MIN_BATCH_HEADS_128", 2)
    monkeypatch.setattr(kda, "MOSAIC_PRODUCER_AT_128", PRODUCER_INTERPRETABLE)
    monkeypatch.setattr(kda, "MOSAIC_REVERSE_PRODUCER_AT_128", PRODUCER_INTERPRETABLE)
    x = _bf16_case(_inputs(T=70, B=1, H=1, Hv=2, K=D, V=D))
    cfg = kda.mosaic_config(x["q"], x["v"], scale=0.1, chunk_size=64, segmented=True, interpret=True)
    assert (cfg.pass_backend, cfg.reverse_backend, cfg.mosaic_block_v) == ("mosaic", "mosaic", 32)
    assert cfg.mosaic_producer == cfg.mosaic_reverse_producer == PRODUCER_INTERPRETABLE
    _check(x, BF16_OUT_TOL, _bf16_grad_tol,
           fn=lambda *a, **kw: pallas_gpu.mosaic_delta_rule(*a, **kw, chunk_size=64), label="mosaic-dispatch")


def _abstract_call(B=1, T=130, H=2, Hv=4, K=D, V=D):
    """(q, k, v, beta, log_decay, initial_state, segment_ids) as abstract values: a bf16 call with documents and an
    initial state, for the lowering tests."""
    q = jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16)
    return (q, q, jax.ShapeDtypeStruct((B, T, Hv, V), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, Hv), jnp.float32),
            jax.ShapeDtypeStruct((B, T, Hv, K), jnp.float32), jax.ShapeDtypeStruct((B, Hv, K, V), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32))


def _abstract_config(args, **overrides):
    """`kda.default_config` of `_abstract_call`'s shapes, compiled (not interpreted), with `overrides`."""
    q, _, v = args[:3]
    cfg = kda.default_config(jnp.zeros(q.shape, q.dtype), jnp.zeros(v.shape, v.dtype), scale=0.1, chunk_size=64,
                             segmented=True, interpret=False)
    return dataclasses.replace(cfg, **overrides)


def _call_with(config):
    """The call of `_abstract_call`'s arguments, reading `config()` when traced."""
    def call(q, k, v, beta, log_decay, h0, ids):
        return kda.kda_chunk(q, k, v, beta, log_decay, scale=0.1, initial_state=h0, segment_ids=ids,
                             interpret=False, config=config())
    return call


def _gradient_of(call):
    def loss(*args):
        o, s = call(*args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))


def _lowered_for_cuda(fn, args):
    """`fn` lowered for an abstract H100, as text."""
    with jax.sharding.use_abstract_mesh(H100):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("variant", VARIANTS)
def test_lowers_for_cuda(variant):
    """The call and its gradient lowered for an abstract H100 (documents, an initial state, Hv = 2H): one Mosaic GPU
    call in each (the forward pass; the backward's kernels are Triton's). Catches what the interpreter accepts but
    Mosaic GPU cannot lower."""
    args = _abstract_call()
    cfg = _abstract_config(args, pass_backend="mosaic", **VARIANTS[variant])
    call = _call_with(lambda: cfg)
    forward = _lowered_for_cuda(call, args)
    gradient = _lowered_for_cuda(_gradient_of(call), args)
    both = _lowered_for_cuda(_gradient_of(_call_with(lambda: dataclasses.replace(cfg, reverse_backend="mosaic"))),
                             args)
    assert forward.count("custom_call @mosaic_gpu_v2") == 1
    assert gradient.count("custom_call @mosaic_gpu_v2") == 1
    assert both.count("custom_call @mosaic_gpu_v2") == 2  # and the reverse pass


@pytest.mark.parametrize("K,V", OTHER_HEAD_DIMS)
def test_other_head_dims_lower_for_cuda(K, V):
    """K or V of 64, V of 256: the call and its gradient with both Mosaic passes, in each layout, lowered for an
    abstract H100 (two Mosaic GPU calls in the gradient)."""
    args = _abstract_call(K=K, V=V)
    for variant in _other_dims_variants(V):
        cfg = _abstract_config(args, pass_backend="mosaic", reverse_backend="mosaic", **VARIANTS[variant])
        assert _lowered_for_cuda(_call_with(lambda: cfg), args).count("custom_call @mosaic_gpu_v2") == 1
        assert _lowered_for_cuda(_gradient_of(_call_with(lambda: cfg)), args).count("custom_call @mosaic_gpu_v2") == 2


@pytest.mark.parametrize("V", [64, 256])
def test_wide_keys_lower_for_cuda(V):
    """K = 256 with state blocks of 16 columns: the call and its gradient with both Mosaic passes lowered for an
    abstract H100, which also checks their shared memory (Mosaic GPU refuses more than 232,448 bytes there; at 32
    columns the forward pass asked 256,008)."""
    args = _abstract_call(K=256, V=V)
    cfg = _abstract_config(args, pass_backend="mosaic", reverse_backend="mosaic",
                           mosaic_block_v=mosaic_kda.WIDE_KEY_BLOCK_V)
    assert _lowered_for_cuda(_call_with(lambda: cfg), args).count("custom_call @mosaic_gpu_v2") == 1
    assert _lowered_for_cuda(_gradient_of(_call_with(lambda: cfg)), args).count("custom_call @mosaic_gpu_v2") == 2
    wider = dataclasses.replace(cfg, mosaic_block_v=32)
    with pytest.raises(ValueError, match="at K=256 takes block_v=16"):
        _lowered_for_cuda(_call_with(lambda: wider), args)


gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")

# T, packed, initial state, (H, Hv), variant
GPU_CASES = [
    (1000, True, True, (2, 4), "bv64"),
    (1000, True, True, (2, 4), "shared_head"),
    (1, False, True, (2, 2), "bv64"),
    (1, False, True, (2, 2), "shared_head"),
    (3, False, True, (2, 2), "bv32"),
    (257, True, True, (1, 2), "bv32"),
    (257, True, True, (1, 2), "bv32_producer"),
    (1000, True, True, (2, 4), "bv64_producer"),
    (300, False, False, (2, 2), "bv64_output_bf16"),
    (300, False, False, (2, 2), "shared_head_output_bf16"),
]


@gpu_only
@pytest.mark.parametrize("T,packed,init,heads,variant", GPU_CASES)
def test_gpu_matches_scan(T, packed, init, heads, variant):
    """Compiled: outputs, final state and every gradient against the fp32 scan at the bf16 bounds."""
    x = _bf16_case(_inputs(T=T, H=heads[0], Hv=heads[1], K=D, V=D, packed=packed, init=init))
    cfg = _config(x, pass_backend="mosaic", **VARIANTS[variant])
    _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(cfg), label=f"gpu-mosaic-T{T}-{variant}")


@gpu_only
@pytest.mark.parametrize("K,V", OTHER_HEAD_DIMS)
def test_gpu_other_head_dims_match_scan(K, V):
    """Compiled, K or V of 64, V of 256, both passes in Mosaic GPU in each layout: outputs, final state and every
    gradient against the fp32 scan at the bf16 bounds (packed documents, an initial state, T not a multiple of 64)."""
    x = _bf16_case(_inputs(B=2, T=500, H=2, Hv=4, K=K, V=V))
    for variant in _other_dims_variants(V):
        cfg = _config(x, pass_backend="mosaic", reverse_backend="mosaic", **VARIANTS[variant])
        _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(cfg), label=f"gpu-mosaic-{K}x{V}-{variant}")


@gpu_only
@pytest.mark.parametrize("V", [64, 128, 256])
@pytest.mark.parametrize("family", [None, *ADVERSARIAL])
def test_gpu_wide_keys_match_scan(family, V):
    """Compiled, K = 256 (opt-in; state blocks of 16 columns), both passes in Mosaic GPU: outputs, final state and
    every gradient against the fp32 scan at the bf16 bounds, on random inputs and the adversarial families."""
    shape = dict(B=2, T=500, H=2, Hv=4, K=256, V=V)
    x = _bf16_case(_inputs(**shape) if family is None else _adversarial(family, **shape))
    cfg = _config(x, pass_backend="mosaic", reverse_backend="mosaic", mosaic_block_v=mosaic_kda.WIDE_KEY_BLOCK_V)
    _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(cfg), label=f"gpu-mosaic-256x{V}-{family}")


@gpu_only
@pytest.mark.parametrize("variant", ["bv64", "bv32", "bv32_producer", "bv64_producer", "shared_head", "shared_heads"])
@pytest.mark.parametrize("family", [None, *ADVERSARIAL])
def test_gpu_mosaic_reverse_pass_matches_scan(family, variant):
    """Both passes in Mosaic GPU, compiled: every gradient against the scan at the bf16 bounds."""
    shape = dict(B=2, T=500, H=2, Hv=4, K=D, V=D)
    x = _bf16_case(_inputs(**shape) if family is None else _adversarial(family, **shape))
    cfg = _config(x, pass_backend="mosaic", reverse_backend="mosaic", **VARIANTS[variant])
    _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(cfg), label=f"gpu-mosaic-reverse-{family}")


@gpu_only
@pytest.mark.parametrize("family", ADVERSARIAL)
@pytest.mark.parametrize("variant", ["bv64", "bv32", "bv32_producer", "bv64_producer", "shared_head"])
def test_gpu_adversarial(family, variant):
    """As `test_adversarial_in_interpreter`, compiled, with the gradients against the scan too."""
    x = _bf16_case(_adversarial(family, B=2, T=500, H=2, Hv=4, K=D, V=D))
    mosaic = _config(x, pass_backend="mosaic", **VARIANTS[variant])
    mosaic_outputs, _ = _check(x, BF16_OUT_TOL, _bf16_grad_tol, fn=_fn(mosaic), label=f"gpu-mosaic-{variant}-{family}")
    _assert_equal_up_to_16_bit_rounding(mosaic_outputs,
                                        _call(_fn(dataclasses.replace(mosaic, pass_backend="triton")), x),
                                        per_element=False)


@gpu_only
def test_gpu_registered_function_at_few_heads_matches_scan():
    """Compiled, the dispatch's function at 16 value heads (`kda.MOSAIC_PASS_MIN_BATCH_HEADS_128`): both Mosaic
    passes in state blocks of 32 columns with the producer warpgroups `mosaic_config` gives them; outputs, final
    state and every gradient against the fp32 scan at the bf16 bounds (packed documents, an initial state, two value
    heads per key head, T not a multiple of 64)."""
    x = _bf16_case(_inputs(T=300, B=1, H=8, Hv=16, K=D, V=D))
    cfg = kda.mosaic_config(x["q"], x["v"], scale=0.1, chunk_size=64, segmented=True, interpret=False)
    assert (cfg.pass_backend, cfg.reverse_backend, cfg.mosaic_block_v) == ("mosaic", "mosaic", 32)
    assert cfg.mosaic_producer and cfg.mosaic_reverse_producer == kda.MOSAIC_REVERSE_PRODUCER_AT_128
    _check(x, BF16_OUT_TOL, _bf16_grad_tol,
           fn=lambda *a, **kw: pallas_gpu.mosaic_delta_rule(*a, **kw, chunk_size=64), label="gpu-mosaic-16-heads")
