"""Shared by the synthetic-task entry points (state_tracking.py, mqar.py): build a small model, train it with the
trainer's optimiser and step on a grain source, and score accuracy on the weighted positions of held-out batches.

Accuracy needs argmax predictions, which `deltajax.train.train` does not report (it evaluates loss only), so these
runs drive `make_train_step` directly instead of calling `train`.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deltajax.data import train_iterator
from deltajax.nn import PRESETS, ModelConfig, count_parameters
from deltajax.train import OptimConfig, init_state, make_optimizer, make_train_step
from deltajax.train.parallel import make_mesh

# Model letter and step rule of every named variant.
VARIANTS = {
    "linear_attention": ("L", "sigmoid"),
    "deltanet": ("D", "sigmoid"),
    "deltanet_neg": ("D", "negative_eigenvalues"),
    "gated_deltanet": ("G", "sigmoid"),
    "gated_deltanet_neg": ("G", "negative_eigenvalues"),
    "kda": ("K", "sigmoid"),
    "gdn_kaczmarz": ("G", "kaczmarz"),
    "gdn_relaxed_kaczmarz": ("G", "relaxed_kaczmarz"),
    "gdn_longhorn": ("G", "longhorn"),
    "gdn_efla": ("G", "efla"),
}


def default_impl(impl: str | None) -> str:
    """On CPU the token-by-token scan trains these small models much faster than the chunked form (0.18 s vs 4.9 s
    per step for the parity model, 2 layers x d_model 128, batch 32 x 40 tokens, on a shared 2-core CPU); elsewhere
    let the dispatch choose."""
    if impl:
        return impl
    return "scan" if jax.default_backend() == "cpu" else "auto"


def model_config(variant: str, *, vocab_size: int, d_model: int, n_layers: int, impl: str,
                 chunk_size: int = 64) -> ModelConfig:
    """Two heads of width d_model / 2 (keys and values), float32 compute, SwiGLU x4."""
    letter, step_rule = VARIANTS[variant]
    head = max(d_model // 2, 8)
    return PRESETS["tiny-hybrid"].replace(
        vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, layer_pattern=letter, step_rule=step_rule,
        n_heads=2, head_dim=head, n_value_heads=2, value_head_dim=head, compute_dtype="float32", impl=impl,
        chunk_size=chunk_size).validate()


def make_predict(graphdef):
    @jax.jit
    def predict(params, rest, inputs):
        model = nnx.merge(graphdef, params, rest)
        return jnp.argmax(model(inputs), axis=-1)

    return predict


def train_and_score(config: ModelConfig, train_source, eval_sets: dict, *, steps: int, batch_size: int,
                    learning_rate: float, seed: int = 0, log_every: int = 50, log=print) -> dict:
    """Trains `config` on `train_source` and returns losses, timings and {name: accuracy} for every eval set.

    eval_sets: {name: list of batches (dicts of numpy arrays with inputs, targets, weights)}; accuracy is the
    fraction of weighted positions whose argmax prediction equals the target.
    """
    optim = OptimConfig(learning_rate=learning_rate, warmup_steps=min(50, steps // 10), weight_decay=0.1)
    optimizer, schedule = make_optimizer(optim, steps)
    graphdef, state = init_state(config, optimizer, seed, make_mesh(1))
    step_fn = jax.jit(make_train_step(graphdef, optimizer, schedule), donate_argnums=0)
    iterator = train_iterator(train_source, batch_size, seed=seed)
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = {k: jnp.asarray(v) for k, v in next(iterator).items()}
        state, metrics = step_fn(state, batch)
        if step % log_every == 0 or step == steps:
            loss = float(metrics["loss"])
            losses.append((step, loss))
            log(f"  step {step}: loss {loss:.4f}")
    train_seconds = time.perf_counter() - start
    predict = make_predict(graphdef)
    accuracy = {}
    for name, batches in eval_sets.items():
        hits = total = 0.0
        for batch in batches:
            pred = np.asarray(predict(state["params"], state["rest"], jnp.asarray(batch["inputs"])))
            w = batch["weights"]
            hits += float(np.sum((pred == batch["targets"]) * w))
            total += float(np.sum(w))
        accuracy[name] = hits / max(total, 1.0)
    return dict(parameters=count_parameters(config), losses=losses, train_seconds=train_seconds,
                final_loss=losses[-1][1] if losses else float("nan"), accuracy=accuracy)


def fixed_batches(source, batch_size: int, num_batches: int, offset: int = 0) -> list[dict]:
    """The examples [offset, offset + batch_size * num_batches) of a random-access source as numpy batches."""
    batches = []
    for b in range(num_batches):
        rows = [source[offset + b * batch_size + i] for i in range(batch_size)]
        batches.append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    return batches


def write_json(path: str, record: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def run_header() -> dict:
    device = jax.devices()[0]
    return dict(date=time.strftime("%Y-%m-%d"), device=f"{device.platform} ({device.device_kind})",
                jax=jax.__version__)


def save_figure(fig, path: str):
    """Lays out, writes (creating the folder) and closes a pyplot figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_runs(paths) -> list[dict]:
    """The "runs" records of several result files (e.g. one per seed), concatenated."""
    records = []
    for path in paths:
        with open(path) as f:
            records.extend(json.load(f)["runs"])
    return records
