"""Configuration checks, presets and the size / FLOP / memory helpers (no compilation)."""

import pytest
from flax import nnx

from deltajax.nn import (PRESETS, LanguageModel, ModelConfig, count_parameters, decoding_memory, flops_per_token,
                         kv_cache_bytes, recurrent_state_bytes)
from nn_helpers import tiny_config

BAD = [
    (dict(layer_pattern="GGXA"), "unknown letter"),
    (dict(layer_pattern=""), "non-empty"),
    (dict(n_heads=3, n_value_heads=4), "multiple of n_heads"),
    (dict(n_attn_heads=4, n_kv_heads=3), "must divide"),
    (dict(attn_head_dim=7), "even"),
    (dict(step_rule="adam"), "step_rule must be one of"),
    (dict(layer_pattern="LA", step_rule="kaczmarz"), "has none"),
    (dict(layer_pattern="LLLA", step_rule="negative_eigenvalues"), "has none"),
    (dict(step_rule="relaxed_kaczmarz", relaxed_kaczmarz_eps=0.0), "relaxed_kaczmarz_eps"),
    (dict(compute_dtype="float8"), "compute_dtype"),
    (dict(chunk_size=48), "power of two"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(d_model=0), "d_model must be a positive int"),
    (dict(head_dim=16.0), "head_dim must be a positive int"),
    (dict(conv_size=-1), "conv_size"),
]


@pytest.mark.parametrize("changes,message", BAD)
def test_bad_configs_raise(changes, message):
    config = tiny_config().replace(**changes)
    with pytest.raises(ValueError, match=message):
        config.validate()
    with pytest.raises(ValueError, match=message):
        LanguageModel(config, rngs=nnx.Rngs(0))


def test_pattern_repeats_to_n_layers():
    config = tiny_config(layer_pattern="GGGA", n_layers=10)
    assert config.layer_types == "GGGAGGGAGG"
    assert tiny_config(layer_pattern="KKKA", n_layers=3).layer_types == "KKK"


def test_presets_validate_and_tiny_is_about_a_million():
    for name, config in PRESETS.items():
        assert isinstance(config, ModelConfig) and config.validate() is config, name
    assert 0.5e6 < count_parameters(PRESETS["tiny-hybrid"]) < 2e6
    assert PRESETS["qwen3-next-like-small"].layer_types[:4] == "GGGA"
    assert PRESETS["kda-hybrid-small"].layer_types[:4] == "KKKA"


def test_count_parameters_matches_the_formula():
    config = tiny_config(layer_pattern="G", n_layers=1, conv_size=4, tie_embeddings=True)
    d, H, K, Hv, V, f = 32, 2, 8, 4, 8, 48
    mixer = (d * H * K * 2 + d * Hv * V  # q, k, v
             + 4 * (2 * H * K + Hv * V)  # conv
             + d * Hv * 2 + Hv * 2  # b, a projections; A_log, dt_bias
             + d * Hv * V + V + Hv * V * d)  # output gate, gated norm, output projection
    expected = 64 * d + 2 * d + mixer + 3 * d * f + d  # embedding, two block norms, mixer, MLP, final norm
    assert count_parameters(config) == expected


def test_decoding_memory_follows_seed_004():
    assert kv_cache_bytes(2, 1000, 4, 64, 2) == 2 * 1000 * 4 * 64 * 2 * 2
    assert recurrent_state_bytes(2, 8, 64, 128, 4) == 2 * 8 * 64 * 128 * 4
    config = PRESETS["qwen3-next-like-small"]
    short, long = decoding_memory(config, 1, 1024), decoding_memory(config, 1, 8192)
    assert long["per_layer"]["A"] == 8 * short["per_layer"]["A"]
    assert long["per_layer"]["G"] == short["per_layer"]["G"]
    assert short["total"] == sum(short["by_type"].values())
    assert short["by_type"]["G"] == 9 * short["per_layer"]["G"] and short["by_type"]["A"] == 3 * short["per_layer"]["A"]


def test_flops_per_token():
    config = PRESETS["qwen3-next-like-small"]
    n_matmul = count_parameters(config) - config.vocab_size * config.d_model  # tied: the head reuses the embedding
    forward = flops_per_token(config, 2048, training=False)
    # projections dominate; the head is counted once, norms and the sequence work come on top
    assert 2 * (n_matmul + config.vocab_size * config.d_model) * 0.9 < forward
    assert flops_per_token(config, 2048) == 3 * forward
    # only attention grows with the context
    recurrent = PRESETS["gdn-small"]
    assert flops_per_token(recurrent, 8192) == flops_per_token(recurrent, 4096)
    assert flops_per_token(config, 8192) > flops_per_token(config, 4096)
