"""Import of Hugging Face Qwen3-Next / Qwen3.5 Gated DeltaNet ("linear_attn") layer weights, without torch.

Checkpoint layout of one layer (torch Linear weights are [out, in]; ours are [in, out]):

    Qwen3-Next  in_proj_qkvz.weight [2 H K + 2 Hv V, d]   rows grouped by key head h:
                                                          [q_h (K) | k_h (K) | v of its g = Hv/H heads (g V) | z (g V)]
                in_proj_ba.weight   [2 Hv, d]             rows per key head h: [b (g) | a (g)]
    Qwen3.5     in_proj_qkv.weight  [2 H K + Hv V, d]     [q (H K) | k (H K) | v (Hv V)], heads in order
                in_proj_z.weight [Hv V, d], in_proj_b.weight [Hv, d], in_proj_a.weight [Hv, d]
    both        conv1d.weight [2 H K + Hv V, 1, W]        depthwise, channels [q | k | v], tap W-1 = current token
                dt_bias [Hv], A_log [Hv], norm.weight [V] (gated RMSNorm, weight used as is), out_proj.weight [d, Hv V]

Value head h g + j reads key head h (torch `repeat_interleave`), the same grouping as `deltajax.rules`. The layer
then computes exactly `DeltaRuleMixer` "G" with the sigmoid step rule: beta = sigmoid(b),
g = -exp(A_log) softplus(a + dt_bias), L2-normalised q, k (eps 1e-6 inside the root), scale K^-1/2, output
rmsnorm(o) * w * silu(z).

Safetensors is read by `SafetensorsFile` (8-byte header length, JSON header, raw little-endian data), with
memory-mapped tensors so that one layer of a large checkpoint can be read without loading the rest.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from deltajax.nn.config import ModelConfig
from deltajax.nn.mixers import DeltaRuleMixer

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafetensorsFile(Mapping):
    """Read-only mapping name -> numpy array over one .safetensors file (bf16 is widened to float32)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._data_start = 8 + header_len

    def __getitem__(self, name):
        entry = self._entries[name]
        dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype_name not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {dtype_name}")
        dtype = _DTYPES[dtype_name]
        count = int(np.prod(shape, dtype=np.int64))
        if dtype == "bfloat16":
            raw = np.memmap(self.path, np.dtype("<u2"), "r", self._data_start + begin, (count,))
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        dtype = np.dtype(dtype).newbyteorder("<")
        if count * dtype.itemsize != end - begin:
            raise ValueError(f"{self.path}: tensor {name} has {end - begin} bytes for shape {shape} {dtype_name}")
        if count == 0:
            return np.zeros(shape, dtype)
        return np.array(np.memmap(self.path, dtype, "r", self._data_start + begin, (count,))).reshape(shape)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)


def open_checkpoint(path: str) -> Mapping[str, np.ndarray]:
    """A name -> array mapping over a .safetensors file or a directory of shards (`*.safetensors`)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"no .safetensors files in {path}")
        shards = [SafetensorsFile(f) for f in files]
        return _Shards(shards)
    return SafetensorsFile(path)


class _Shards(Mapping):
    def __init__(self, shards):
        self._where = {name: shard for shard in shards for name in shard}

    def __getitem__(self, name):
        return self._where[name][name]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def config_from_hf(hf_config: Mapping, **overrides) -> ModelConfig:
    """A `ModelConfig` whose "G" layers have the shapes of the checkpoint's linear-attention layers.

    `hf_config` is the checkpoint's config.json as a dict (for Qwen3.5 the "text_config" part is used). The
    pattern marks "linear_attention" layers G and "full_attention" layers A; only G layers are importable.
    """
    c = dict(hf_config.get("text_config", hf_config))
    if "layer_types" in c and c["layer_types"]:
        pattern = "".join("G" if t == "linear_attention" else "A" for t in c["layer_types"])
    else:
        interval = int(c.get("full_attention_interval", 4))
        pattern = "G" * (interval - 1) + "A"
    n_layers = int(c.get("num_hidden_layers", len(pattern)))
    fields = dict(
        vocab_size=int(c.get("vocab_size", 1)), d_model=int(c["hidden_size"]), n_layers=n_layers,
        layer_pattern=pattern, n_heads=int(c["linear_num_key_heads"]), head_dim=int(c["linear_key_head_dim"]),
        n_value_heads=int(c["linear_num_value_heads"]), value_head_dim=int(c["linear_value_head_dim"]),
        conv_size=int(c.get("linear_conv_kernel_dim", 4)), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        step_rule="sigmoid", use_output_gate=True,
    )
    if "num_attention_heads" in c:
        fields.update(n_attn_heads=int(c["num_attention_heads"]),
                      n_kv_heads=int(c.get("num_key_value_heads", c["num_attention_heads"])),
                      attn_head_dim=int(c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])))
    if "intermediate_size" in c:
        fields["d_ff"] = int(c["intermediate_size"])
    if "tie_word_embeddings" in c:
        fields["tie_embeddings"] = bool(c["tie_word_embeddings"])
    fields.update(overrides)
    return ModelConfig(**fields).validate()


def gated_deltanet_weights(tensors: Mapping[str, np.ndarray], prefix: str, *, key_heads: int, key_dim: int,
                           value_heads: int, value_dim: int) -> dict[str, np.ndarray]:
    """One layer's checkpoint tensors in our layout: {q, k, v, z, b, a: [d, out]; conv [W, C]; dt_bias; A_log;
    norm [V]; out [Hv V, d]} as float32 numpy arrays. Detects the Qwen3-Next (fused) or Qwen3.5 naming."""
    H, K, Hv, V = key_heads, key_dim, value_heads, value_dim
    if Hv % H:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({H})")
    g = Hv // H

    def get(name, shape=None):
        full = prefix + name
        if full not in tensors:
            raise KeyError(f"checkpoint has no tensor {full!r}")
        x = np.asarray(tensors[full], np.float32)
        if shape is not None and x.shape != tuple(shape):
            raise ValueError(f"{full} has shape {x.shape}, expected {tuple(shape)} for H={H}, K={K}, Hv={Hv}, V={V}")
        return x

    if prefix + "in_proj_qkvz.weight" in tensors:
        qkvz = get("in_proj_qkvz.weight")
        d = qkvz.shape[-1]
        qkvz = get("in_proj_qkvz.weight", (2 * H * K + 2 * Hv * V, d)).reshape(H, 2 * K + 2 * g * V, d)
        q, k = qkvz[:, :K], qkvz[:, K:2 * K]
        v, z = qkvz[:, 2 * K:2 * K + g * V], qkvz[:, 2 * K + g * V:]
        ba = get("in_proj_ba.weight", (2 * Hv, d)).reshape(H, 2 * g, d)
        b, a = ba[:, :g], ba[:, g:]
        rows = [x.reshape(-1, d) for x in (q, k, v, z, b, a)]
    elif prefix + "in_proj_qkv.weight" in tensors:
        qkv = get("in_proj_qkv.weight")
        d = qkv.shape[-1]
        qkv = get("in_proj_qkv.weight", (2 * H * K + Hv * V, d))
        q, k, v = np.split(qkv, [H * K, 2 * H * K])
        rows = [q, k, v, get("in_proj_z.weight", (Hv * V, d)), get("in_proj_b.weight", (Hv, d)),
                get("in_proj_a.weight", (Hv, d))]
    else:
        raise KeyError(f"checkpoint has neither {prefix}in_proj_qkvz.weight (Qwen3-Next) nor "
                       f"{prefix}in_proj_qkv.weight (Qwen3.5)")
    weights = {name: np.ascontiguousarray(x.T) for name, x in zip(("q", "k", "v", "z", "b", "a"), rows)}
    conv = get("conv1d.weight")
    if conv.ndim != 3 or conv.shape[:2] != (2 * H * K + Hv * V, 1):
        raise ValueError(f"{prefix}conv1d.weight has shape {conv.shape}, expected [{2 * H * K + Hv * V}, 1, W]")
    weights["conv"] = np.ascontiguousarray(conv[:, 0, :].T)
    weights["dt_bias"] = get("dt_bias", (Hv,))
    weights["A_log"] = get("A_log", (Hv,))
    weights["norm"] = get("norm.weight", (V,))
    weights["out"] = np.ascontiguousarray(get("out_proj.weight", (d, Hv * V)).T)
    if prefix + "conv1d.bias" in tensors:
        raise ValueError(f"{prefix}conv1d.bias is present; the layer's short convolution has no bias")
    return weights


def load_gated_deltanet(mixer: DeltaRuleMixer, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
    """Copies one checkpoint linear-attention layer (names under `prefix`) into `mixer`, in place."""
    if mixer.rule != "gated_deltanet" or mixer.step_rule != "sigmoid":
        raise ValueError(f"Qwen3-Next layers are Gated DeltaNet with the sigmoid step rule; this mixer is "
                         f"{mixer.rule} with step rule {mixer.step_rule!r}")
    if mixer.conv is None or mixer.g_proj is None:
        raise ValueError("Qwen3-Next layers have a short convolution and an output gate (conv_size > 0, "
                         "use_output_gate=True)")
    w = gated_deltanet_weights(tensors, prefix, key_heads=mixer.key_heads, key_dim=mixer.key_dim,
                               value_heads=mixer.value_heads, value_dim=mixer.value_dim)
    targets = {"q": mixer.q_proj.kernel, "k": mixer.k_proj.kernel, "v": mixer.v_proj.kernel,
               "z": mixer.g_proj.kernel, "b": mixer.b_proj.kernel, "a": mixer.a_proj.kernel,
               "conv": mixer.conv.weight, "dt_bias": mixer.dt_bias, "A_log": mixer.A_log,
               "norm": mixer.norm.weight, "out": mixer.o_proj.kernel}
    for name, param in targets.items():
        if tuple(param.shape) != w[name].shape:
            raise ValueError(f"{prefix}: {name} has shape {w[name].shape} in the checkpoint but {tuple(param.shape)} "
                             f"in the layer (d_model or conv_size differ)")
    for name, param in targets.items():
        param.value = jnp.asarray(w[name], param.dtype)


def load_linear_attention_layers(model, tensors: Mapping[str, np.ndarray],
                                 prefix_template: str = "model.layers.{i}.linear_attn.") -> list[int]:
    """Loads every "G" block of a `LanguageModel` whose checkpoint layer exists; returns the loaded indices."""
    loaded = []
    for i, block in enumerate(model.blocks):
        prefix = prefix_template.format(i=i)
        if block.letter == "G" and any(name.startswith(prefix) for name in tensors):
            load_gated_deltanet(block.mixer, tensors, prefix)
            loaded.append(i)
    return loaded


__all__ = ["SafetensorsFile", "config_from_hf", "gated_deltanet_weights", "load_gated_deltanet",
           "load_linear_attention_layers", "open_checkpoint"]
