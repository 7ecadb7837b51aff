"""experiments/train.py end to end on CPU: a short run, its outputs, --helpfull, and two processes == one."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "train.py")
TINY = ["--d_model=32", "--n_layers=2", "--layer_pattern=GA", "--n_heads=2", "--head_dim=16", "--n_value_heads=2",
        "--value_head_dim=16", "--n_attn_heads=2", "--n_kv_heads=1", "--attn_head_dim=16", "--chunk_size=16",
        "--seq_len=32", "--batch_size=4", "--eval_batches=2", "--log_every=1", "--eval_every=0"]


def _run(args, env=None, **kwargs):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    # No forced host device count reaches the script (the two-process test counts its devices); tests/conftest.py's
    # compile-speed flag does.
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if not flag.startswith("--xla_force_host_platform_device_count"))
    return subprocess.Popen([sys.executable, SCRIPT, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _finish(process, timeout=300):
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:] + err[-3000:]
    return out


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


def test_short_run_writes_everything_and_resumes(tmp_path):
    run_dir = str(tmp_path / "run")
    out = _finish(_run(TINY + ["--steps=4", "--checkpoint_every=2", "--stop_after=2", f"--run_dir={run_dir}"]))
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[:1] == ["2"]
    out = _finish(_run(TINY + ["--steps=4", "--checkpoint_every=2", f"--run_dir={run_dir}"]))
    assert "resumed from" in out and "eval perplexity @1x (32 tokens)" in out and "@2x (64 tokens)" in out
    assert os.path.exists(os.path.join(run_dir, "loss.png")) and len(_losses(run_dir)) == 4
    assert "4" in os.listdir(os.path.join(run_dir, "checkpoints"))


def test_helpfull_documents_every_flag():
    out, err = _run(["--helpfull"]).communicate(timeout=120)  # absl exits with status 1 after printing help
    out += err
    for flag in ("--preset", "--rule", "--step_rule", "--layer_pattern", "--d_model", "--data", "--seq_len",
                 "--batch_size", "--learning_rate", "--warmup_steps", "--grad_clip", "--grad_accum_steps",
                 "--steps", "--eval_every", "--run_dir", "--seed", "--compute_dtype", "--sequence_parallel",
                 "--coordinator_address", "--num_processes", "--process_id", "--checkpoint_every"):
        assert flag in out, flag


def test_two_processes_match_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = TINY + ["--steps=3", "--checkpoint_every=3", "--progress_bar=false"]
    single = _run(common + [f"--run_dir={tmp_path / 'one'}"])
    pair = [_run(common + [f"--run_dir={tmp_path / 'two'}", f"--coordinator_address=127.0.0.1:{port}",
                           "--num_processes=2", f"--process_id={i}"]) for i in range(2)]
    _finish(single)
    for p in pair:
        _finish(p)
    one, two = _losses(str(tmp_path / "one")), _losses(str(tmp_path / "two"))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)  # the same global batch, summed in another order
    assert os.listdir(tmp_path / "two" / "checkpoints") == ["3"]
