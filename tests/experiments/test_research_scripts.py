"""Smoke tests of the research entry points (state_tracking, mqar, lm_compare, estimate_memory): a few steps each,
in a subprocess as a user would run them, checking what they write."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_script(name, *flags, timeout=300):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", name), *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def table_rows(stdout):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ") and not line.startswith("|--")]


def test_estimate_memory_matches_the_seed_formula(tmp_path):
    plot = tmp_path / "memory.png"
    out = run_script("estimate_memory.py", "--emb_dim", "2048", "--n_heads", "16", "--n_layers", "48", "--dtype",
                     "bf16", "--state_dtype", "bf16", "--conv_size", "0", "--table_contexts", "4096,131072",
                     f"--plot={plot}")
    header, *rows = table_rows(out)
    assert header[1:4] == ["full attention (GiB)", "Gated DeltaNet (GiB)", "3:1 hybrid (GiB)"]
    by_context = {row[0]: [float(x) for x in row[1:]] for row in rows}
    # batch 1 x 4096 tokens x 16 heads x 128 x 2 (k, v) x 2 bytes x 48 layers = 1.5 GiB
    assert by_context["4,096"][0] == pytest.approx(1.5, abs=1e-3)
    assert by_context["131,072"][0] == pytest.approx(48.0, abs=1e-3)
    # 16 heads x 128 x 128 x 2 bytes x 48 layers, independent of the context
    assert by_context["4,096"][1] == by_context["131,072"][1] == pytest.approx(0.023, abs=1e-3)
    # 12 attention layers + 36 states
    assert by_context["131,072"][2] == pytest.approx(12.0 + 36 / 48 * 0.0234375, abs=2e-3)
    assert plot.exists() and plot.stat().st_size > 1000


def test_state_tracking_smoke(tmp_path):
    out_json = tmp_path / "st.json"
    out = run_script("state_tracking.py", "--tasks=parity,modular_brackets", "--variants=deltanet_neg", "--steps=3",
                     "--batch_size=4", "--eval_batches=1", "--d_model=16", "--test_len=48",
                     f"--out={out_json}", f"--plot={tmp_path / 'st.png'}")
    assert "| parity | deltanet_neg |" in out and "| modular_brackets | deltanet_neg |" in out
    record = json.loads(out_json.read_text())
    assert record["settings"]["steps"] == 3 and len(record["runs"]) == 2
    for run in record["runs"]:
        chance = run["chance"]
        for split in ("train", "test"):
            acc = run["accuracy"][split]
            assert 0.0 <= acc <= 1.0
            assert run["scaled_accuracy"][split] == pytest.approx((acc - chance) / (1 - chance))
    assert (tmp_path / "st.png").exists()


def test_mqar_smoke(tmp_path):
    out_json = tmp_path / "mqar.json"
    out = run_script("mqar.py", "--variants=linear_attention,gdn_efla", "--widths=16,32", "--steps=3",
                     "--batch_size=4", "--eval_batches=1", "--seq_len=32", "--num_kv_pairs=4", "--vocab_size=64",
                     f"--out={out_json}", f"--plot={tmp_path / 'mqar.png'}")
    header, *rows = table_rows(out)
    assert header == ["model", "d=16", "d=32"] and [r[0] for r in rows] == ["linear_attention", "gdn_efla"]
    record = json.loads(out_json.read_text())
    assert {(r["variant"], r["d_model"]) for r in record["runs"]} == {
        (v, w) for v in ("linear_attention", "gdn_efla") for w in (16, 32)}
    assert all(0.0 <= r["accuracy"]["test"] <= 1.0 for r in record["runs"])


def test_lm_compare_smoke(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the delta rule writes the prediction error into the state.\n" * 200)
    out_json = tmp_path / "lm.json"
    run_script("lm_compare.py", "--variants=gated_deltanet,gdn_longhorn", "--d_model=16", "--steps=2",
               "--batch_size=2", "--seq_len=16", "--eval_every=0", "--eval_batches=1", f"--data={corpus}",
               f"--run_root={tmp_path / 'runs'}", f"--out={out_json}", f"--plot={tmp_path / 'lm.png'}")
    record = json.loads(out_json.read_text())
    assert [r["variant"] for r in record["runs"]] == ["gated_deltanet", "gdn_longhorn"]
    for run in record["runs"]:
        assert run["tokens"] == 2 * 2 * 16
        for key in ("eval_loss@1x", "eval_loss@2x", "eval_perplexity@1x", "eval_perplexity@2x"):
            assert math.isfinite(run["summary"][key])
    assert (tmp_path / "lm.png").exists()
