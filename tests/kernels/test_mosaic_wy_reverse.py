"""The reverse state pass of the Gated DeltaNet in Mosaic GPU (`mosaic_wy._reverse_pass`).

Oracle: the Triton reverse pass (`wy_chunk._reverse_pass`) on the same inputs with every product in the split mode
(K dS and Q^T dO with their fp32 operands as bf16 pairs, ~2^-16 relative). The Mosaic pass must be within the
bf16 bound of it, and no further from it than the Triton pass at its default precision (those two products with
bf16-rounded operands, as the Mosaic pass takes them; x 1.25, plus fp32 rounding). The
whole backward against the fp32 scan is `test_mosaic_wy.test_gradients_match_scan_in_interpreter` (CPU) and
`test_gpu_gradients_match_scan` (GPU). On CPU the pass runs in the Mosaic GPU interpreter and is lowered for an
abstract H100.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest

from deltajax.kernels.gpu import mosaic_wy, wy_chunk
from deltajax.kernels.gpu.common import split_bf16_in_xla
from testing_utils import H100, fresh_key, relative_error, rule_inputs

warnings.filterwarnings("ignore", message=".*triton.*", category=DeprecationWarning)

ON_GPU = jax.default_backend() == "gpu"
D = mosaic_wy.HEAD_DIM
SCALE = D ** -0.5
# Relative to the split-mode oracle: the bf16 rounding of dS in K dS and of f (.) dO in Q^T dO (2^-9 per element),
# carried through the chunks. Measured in the interpreter (2026-11-26, T = 150, beta up to 2): 1.7e-3 for dL/dS_0
# and 1.2e-3 for dx, the same for the Mosaic and the Triton pass.
BF16_TOL = 3e-3
CLOSENESS = 1.25  # the Mosaic pass's error against the Triton pass's, both against the oracle
# Plus fp32 rounding: the Mosaic pass divides -beta f (.) dx by the scale and multiplies the sum back (the Triton
# pass scales Q^T dO alone), a few ulps per element, seen alone where the bf16 roundings are exact (1.2e-6 for
# dL/dS_0 without decay, where f is 1 and the first chunk's document ends in it).
FP32_SLACK = 1e-5

_INTERPRETED = mosaic_wy.default_config(interpret=True)
_COMPILED = mosaic_wy.default_config(interpret=False)


def _pair_sum(pair):
    return pair[0].astype(jnp.float32) + pair[1].astype(jnp.float32)


def _compare(x, cfg, interpret):
    """The three outputs of the Mosaic pass (dL/dS_0, the end-state cotangents, dx) against the split-mode Triton
    pass, with the default Triton pass's errors as the yardstick."""
    segmented = x["segment_ids"] is not None
    tcfg = wy_chunk.default_config(x["q"], x["v"], scale=SCALE, chunk_size=64, delta=True, segmented=segmented,
                                   interpret=interpret, gated=x["log_decay"] is not None)
    args = wy_chunk.padded_call_inputs(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"],
                                       x["segment_ids"], 64)
    q, k, v, beta, g, doc, carry, tail, t, *_ = jax.jit(lambda *a: wy_chunk._wy_fwd(tcfg, *a))(*args)[1]
    kd, kf = jax.random.split(fresh_key())
    do = jax.random.normal(kd, v.shape, jnp.bfloat16)
    dfinal = jax.random.normal(kf, (q.shape[0], q.shape[2], D, D), jnp.float32)
    t_pair = t if t.ndim == 5 else jnp.stack(split_bf16_in_xla(t))

    def mosaic(*a):
        vectors = mosaic_wy._pass_vectors(g, beta, doc, carry, tail, D)
        dh0, dends, dx = mosaic_wy._reverse_pass(cfg, *a, *vectors, dfinal, scale=SCALE, segmented=segmented,
                                                 interpret=interpret)
        return dh0, dends, _pair_sum(dx)

    def triton(config):
        dh0, dends, *dx = wy_chunk._reverse_pass(config, q, k, beta, t, g, doc, carry, tail, do, dfinal, dx_pair=True)
        return dh0, dends, _pair_sum(dx)

    ours = jax.jit(mosaic)(q, k, do, t_pair)
    triton_default = jax.jit(lambda: triton(tcfg))()
    oracle = jax.jit(lambda: triton(wy_chunk.replace_config(tcfg, state_dots="split", grad_k_dots="split")))()
    for name, a, d, r in zip(("dh0", "dends", "dx"), ours, triton_default, oracle):
        assert a.shape == r.shape and a.dtype == d.dtype, (name, a.shape, r.shape, a.dtype, d.dtype)
        error = relative_error(a.astype(jnp.float32), r.astype(jnp.float32))
        yardstick = relative_error(d.astype(jnp.float32), r.astype(jnp.float32))
        print(f"{name} {error:.2e} (Triton {yardstick:.2e})")
        assert error <= BF16_TOL and error <= CLOSENESS * yardstick + FP32_SLACK, (name, error, yardstick)


def _inputs(case, **size):
    kwargs = dict(B=1, T=150, H=2, K=D, V=D, dtype=jnp.bfloat16, beta_max=2.0, with_initial_state=True)
    kwargs.update(size)
    kwargs.update(dict(packed=dict(packed=True), strong_decay=dict(decay_scale=8.0),
                       near_zero_decay=dict(decay_scale=1e-4), no_decay=dict(decay="none", packed=True)
                       ).get(case, {}))
    x = rule_inputs(fresh_key(), **kwargs)
    if case == "correlated_keys":
        k = x["k"].astype(jnp.float32)
        k = k[:, :1] + 0.1 * k
        x["k"] = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    return x


@pytest.mark.parametrize("case", ["plain", "packed", "strong_decay", "near_zero_decay", "correlated_keys",
                                  "no_decay"])
def test_matches_the_triton_pass_in_interpreter(case):
    """T not a multiple of 64, beta up to 2, an initial state, a random final-state cotangent; packed documents;
    strong (log-decay down to -8 per token) and near-zero decay; keys drawn around one direction; no decay."""
    _compare(_inputs(case), _INTERPRETED, interpret=True)


@pytest.mark.parametrize("config", ["block_v32", "state_split"])
def test_configs_match_the_triton_pass_in_interpreter(config):
    cfg = dict(block_v32=dataclasses.replace(_INTERPRETED, block_v=32),
               state_split=dataclasses.replace(_INTERPRETED, state_dots="split"))[config]
    _compare(_inputs("packed"), cfg, interpret=True)


LOWERED_CONFIGS = {"default": _COMPILED, "shared_head": dataclasses.replace(_COMPILED, warpgroups=2),
                   "block_v32": dataclasses.replace(_COMPILED, block_v=32),
                   "p_smem": dataclasses.replace(_COMPILED, p_operand="smem")}


@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("config", list(LOWERED_CONFIGS))
def test_lowers_for_cuda(config, segmented):
    """Catches what the interpreter accepts but Mosaic GPU cannot lower (layouts, transposed operand views, the
    warp-specialised pipeline walking the chunks backwards)."""
    B, Tp, H = 1, 192, 2
    S = jax.ShapeDtypeStruct
    key = S((B, Tp, H, D), jnp.bfloat16)
    args = (key, key, key, S((2, B, Tp, H, 64), jnp.bfloat16), S((5, B * H, Tp), jnp.float32), S((B, Tp), jnp.float32),
            S((B * H, Tp // 64 * D), jnp.float32), S((B, H, D, D), jnp.float32))
    fn = jax.jit(lambda *a: mosaic_wy._reverse_pass(LOWERED_CONFIGS[config], *a, scale=SCALE, segmented=segmented,
                                                    interpret=False))
    with jax.sharding.use_abstract_mesh(H100):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", ["default", "shared_head", "block_v32", "p_smem"])
@pytest.mark.parametrize("case", ["packed", "correlated_keys"])
def test_gpu_matches_the_triton_pass(case, config):
    _compare(_inputs(case, B=2, T=1000, H=4), LOWERED_CONFIGS[config], interpret=False)
