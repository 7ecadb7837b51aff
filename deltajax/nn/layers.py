"""Building blocks: projections, RMSNorm (plain and gated), SwiGLU, the causal short convolution, RoPE.

Parameters live in `param_dtype` (float32 by default); every module casts them to the compute dtype at use, and
normalisations, gates and softmax run in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deltajax.rules.common import document_index, resets


def matmul_precision(dtype):
    # Float32 compute is the reference setting (decoding and import checks at 1e-5): keep full fp32 products on
    # accelerators whose default would round operands to tf32/bf16.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


class Linear(nnx.Module):
    """y = x W (+ b), W [d_in, d_out] initialised N(0, std^2)."""

    def __init__(self, d_in: int, d_out: int, *, std: float, rngs: nnx.Rngs, use_bias: bool = False,
                 param_dtype=jnp.float32, compute_dtype=jnp.bfloat16):
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (d_in, d_out), param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype)) if use_bias else None
        self.compute_dtype = compute_dtype

    def __call__(self, x):
        dtype = self.compute_dtype
        y = jnp.dot(x.astype(dtype), self.kernel[...].astype(dtype), precision=matmul_precision(dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y


def rms_normalise(x, eps):
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def l2_normalise(x, eps=1e-6):
    """x / sqrt(|x|^2 + eps) over the last axis (eps inside the root, as in FLA and Qwen3-Next), float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """w * x / rms(x), w initialised to ones; output in the compute dtype."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.compute_dtype = compute_dtype

    def __call__(self, x):
        return (rms_normalise(x, self.eps) * self.weight[...].astype(jnp.float32)).astype(self.compute_dtype)


class GatedRMSNorm(nnx.Module):
    """w * x / rms(x) * act(gate) per head (the output gate of Gated DeltaNet; act is SiLU, or sigmoid in KDA)."""

    def __init__(self, dim: int, *, eps: float, activation: str = "silu", param_dtype=jnp.float32,
                 compute_dtype=jnp.bfloat16):
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"activation must be 'silu' or 'sigmoid', got {activation!r}")
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.activation = activation
        self.compute_dtype = compute_dtype

    def __call__(self, x, gate=None):
        y = rms_normalise(x, self.eps) * self.weight[...].astype(jnp.float32)
        if gate is not None:
            gate = gate.astype(jnp.float32)
            y = y * (jax.nn.silu(gate) if self.activation == "silu" else jax.nn.sigmoid(gate))
        return y.astype(self.compute_dtype)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int, *, std: float, out_std: float, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, compute_dtype=jnp.bfloat16):
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.gate_proj = Linear(d_model, d_ff, std=std, **kw)
        self.up_proj = Linear(d_model, d_ff, std=std, **kw)
        self.down_proj = Linear(d_ff, d_model, std=out_std, **kw)

    def __call__(self, x):
        gate = self.gate_proj(x)
        hidden = (jax.nn.silu(gate.astype(jnp.float32)) * self.up_proj(x).astype(jnp.float32))
        return self.down_proj(hidden.astype(gate.dtype))


class ShortConvolution(nnx.Module):
    """Depthwise causal convolution over time: y_t = sum_i w_i x_{t - (W-1) + i}, then SiLU.

    `weight` is [W, channels] with w_{W-1} on the current token (torch's Conv1d(groups=channels) weight
    [channels, 1, W], transposed). Inputs of another document never reach y_t. The decoding tail holds the last
    W - 1 inputs, [B, W-1, channels].
    """

    def __init__(self, channels: int, kernel_size: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        bound = kernel_size ** -0.5  # torch's Conv1d default for fan_in = W
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, channels), param_dtype,
                                                   -bound, bound))
        self.kernel_size = kernel_size

    def __call__(self, x, *, tail=None, segment_ids=None):
        """x [B, T, C]; returns (silu(conv(x)) in x.dtype [B, T, C], new tail [B, W-1, C] in x.dtype)."""
        B, T, C = x.shape
        W = self.kernel_size
        if tail is None:
            tail = jnp.zeros((B, W - 1, C), x.dtype)
        padded = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # token t sits at t + W - 1
        weight = self.weight[...].astype(jnp.float32)
        if segment_ids is not None:
            doc = document_index(segment_ids, B, T)
            doc_padded = jnp.concatenate([jnp.repeat(doc[:, :1], W - 1, axis=1), doc], axis=1)
        y = jnp.zeros((B, T, C), jnp.float32)
        for i in range(W):
            tap = padded[:, i:i + T].astype(jnp.float32)
            if segment_ids is not None:
                tap = jnp.where((doc_padded[:, i:i + T] == doc)[..., None], tap, 0.0)
            y = y + tap * weight[i]
        new_tail = padded[:, padded.shape[1] - (W - 1):]
        return jax.nn.silu(y).astype(x.dtype), new_tail


def positions_in_document(segment_ids, batch: int, seq_len: int, offset=0):
    """[B, T] int32 positions that restart at 0 at every document start (plus `offset` for decoding)."""
    index = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    if segment_ids is None:
        return jnp.broadcast_to(index, (batch, seq_len)) + offset
    starts = resets(segment_ids, batch, seq_len) | (index == 0)
    start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - start_index + offset


def apply_rope(x, positions, theta: float):
    """Rotary embedding (rotate-half form) of x [B, T, H, D] at positions [B, T], computed in float32."""
    D = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x = x.astype(jnp.float32)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


__all__ = ["GatedRMSNorm", "Linear", "RMSNorm", "ShortConvolution", "SwiGLU", "apply_rope", "l2_normalise",
           "positions_in_document", "rms_normalise", "document_index"]
