"""Flax NNX layers and language models built on `deltajax.rules`.

`LanguageModel(config, rngs=...)` maps tokens [B, T] to float32 logits; `ModelConfig` describes it (layer pattern
of G / D / K / L / A mixers, sizes, step rule, dtypes) and `PRESETS` names a few. Decoding passes caches
explicitly (`init_cache`, `model(tokens, cache=...)`, `generate`). `qwen3_next` imports Hugging Face Qwen3-Next /
Qwen3.5 Gated DeltaNet layer weights.
"""

from deltajax.nn.config import MIXER_LETTERS, PRESETS, STEP_RULES, ModelConfig
from deltajax.nn.estimates import (
    count_parameters,
    decoding_memory,
    flops_per_token,
    kv_cache_bytes,
    recurrent_state_bytes,
)
from deltajax.nn.generate import generate, sample_token
from deltajax.nn.layers import GatedRMSNorm, Linear, RMSNorm, ShortConvolution, SwiGLU
from deltajax.nn.mixers import AttentionCache, DeltaRuleCache, DeltaRuleMixer, GatedAttention
from deltajax.nn.model import Block, LanguageModel, ModelCache

__all__ = [
    "AttentionCache", "Block", "DeltaRuleCache", "DeltaRuleMixer", "GatedAttention", "GatedRMSNorm",
    "LanguageModel", "Linear", "MIXER_LETTERS", "ModelCache", "ModelConfig", "PRESETS", "RMSNorm", "STEP_RULES",
    "ShortConvolution", "SwiGLU", "count_parameters", "decoding_memory", "flops_per_token", "generate",
    "kv_cache_bytes", "recurrent_state_bytes", "sample_token",
]
