"""Metrics of a run: a JSONL log, a progress bar with ETA, MFU, and the loss plot written at the end."""

from __future__ import annotations

import json
import math
import os
import sys
import time

LN2 = math.log(2.0)

# Dense bf16 peak FLOP/s per device (vendor figures), matched against `jax.Device.device_kind`.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
    "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
}


def peak_flops_per_device(device_kind: str):
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return flops
    return None


def loss_metrics(loss: float, is_bytes: bool, prefix: str = "") -> dict:
    """loss, perplexity and (for byte-level data) bits per byte."""
    out = {f"{prefix}loss": loss, f"{prefix}perplexity": math.exp(min(loss, 700.0))}
    if is_bytes:
        out[f"{prefix}bits_per_byte"] = loss / LN2
    return out


class MetricsLog:
    """Appends one JSON object per line. Resuming at step s drops the records written after s."""

    def __init__(self, path: str, *, resume_step: int | None, enabled: bool = True):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if resume_step is not None and os.path.exists(path):
            kept = [line for line in read_records(path) if line.get("step", 0) <= resume_step]
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict):
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """One line on a terminal (redrawn), or a plain line every `every` steps when output is not a terminal."""

    def __init__(self, total: int, start: int, *, enabled: bool = True, every: int = 10, stream=None):
        self.total, self.start, self.enabled, self.every = total, start, enabled, max(every, 1)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, text: str):
        if not self.enabled or not (self.tty or step % self.every == 0 or step == self.total):
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        width = 24
        filled = int(width * step / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} {text} "
                f"elapsed {_clock(elapsed)} ETA {_clock(eta)}")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60:02d}:{seconds % 60:02d}"


def plot_curves(records: list[dict], path: str, title: str = ""):
    """Train loss (raw and smoothed) and the evaluation losses at every length, against the step."""
    # A bare Figure draws off-screen without switching the process's backend (inline plots keep working).
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1)
        smooth, value = [], losses[0]
        for loss in losses:
            value = 0.9 * value + 0.1 * loss
            smooth.append(value)
        ax.plot(steps, smooth, color="tab:blue", lw=1.6, label="train")
    keys = sorted({k for r in evals for k in r if k.startswith("eval_loss@")})
    for key, color in zip(keys, ("tab:orange", "tab:green", "tab:red", "tab:purple")):
        points = [(r["step"], r[key]) for r in evals if key in r]
        ax.plot(*zip(*points), "o-", color=color, lw=1.4, ms=4, label=key.replace("eval_loss", "eval"))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
