"""`kernels/gpu/mosaic_common.py`: the bf16 split of fp32 registers in pairs of elements (`PAIRED_CONVERSIONS`).

On CPU: the split kernel lowered for an abstract H100 (the Mosaic GPU interpreter cannot run `plgpu.inline_mgpu`;
the passes with paired splits: `test_mosaic_wy.py::test_paired_splits_lower_for_cuda`). On a GPU: the paired split
against Mosaic GPU's scalar conversions (`split_scalar`), bit for bit.
"""

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


def _split_kernel(x_ref, hi_ref, lo_ref, *, paired):
    x = plgpu.load(x_ref, layout=plgpu.Layout.WGMMA, optimized=False)
    hi, lo = mc._split_in_pairs(x) if paired else mc.split_scalar(x)
    hi_ref[...] = mc.wgmma_layout(hi)
    lo_ref[...] = mc.wgmma_layout(lo)


def _split_call(paired):
    out = jax.ShapeDtypeStruct((N, N), jnp.bfloat16)
    return plgpu.kernel(functools.partial(_split_kernel, paired=paired), out_type=(out, out),
                        compiler_params=plgpu.CompilerParams())


def test_paired_split_lowers_for_cuda():
    """One `cvt.rn.bf16x2.f32` pair conversion for hi and one for lo in the lowered kernel."""
    x = jax.ShapeDtypeStruct((N, N), jnp.float32)
    with jax.sharding.use_abstract_mesh(H100):
        text = jax.jit(_split_call(True)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1
    assert "cvt.rn.bf16x2.f32" in text


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
    for a, b in zip(paired, scalar):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(paired[0]).view(np.uint16),
                                  np.asarray(x.astype(jnp.bfloat16)).view(np.uint16))
