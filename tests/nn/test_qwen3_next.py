"""Weight import: the Qwen3-Next / Qwen3.5 Gated DeltaNet layers of transformers, reproduced in float32.

The fixtures (tests/fixtures/*_gdn.safetensors) were written by experiments/make_qwen3_next_fixture.py from the
reference torch layers with random weights; see docs/layers.md.
"""

import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deltajax.nn import DeltaRuleMixer, LanguageModel
from deltajax.nn.qwen3_next import (SafetensorsFile, config_from_hf, load_gated_deltanet,
                                    load_linear_attention_layers)
from nn_helpers import relative_error

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures")
IMPORT_TOL = 1e-4


def _fixture(family):
    checkpoint = SafetensorsFile(os.path.join(FIXTURES, f"{family}_gdn.safetensors"))
    hf_config = dict(json.loads(checkpoint.metadata["config"]), layer_types=["linear_attention"], vocab_size=8)
    config = config_from_hf(hf_config, compute_dtype="float32", impl="chunk")
    return checkpoint, config, checkpoint.metadata["prefix"]


_forward = nnx.jit(lambda mixer, x: mixer(x)[0])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_import_reproduces_reference_layer(family):
    checkpoint, config, prefix = _fixture(family)
    assert config.value_heads == 2 * config.n_heads and config.value_dim != config.head_dim
    mixer = DeltaRuleMixer(config, "G", rngs=nnx.Rngs(0))
    load_gated_deltanet(mixer, checkpoint, prefix)
    x, reference = checkpoint["fixture.input"], checkpoint["fixture.output"]
    assert x.shape[1] > config.chunk_size  # the reference ran more than one chunk
    assert relative_error(_forward(mixer, jnp.asarray(x)), reference) <= IMPORT_TOL


def test_misread_fused_layout_is_detected():
    """Reading Qwen3-Next's per-key-head grouped projection as a flat [q | k | v | z] split must fail the check."""
    checkpoint, config, prefix = _fixture("qwen3_next")
    H, K, Hv, V = config.n_heads, config.head_dim, config.value_heads, config.value_dim
    qkvz = checkpoint[prefix + "in_proj_qkvz.weight"]
    ba = checkpoint[prefix + "in_proj_ba.weight"]
    flat = {prefix + name: checkpoint[prefix + name] for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight",
                                                                  "out_proj.weight")}
    flat[prefix + "in_proj_qkv.weight"] = qkvz[:2 * H * K + Hv * V]
    flat[prefix + "in_proj_z.weight"] = qkvz[2 * H * K + Hv * V:]
    flat[prefix + "in_proj_b.weight"], flat[prefix + "in_proj_a.weight"] = ba[:Hv], ba[Hv:]
    mixer = DeltaRuleMixer(config, "G", rngs=nnx.Rngs(0))
    load_gated_deltanet(mixer, flat, prefix)
    y = _forward(mixer, jnp.asarray(checkpoint["fixture.input"]))
    assert relative_error(y, checkpoint["fixture.output"]) > 1e-2


def test_import_into_model_and_shape_errors():
    checkpoint, config, prefix = _fixture("qwen3_next")
    model = LanguageModel(config.replace(n_layers=2, layer_pattern="AG", n_attn_heads=4, n_kv_heads=2,
                                         attn_head_dim=8), rngs=nnx.Rngs(0))
    renamed = {name.replace("layers.0.", "layers.1."): checkpoint[name] for name in checkpoint}
    assert load_linear_attention_layers(model, renamed) == [1]
    np.testing.assert_array_equal(np.asarray(model.blocks[1].mixer.A_log[...]), checkpoint[prefix + "A_log"])
    wrong = DeltaRuleMixer(config.replace(n_value_heads=4, n_heads=4), "G", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="shape"):
        load_gated_deltanet(wrong, checkpoint, prefix)
    with pytest.raises(KeyError, match="neither"):
        load_gated_deltanet(DeltaRuleMixer(config, "G", rngs=nnx.Rngs(0)), checkpoint, "model.layers.9.")
    with pytest.raises(ValueError, match="sigmoid step rule"):
        load_gated_deltanet(DeltaRuleMixer(config.replace(step_rule="efla"), "G", rngs=nnx.Rngs(0)), checkpoint,
                            prefix)


def test_safetensors_reader_bf16_and_f16(tmp_path):
    rng = np.random.default_rng()
    values = rng.standard_normal((3, 5)).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2")  # truncation: exactly representable after widening
    half = rng.standard_normal((4,)).astype("<f2")
    data = bf16.tobytes() + half.tobytes()
    header = {"w": {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, bf16.nbytes]},
              "h": {"dtype": "F16", "shape": [4], "data_offsets": [bf16.nbytes, len(data)]},
              "__metadata__": {"note": "x"}}
    blob = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    f = SafetensorsFile(str(path))
    assert sorted(f) == ["h", "w"] and f.metadata == {"note": "x"}
    np.testing.assert_array_equal(f["w"], (bf16.astype(np.uint32) << 16).view(np.float32).reshape(3, 5))
    assert np.max(np.abs(f["w"] - values)) <= np.max(np.abs(values)) * 2 ** -7
    np.testing.assert_array_equal(f["h"], half)
