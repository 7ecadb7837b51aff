"""Writes the Gated DeltaNet weight-import fixtures from the reference transformers layers (torch, CPU, float32).

Not part of deltajax (it needs torch and transformers, which deltajax never imports). Run it in its own
Python 3.11 environment; docs/layers.md has the exact commands:

    python3 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers safetensors
    HF_HUB_OFFLINE=1 /tmp/torchenv/bin/python experiments/make_qwen3_next_fixture.py --out tests/fixtures

For each of Qwen3-Next (fused in_proj_qkvz / in_proj_ba) and Qwen3.5 (separate in_proj_qkv / z / b / a) it builds
one linear-attention layer of a tiny config, draws every parameter at random (seeded), runs a random input
[2, 80, hidden] through the layer without a cache (so the reference's pure-torch chunked gated delta rule runs,
80 tokens = more than one 64-token chunk) and saves, in one safetensors file:
    the layer's weights under their checkpoint names with prefix "model.layers.0.linear_attn.",
    "fixture.input" [2, 80, hidden] and "fixture.output" [2, 80, hidden],
    metadata: the layer's config (JSON) and the generator's package versions.
"""

from __future__ import annotations

import argparse
import json
import os

import safetensors
import torch
import transformers
from safetensors.torch import save_file

PREFIX = "model.layers.0.linear_attn."
SIZES = dict(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=24, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
BATCH, SEQ_LEN = 2, 80


def build_layer(family: str):
    if family == "qwen3_next":
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        config = Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=64,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                 num_experts=0, **SIZES)
        return config, Qwen3NextGatedDeltaNet(config, layer_idx=0)
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=64,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                               **SIZES)
    return config, Qwen3_5GatedDeltaNet(config, layer_idx=0)


def randomise(layer: torch.nn.Module, generator: torch.Generator):
    """Every parameter random and away from its default (a ones norm weight would hide a missing import)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0, generator=generator)))
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5 - 1.0)
            elif name.startswith("norm."):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=generator))
            elif name.startswith("conv1d."):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.4)
            else:  # projections [out, in]: unit-variance outputs for unit-variance inputs
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)


def make(family: str, out_dir: str, seed: int) -> str:
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    config, layer = build_layer(family)
    layer = layer.float().eval()
    randomise(layer, generator)
    x = torch.randn(BATCH, SEQ_LEN, config.hidden_size, generator=generator)
    with torch.no_grad():
        y = layer(x)
    tensors = {PREFIX + name: p.detach().contiguous() for name, p in layer.named_parameters()}
    tensors["fixture.input"] = x.contiguous()
    tensors["fixture.output"] = y.contiguous()
    layer_config = {k: getattr(config, k) for k in SIZES}
    metadata = {
        "family": family,
        "prefix": PREFIX,
        "config": json.dumps(layer_config),
        "seed": str(seed),
        "generator": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"safetensors {safetensors.__version__}; experiments/make_qwen3_next_fixture.py",
    }
    path = os.path.join(out_dir, f"{family}_gdn.safetensors")
    save_file(tensors, path, metadata=metadata)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures")
    parser.add_argument("--seed", type=int, default=20261122)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for family in ("qwen3_next", "qwen3_5"):
        path = make(family, args.out, args.seed)
        print(path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
