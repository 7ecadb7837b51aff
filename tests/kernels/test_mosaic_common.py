"""`kernels/gpu/mosaic_common.py`: fp32 registers to bf16 in pairs of elements (`PAIRED_CONVERSIONS`): the hi/lo
split and the rounding alone (`store_rounded`).

On CPU: the split kernel lowered for an abstract H100 (the Mosaic GPU interpreter cannot run `plgpu.inline_mgpu`;
the passes with paired splits: `test_mosaic_wy.py::test_paired_splits_lower_for_cuda` and
`test_mosaic_kda_grads.py::test_paired_conversions_lower_for_cuda`). On a GPU: the paired conversions against Mosaic
GPU's scalar ones (`split_scalar`, `astype`), bit for bit.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.kernels.gpu import mosaic_common as mc
from testing_utils import H100

ON_GPU = jax.default_backend() == "gpu"
N = 64


def _split_kernel(x_ref, hi_ref, lo_ref, rounded_ref, *, paired):
    """hi, lo of the split, and bf16(x) alone through `store_rounded`."""
    x = plgpu.load(x_ref, layout=plgpu.Layout.WGMMA, optimized=False)
    hi, lo = mc._split_in_pairs(x) if paired else mc.split_scalar(x)
    hi_ref[...] = mc.wgmma_layout(hi)
    lo_ref[...] = mc.wgmma_layout(lo)
    mc.store_rounded(x, rounded_ref)


def _split_call(paired, *, flag=None, interpret=False):
    """The split kernel with `mc.PAIRED_CONVERSIONS` = `flag` (default: `paired`)."""
    out = jax.ShapeDtypeStruct((N, N), jnp.bfloat16)

    def call(x):
        # `mc.kernel` reads the flag when it is built, in this trace: the jits below trace afresh for each call.
        with _paired_conversions(paired if flag is None else flag):
            return mc.kernel(functools.partial(_split_kernel, paired=paired), out_type=(out, out, out),
                             compiler_params=plgpu.CompilerParams(), interpret=interpret)(x)
    return call


@contextlib.contextmanager
def _paired_conversions(on):
    before, mc.PAIRED_CONVERSIONS = mc.PAIRED_CONVERSIONS, on
    try:
        yield
    finally:
        mc.PAIRED_CONVERSIONS = before


def test_paired_split_lowers_for_cuda():
    """The paired conversions (hi, lo, and the rounding alone) in the lowered kernel."""
    x = jax.ShapeDtypeStruct((N, N), jnp.float32)
    with jax.sharding.use_abstract_mesh(H100):
        text = jax.jit(_split_call(True)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1
    assert "cvt.rn.bf16x2.f32 hi" in text and "cvt.rn.bf16x2.f32 $0, $2, $1" in text


def test_scalar_conversions_when_turned_off():
    """With `PAIRED_CONVERSIONS` off, `store_rounded` converts one element at a time: no inline PTX is lowered."""
    x = jax.ShapeDtypeStruct((N, N), jnp.float32)
    with jax.sharding.use_abstract_mesh(H100):
        text = jax.jit(_split_call(False)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1 and "cvt.rn.bf16x2.f32" not in text


def test_interpreted_kernels_convert_one_by_one():
    """With `PAIRED_CONVERSIONS` on, a kernel the Mosaic GPU interpreter runs (it cannot run inline PTX) still
    rounds: `store_rounded` there equals numpy's round-to-nearest-even, and the scalar split is exact to 2^-17."""
    x = jnp.asarray(_edge_values(np.random.default_rng(3)))
    hi, lo, rounded = jax.jit(_split_call(False, flag=True, interpret=True))(x)
    expected = np.asarray(x.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(rounded).view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(hi).view(np.uint16), expected.view(np.uint16))
    finite = np.isfinite(expected.astype(np.float32)) & (np.abs(np.asarray(x)) > 1e-30)
    with np.errstate(invalid="ignore"):  # inf + -inf where x rounds to inf (left out by `finite`)
        total = np.asarray(hi, np.float32) + np.asarray(lo, np.float32)
    assert np.all(np.abs(total - np.asarray(x))[finite] <= 2.0 ** -17 * np.abs(np.asarray(x))[finite])


def _edge_values(rng):
    """fp32 values across the exponent range, with the cases where rounding to bf16 is delicate: exact ties
    between two bf16 values (to even either way), values one fp32 ulp either side of a tie, fp32 subnormals,
    values that round up to the next power of two, and the largest finite values (which round to inf)."""
    x = rng.standard_normal((N, N)).astype(np.float32) * np.exp2(rng.integers(-40, 40, (N, N))).astype(np.float32)
    bits = x.view(np.uint32)
    rows = N // 8
    ties = (bits[:rows] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exactly halfway
    bits[:rows] = ties
    bits[rows:2 * rows] = ties + np.uint32(1)
    bits[2 * rows:3 * rows] = ties - np.uint32(1)
    bits[3 * rows:4 * rows] = rng.integers(1, 1 << 23, (rows, N), dtype=np.uint32)  # subnormals
    bits[4 * rows:5 * rows] = np.uint32(0x3F7FFFFF) - rng.integers(0, 1 << 15, (rows, N), dtype=np.uint32)
    bits[5 * rows, :8] = np.uint32(0x7F7FFFFF)  # the largest finite fp32: its bf16 rounding is inf
    x = bits.view(np.float32)
    x[6 * rows:] *= np.where(rng.random((N - 6 * rows, N)) < 0.5, -1, 1).astype(np.float32)
    return x


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
def test_gpu_paired_split_equals_the_scalar_split():
    """Compiled: hi and lo from the paired conversions equal Mosaic GPU's scalar `astype` bit for bit, and hi
    equals numpy's round-to-nearest-even bf16."""
    x = jnp.asarray(_edge_values(np.random.default_rng(7)))
    paired = jax.jit(_split_call(True))(x)
    scalar = jax.jit(_split_call(False))(x)
    assert len(paired) == 3  # hi, lo, the rounding alone
    for a, b in zip(paired, scalar):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(paired[0]).view(np.uint16),
                                  np.asarray(x.astype(jnp.bfloat16)).view(np.uint16))
