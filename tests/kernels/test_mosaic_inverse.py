"""The in-chunk inverse T = (I + A)^-1 as a Mosaic GPU kernel (`mosaic_inverse.inverse_pair`).

Oracle: a float64 inverse of the same A (built in float64 from the same bf16 keys, beta and gates), chunk by chunk.
T leaves as a bf16 (hi, lo) pair, which alone rounds T by ~2^-17 relative: each chunk's error is held to 3x the
larger of that rounding and the error of the Triton kernel (`wy_chunk._inverse`, fp32 forward substitution) on the
same inputs. Measured in the interpreter (2026-12-01): Mosaic / Triton 3.1e-7 / 2.9e-7 on random keys, 7.2e-6 /
4.6e-6 on correlated keys with beta near 2, 1.8e-10 / 4e-16 with -20 gates (the pair's rounding floor there is
the larger term). On CPU the kernel runs in the Mosaic GPU interpreter and is lowered for an abstract H100; the
`test_gpu_*` cases run it compiled.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from deltajax.kernels.gpu import mosaic_inverse, mosaic_wy, wy_chunk
from testing_utils import fresh_key, rule_inputs

warnings.filterwarnings("ignore", message=".*triton.*", category=DeprecationWarning)

ON_GPU = jax.default_backend() == "gpu"
D = mosaic_inverse.HEAD_DIM
C = mosaic_inverse.CHUNK
CLOSENESS = 4.0  # (measured 1.3-3.1x on correlated keys) each chunk's error against max(the Triton kernel's, the pair's rounding, FP16_FLOOR)
# fp16 pairs hold values under fp16's smallest normal (2^-14) to an absolute ~2^-25, where fp32 keeps its relative
# precision: against ||T|| >= 8 (the unit diagonal of a 64 x 64 T) that is below 1e-7 of T. Seen where T is near
# the identity (-20 gates): 1.5e-8 from float64, the Triton kernel's fp32 substitution 2e-12.
FP16_FLOOR = 1e-7

H100 = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                    abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                                   platform="gpu"))


def _inputs(key, family, *, B=1, T=130, H=2, Hv=4, packed=False):
    x = rule_inputs(key, B=B, T=T, H=H, Hv=Hv, K=D, V=8, packed=packed, beta_max=2.0, dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.fold_in(key, 1), 3)
    if family in ("correlated_keys_beta_near_2", "beyond_fp16"):
        common = jax.random.normal(keys[0], (1, 1, H, D))
        k = common + 0.02 * jax.random.normal(keys[1], (B, T, H, D))
        # beyond_fp16: |k|^2 beta up to 2.3, where T's entries (~1e7) leave fp16's range and stay in fp32's.
        norm = 1.0724 if family == "beyond_fp16" else 1.0
        x["k"] = (norm * k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
        x["beta"] = jax.random.uniform(keys[2], (B, T, Hv), minval=1.9, maxval=2.0)
        x["log_decay"] = -1e-6 * jnp.ones((B, T, Hv))
    elif family == "decay_minus_20":
        x["log_decay"] = -20.0 * jax.random.uniform(keys[0], (B, T, Hv), minval=0.5, maxval=1.0)
    elif family == "decay_near_0":
        x["log_decay"] = -1e-6 * jax.random.uniform(keys[0], (B, T, Hv))
    elif family == "unnormalised_keys":
        x["k"] = (2.0 * x["k"].astype(jnp.float32)).astype(jnp.bfloat16)
        x["beta"] = x["beta"] / 4.0
    return x


def _kernel_inputs(x, interpret):
    """The padded kernel inputs: (k, beta, g, doc) for the Triton kernel, (vectors, doc_f) for the Mosaic one."""
    segmented = x["segment_ids"] is not None
    cfg = mosaic_wy.default_config(interpret=interpret)
    tcfg = wy_chunk.default_config(x["k"], x["v"], scale=D ** -0.5, chunk_size=C, delta=True, segmented=segmented,
                                   interpret=interpret)
    _, k, _, beta, log_decay, doc, carry, tail, _ = wy_chunk.padded_call_inputs(
        x["k"], x["k"], x["v"], x["beta"], x["log_decay"], None, x["segment_ids"], C)
    g, vectors, doc_f, _ = mosaic_wy._chunk_vectors(cfg, tcfg, log_decay, beta, doc, carry, tail,
                                                    segmented=segmented, interpret=interpret)
    return tcfg, (k, beta, g, doc), (vectors, doc_f), segmented


def _float64_inverses(k, beta, g, doc, group):
    """(B, Tp, Hv, C) float64: every chunk's (I + A)^-1 from the same bf16 keys, beta and gates."""
    k, beta = np.asarray(k, np.float64), np.asarray(beta, np.float64)
    gates = np.asarray(g[0], np.float64) + np.asarray(g[1], np.float64)
    doc = np.asarray(doc)
    B, Tp, Hv = beta.shape
    out = np.zeros((B, Tp, Hv, C))
    for b in range(B):
        for h in range(Hv):
            for c in range(Tp // C):
                rows = slice(c * C, (c + 1) * C)
                kc, gc, dc = k[b, rows, h // group], gates[b, rows, h], doc[b, rows]
                decay = np.exp(np.minimum(gc[:, None] - gc[None, :], 0.0))
                mask = np.tril(np.ones((C, C)), -1) * (dc[:, None] == dc[None, :])
                out[b, rows, h] = np.linalg.inv(np.eye(C) + mask * beta[b, rows, h][:, None] * (kc @ kc.T) * decay)
    return out


def _chunk_errors(pair, ref):
    """Each chunk's ||T - ref|| / ||ref|| (Frobenius), T = hi + lo of the bf16 pair."""
    t = np.asarray(pair[0], np.float64) + np.asarray(pair[1], np.float64)
    B, Tp, Hv, _ = ref.shape
    split = lambda x: x.reshape(B, Tp // C, C, Hv, C)
    return (np.linalg.norm(split(t - ref), axis=(2, 4)) / np.linalg.norm(split(ref), axis=(2, 4)))


def _pair_rounding(ref):
    """The errors of ref rounded to a bf16 pair (what storing T alone costs)."""
    hi = ref.astype(np.float32).astype(jnp.bfloat16)
    lo = (ref.astype(np.float32) - hi.astype(np.float32)).astype(jnp.bfloat16)
    return _chunk_errors((hi, lo), ref)


def _check(x, interpret):
    tcfg, triton_args, mosaic_args, segmented = _kernel_inputs(x, interpret)
    k, beta, g, doc = triton_args
    ours = jax.jit(lambda k, *a: mosaic_inverse.inverse_pair(k, *a, segmented=segmented, interpret=interpret))(
        k, *mosaic_args)
    assert ours.shape == (2,) + beta.shape + (C,) and ours.dtype == jnp.bfloat16, (ours.shape, ours.dtype)
    assert np.all(np.isfinite(np.asarray(ours, np.float32)))
    triton = jax.jit(lambda *a: wy_chunk._inverse(tcfg, *a, pair=True, fp32=False))(*triton_args)
    ref = _float64_inverses(k, beta, g, doc, beta.shape[2] // k.shape[2])
    error = _chunk_errors(ours, ref)
    yardstick = np.maximum(np.maximum(_chunk_errors(triton, ref), _pair_rounding(ref)), FP16_FLOOR)
    worst = np.argmax(error / yardstick)
    print(f"largest chunk error {error.max():.2e}; largest against the yardstick {error.flat[worst]:.2e} / "
          f"{yardstick.flat[worst]:.2e} (Triton {_chunk_errors(triton, ref).flat[worst]:.2e}); largest |T| "
          f"{np.abs(ref).max():.1e}")
    assert np.all(error <= CLOSENESS * yardstick), (error.flat[worst], yardstick.flat[worst])
    return error


FAMILIES = ["random", "correlated_keys_beta_near_2", "decay_minus_20", "decay_near_0", "unnormalised_keys",
            "beyond_fp16"]


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_float64_in_interpreter(family):
    """Grouped value heads (Hv = 2H, so a wrong key head shows), T = 130 (padded to whole chunks)."""
    _check(_inputs(fresh_key(), family), interpret=True)


def test_packed_documents_in_interpreter():
    _check(_inputs(fresh_key(), "random", B=2, T=200, H=1, Hv=2, packed=True), interpret=True)


def test_bf16_pairs_where_fp16_would_overflow(monkeypatch):
    """With the fp16 limit lowered under every operand, each chunk takes the bf16-pair products: still finite, and
    ~2^-16 per product (measured 2.4e-4 from float64 on correlated keys with beta near 2, 3.4e-7 on random keys)
    where fp16 pairs land at the Triton kernel's error."""
    monkeypatch.setattr(mosaic_inverse, "FP16_LIMIT", 0.5)
    x = _inputs(fresh_key(), "correlated_keys_beta_near_2", T=64, H=1, Hv=1)
    tcfg, (k, beta, g, doc), (vectors, doc_f), _ = _kernel_inputs(x, True)
    ours = mosaic_inverse.inverse_pair(k, vectors, doc_f, segmented=False, interpret=True)
    error = _chunk_errors(ours, _float64_inverses(k, beta, g, doc, 1)).max()
    assert 2e-5 < error < 1e-3, error  # above fp16 pairs' ~7e-6: the bf16 path ran


def test_refuses_unsupported_inputs():
    k = jnp.zeros((1, 64, 1, D), jnp.bfloat16)
    vectors, doc = jnp.zeros((6, 1, 64)), jnp.zeros((1, 64))
    for args, match in (((k.astype(jnp.float32), vectors, doc), "bfloat16"),
                        ((k[..., :64], vectors, doc), "head dim"),
                        ((k[:, :60], vectors[..., :60], doc[:, :60]), "padded"),
                        ((k, vectors[:2], doc), "vectors"),
                        ((k, vectors, doc[:, :32]), "doc")):
        with pytest.raises(ValueError, match=match):
            mosaic_inverse.inverse_pair(*args, segmented=False, interpret=True)


@pytest.mark.parametrize("segmented", [False, True])
def test_lowers_for_cuda(segmented):
    """One Mosaic GPU custom call for an abstract H100 (grouped heads): catches what the interpreter accepts but
    Mosaic GPU cannot lower (layouts, wgmma operands)."""
    B, Tp, H, Hv = 2, 192, 2, 4
    k = jax.ShapeDtypeStruct((B, Tp, H, D), jnp.bfloat16)
    vectors = jax.ShapeDtypeStruct((6, B * Hv, Tp), jnp.float32)
    doc = jax.ShapeDtypeStruct((B, Tp), jnp.float32)
    fn = jax.jit(lambda *a: mosaic_inverse.inverse_pair(*a, segmented=segmented, interpret=False))
    with jax.sharding.use_abstract_mesh(H100):
        text = fn.trace(k, vectors, doc).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_matches_float64(family, packed):
    _check(_inputs(fresh_key(), family, B=2, T=1000, H=2, Hv=4, packed=packed), interpret=False)
