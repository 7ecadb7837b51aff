"""Model configuration: one frozen dataclass, validated before any parameter is created, and named presets."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Layer letters of `layer_pattern`: the token mixer of each residual block.
MIXER_LETTERS = {
    "G": "gated_deltanet",
    "D": "deltanet",
    "L": "linear_attention",
    "K": "kda",
    "A": "attention",
}
DELTA_RULE_LETTERS = "GDK"
RECURRENT_LETTERS = "GDKL"

# Step rules: how the per-token write strength comes from its projection logits. The first two act on unit
# keys; the others need the raw key norm, so their keys are not L2-normalised.
STEP_RULES = ("sigmoid", "negative_eigenvalues", "kaczmarz", "relaxed_kaczmarz", "longhorn", "efla")
RAW_KEY_STEP_RULES = ("kaczmarz", "relaxed_kaczmarz", "longhorn", "efla")
DTYPES = ("float32", "bfloat16", "float16")
IMPLS_BUILTIN = ("auto", "chunk", "scan")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A causal LM of pre-norm residual blocks; block i mixes tokens with `layer_pattern[i % len(pattern)]`.

    Recurrent layers (G, D, K, L) have `n_heads` query/key heads of width `head_dim` and `n_value_heads` value
    heads (a multiple of `n_heads`) of width `value_head_dim`; their state is [n_value_heads, head_dim,
    value_head_dim] per sequence. Attention layers (A) have `n_attn_heads` query heads, `n_kv_heads` key/value
    heads and `attn_head_dim`. Unset (None) sizes fall back to `n_heads` / `head_dim`.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    layer_pattern: str = "GGGA"
    n_heads: int = 4
    head_dim: int = 64
    n_value_heads: int | None = None
    value_head_dim: int | None = None
    n_attn_heads: int | None = None
    n_kv_heads: int | None = None
    attn_head_dim: int | None = None
    mlp_ratio: float = 4.0
    d_ff: int | None = None
    step_rule: str = "sigmoid"
    relaxed_kaczmarz_eps: float = 1e-6
    conv_size: int = 4
    use_output_gate: bool = True
    kda_gate_rank: int | None = None
    attn_qk_norm: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    impl: str = "auto"
    chunk_size: int = 64

    # Resolved sizes.
    @property
    def layer_types(self) -> str:
        """The mixer letter of every layer, `n_layers` long."""
        pattern = self.layer_pattern
        return (pattern * (-(-self.n_layers // max(len(pattern), 1))))[: self.n_layers]

    @property
    def value_heads(self) -> int:
        return self.n_heads if self.n_value_heads is None else self.n_value_heads

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def attn_heads(self) -> int:
        return self.n_heads if self.n_attn_heads is None else self.n_attn_heads

    @property
    def kv_heads(self) -> int:
        return self.attn_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def attn_dim(self) -> int:
        return self.head_dim if self.attn_head_dim is None else self.attn_head_dim

    @property
    def ffn_dim(self) -> int:
        return int(self.d_ff) if self.d_ff is not None else int(round(self.mlp_ratio * self.d_model))

    @property
    def gate_rank(self) -> int:
        return self.value_dim if self.kda_gate_rank is None else self.kda_gate_rank

    @property
    def compute_jnp_dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def param_jnp_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "ModelConfig":
        """Raises ValueError naming the first inconsistent field; returns self so it can be chained."""

        def positive_int(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim"):
            positive_int(name)
        for name in ("n_value_heads", "value_head_dim", "n_attn_heads", "n_kv_heads", "attn_head_dim", "d_ff",
                     "kda_gate_rank"):
            if getattr(self, name) is not None:
                positive_int(name)
        if not isinstance(self.layer_pattern, str) or not self.layer_pattern:
            raise ValueError(f"layer_pattern must be a non-empty string of {sorted(MIXER_LETTERS)}, "
                             f"got {self.layer_pattern!r}")
        unknown = sorted(set(self.layer_pattern) - set(MIXER_LETTERS))
        if unknown:
            raise ValueError(f"layer_pattern {self.layer_pattern!r} has unknown letter(s) {unknown}; use "
                             + ", ".join(f"{k} ({v})" for k, v in MIXER_LETTERS.items()))
        if self.value_heads % self.n_heads:
            raise ValueError(f"n_value_heads ({self.value_heads}) must be a multiple of n_heads ({self.n_heads})")
        if self.attn_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads ({self.kv_heads}) must divide the attention heads ({self.attn_heads})")
        if "A" in self.layer_pattern and self.attn_dim % 2:
            raise ValueError(f"attention head_dim must be even for rotary embeddings, got {self.attn_dim}")
        if self.mlp_ratio <= 0 and self.d_ff is None:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio!r}")
        if self.step_rule not in STEP_RULES:
            raise ValueError(f"step_rule must be one of {STEP_RULES}, got {self.step_rule!r}")
        has_delta = any(c in DELTA_RULE_LETTERS for c in self.layer_pattern)
        if self.step_rule != "sigmoid" and not has_delta:
            raise ValueError(
                f"step_rule={self.step_rule!r} sets the write strength of delta-rule layers (G, D, K), but "
                f"layer_pattern {self.layer_pattern!r} has none: linear attention (L) and softmax attention (A) "
                f"have no step size")
        if self.step_rule == "relaxed_kaczmarz" and not self.relaxed_kaczmarz_eps > 0:
            raise ValueError(f"relaxed_kaczmarz_eps must be > 0, got {self.relaxed_kaczmarz_eps!r}")
        if not isinstance(self.conv_size, int) or self.conv_size < 0:
            raise ValueError(f"conv_size must be an int >= 0 (0 disables the short convolution), "
                             f"got {self.conv_size!r}")
        for name in ("compute_dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a positive power of two, got {self.chunk_size!r}")
        from deltajax.rules import dispatch

        known = set(IMPLS_BUILTIN) | set(dispatch.implementations("delta_rule")) | set(
            dispatch.implementations("linear_attention"))
        if self.impl not in known:
            raise ValueError(f"impl must be one of {sorted(known)}, got {self.impl!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std!r}")
        return self


PRESETS: dict[str, ModelConfig] = {
    # ~1.2M parameters: CPU tests and smoke runs.
    "tiny-hybrid": ModelConfig(
        vocab_size=1024, d_model=128, n_layers=4, layer_pattern="GGGA", n_heads=2, head_dim=32, n_value_heads=4,
        value_head_dim=32, n_attn_heads=4, n_kv_heads=2, attn_head_dim=32, mlp_ratio=4.0),
    # Pure Gated DeltaNet, FLA-style sizes (value expansion 2).
    "gdn-small": ModelConfig(
        vocab_size=32000, d_model=768, n_layers=12, layer_pattern="G", n_heads=6, head_dim=128,
        value_head_dim=256, mlp_ratio=4.0),
    # Qwen3-Next layout: 3 Gated DeltaNet : 1 gated attention, more value heads than key heads, GQA attention.
    "qwen3-next-like-small": ModelConfig(
        vocab_size=32000, d_model=768, n_layers=12, layer_pattern="GGGA", n_heads=4, head_dim=128,
        n_value_heads=8, value_head_dim=128, n_attn_heads=8, n_kv_heads=2, attn_head_dim=128, mlp_ratio=3.0),
    # Kimi-Linear layout: 3 KDA : 1 gated attention.
    "kda-hybrid-small": ModelConfig(
        vocab_size=32000, d_model=768, n_layers=12, layer_pattern="KKKA", n_heads=6, head_dim=128,
        n_attn_heads=8, n_kv_heads=2, attn_head_dim=96, mlp_ratio=3.0),
    # Pure DeltaNet with negative eigenvalues (state tracking).
    "deltanet-small": ModelConfig(
        vocab_size=32000, d_model=768, n_layers=12, layer_pattern="D", n_heads=6, head_dim=128,
        step_rule="negative_eigenvalues", mlp_ratio=4.0),
}
