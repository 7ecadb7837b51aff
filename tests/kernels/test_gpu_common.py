"""The Triton kernels' product modes (`kernels.gpu.common.dot`) against float64, on tiles beyond fp16's range.

The fp16 modes take an fp16 operand as it is and bring its fp32 partner into fp16's range by a power of two per
tile; unscaled, the tiles here would round to inf or to zero in fp16, which the last assertions check.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from deltajax.kernels.gpu import common
from testing_utils import fresh_key

SCALES = [1e-30, 1e-6, 1.0, 1e6, 1e30]


def _operands(scale, *, transposed):
    rng = np.random.default_rng(np.asarray(fresh_key()).ravel().tolist())
    half = rng.standard_normal((64, 128)).astype(np.float16)
    wide = (rng.standard_normal((128, 32)) * scale).astype(np.float32)
    wide[3, 5] = 0.0  # a zero and a tiny entry beside the tile's large ones
    wide[7, 1] = scale * 1e-9
    return (jnp.asarray(wide.T), jnp.asarray(half.T)) if transposed else (jnp.asarray(half), jnp.asarray(wide))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("transposed", [False, True])
def test_fp16_modes_scale_the_fp32_tile_into_range(scale, transposed):
    """fp16 x fp32 in "fp16_split" within 2^-20 of the float64 product relative to its largest entry (fp16's
    2 x 11 bits), in "fp16" within 2^-10; the fp32 operand first or second."""
    a, b = _operands(scale, transposed=transposed)
    ref = np.float64(a) @ np.float64(b)
    for mode, bound in (("fp16_split", 2.0 ** -20), ("fp16", 2.0 ** -10)):
        out = np.float64(common.dot(a, b, mode=mode))
        err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
        assert err <= bound, (mode, scale, err)
    if scale != 1.0:  # the same pair without the scaling: inf, or the small tiles' bits lost to fp16's subnormals
        wide = a if transposed else b
        hi = wide.astype(jnp.float16)
        lo = (wide - hi.astype(jnp.float32)).astype(jnp.float16)
        pair = lambda x: np.float64(x) @ np.float64(b) if transposed else np.float64(a) @ np.float64(x)
        with np.errstate(invalid="ignore", over="ignore"):
            unscaled = pair(np.float32(hi)) + pair(np.float32(lo))
        assert not np.max(np.abs(unscaled - ref)) / np.max(np.abs(ref)) <= 2.0 ** -20, scale


def test_fp16_scaled_is_exact_and_keeps_non_finite_tiles():
    x = jnp.asarray(np.float32([[3e5, -1.0], [2.0, 7e-3]]))
    scaled, inverse = common.fp16_scaled(x)
    assert 2.0 ** 14 <= float(jnp.max(jnp.abs(scaled))) < 2.0 ** 15
    np.testing.assert_array_equal(np.asarray(scaled * inverse), np.asarray(x))
    zeros, inverse = common.fp16_scaled(jnp.zeros((4, 4)))
    assert np.all(np.asarray(zeros) == 0) and np.isfinite(float(inverse)) and float(inverse) > 0
    scaled, _ = common.fp16_scaled(jnp.asarray(np.float32([[np.inf, 1.0]])))
    assert np.isinf(float(scaled[0, 0]))


def test_other_operands_keep_the_bf16_modes():
    """Without an fp16 operand the fp16 modes are "bf16" and "split": the same values."""
    rng = np.random.default_rng(np.asarray(fresh_key()).ravel().tolist())
    a = jnp.asarray(rng.standard_normal((16, 32)).astype(np.float32)).astype(jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((32, 16)).astype(np.float32))
    for fp16_mode, mode in (("fp16", "bf16"), ("fp16_split", "split")):
        for x, y in ((a, b), (b.T, b)):
            np.testing.assert_array_equal(np.asarray(common.dot(x, y, mode=fp16_mode)),
                                          np.asarray(common.dot(x, y, mode=mode)))
