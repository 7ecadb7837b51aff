"""Shared by the synthetic-task entry points (state_tracking.py, mqar.py): build a small model, train it with the
trainer's optimiser and step on a grain source, and score accuracy on the weighted positions of held-out batches.

Accuracy needs argmax predictions, which `deltajax.train.train` does not report (it evaluates loss only), so these
runs drive `make_train_step` directly instead of calling `train`.

Wall-clock budgets (`--time_budget_s` of the scripts): a run given `time_budget_s` measures its step time after
compiling and fits the length of its learning-rate schedule (warm-up, then cosine decay) to the steps that fit its
budget, at most `steps`; the schedule's horizon lives in the optimiser state, so refitting does not recompile. A
run that still reaches its deadline stops there. Either way it is evaluated and reported (`steps` done,
`stopped_early`). `RunBudget` splits a script's budget over its runs.

Compilation (`--train_seconds`): the evaluation function is compiled for every eval shape before training, and a
run given `train_seconds` starts that training clock only after its first (compiling) step, so runs whose
compilation takes different times (one process per run on a shared GPU) train for the same wall time. The
run's whole `time_budget_s`, counted from the call, stays a hard limit: a compilation that eats into it shortens
the training, it never pushes the run past its budget.

Data workers (`--data_workers`): the synthetic examples are built in Python (0.1-0.6 ms each), slower than a GPU
trains these models; `start_data_workers(n)` forks n processes (before JAX starts a backend) that build the same
batches as `deltajax.data.train_iterator` in parallel.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deltajax.data import train_iterator
from deltajax.nn import PRESETS, ModelConfig, count_parameters
from deltajax.data.synthetic import NUM_EXAMPLES
from deltajax.rules import dispatch
from deltajax.train import OptimConfig, init_state, make_train_step
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
                 chunk_size: int = 64, compute_dtype: str = "float32") -> ModelConfig:
    """Two heads of width d_model / 2 (keys and values), float32 compute by default, SwiGLU x4."""
    letter, step_rule = VARIANTS[variant]
    head = max(d_model // 2, 8)
    return PRESETS["tiny-hybrid"].replace(
        vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, layer_pattern=letter, step_rule=step_rule,
        n_heads=2, head_dim=head, n_value_heads=2, value_head_dim=head, compute_dtype=compute_dtype, impl=impl,
        chunk_size=chunk_size).validate()


def rule_impl(config: ModelConfig, batch: int, seq_len: int) -> str:
    """The implementation the dispatch picks for the recurrent layers of `config` on this backend (for the record:
    "pallas" is the GPU kernel, "chunk" the XLA chunked form)."""
    letter = config.layer_types[0]
    if config.impl != "auto":
        return config.impl
    call = dispatch.RuleCall(
        op="linear_attention" if letter == "L" else "delta_rule", batch=batch, seq_len=seq_len,
        key_heads=config.n_heads, value_heads=config.value_heads, key_dim=config.head_dim,
        value_dim=config.value_dim, dtype=config.compute_dtype,
        decay={"G": "scalar", "K": "channel"}.get(letter, "none"), has_initial_state=False, has_segment_ids=True,
        chunk_size=config.chunk_size, platform=jax.default_backend())
    try:
        return dispatch.select(call.op, "auto", call).name
    except Exception as error:  # the record only; training resolves it again at trace time
        return f"unknown ({error})"


class FittedSchedule(NamedTuple):
    """State of `scale_by_fitted_schedule`: its own step count and the schedule's horizon (total steps)."""

    count: jax.Array  # int32
    horizon: jax.Array  # float32


def fitted_learning_rate(count, horizon, *, peak: float, warmup: int, end: float):
    """`deltajax.train.learning_rate_schedule` (linear warm-up from 0 over `warmup` steps, then cosine decay to
    `end` at step `horizon`) with the horizon a traced value."""
    c = jnp.asarray(count, jnp.float32)
    warm = peak * c / max(warmup, 1)
    fraction = jnp.clip((c - warmup) / jnp.maximum(horizon - warmup, 1.0), 0.0, 1.0)
    cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * fraction))
    return jnp.where(c < warmup, warm, cosine)


def scale_by_fitted_schedule(peak: float, warmup: int, end: float, horizon: int) -> optax.GradientTransformation:
    def init(params):
        del params
        return FittedSchedule(jnp.zeros((), jnp.int32), jnp.asarray(horizon, jnp.float32))

    def update(updates, state, params=None):
        del params
        lr = fitted_learning_rate(state.count, state.horizon, peak=peak, warmup=warmup, end=end)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return updates, FittedSchedule(optax.safe_increment(state.count), state.horizon)

    return optax.GradientTransformation(init, update)


def make_fitted_optimizer(config: OptimConfig, total_steps: int):
    """`deltajax.train.make_optimizer` (global-norm clipping, AdamW with decay on matrices only, warm-up + cosine)
    whose schedule length can be changed after compiling (`set_horizon`). Returns (optimizer, schedule at the
    initial horizon)."""
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    peak, end = config.learning_rate, config.learning_rate * config.min_lr_ratio
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.grad_clip) if config.grad_clip > 0 else optax.identity(),
        optax.scale_by_adam(b1=config.beta1, b2=config.beta2, eps=config.eps),
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        scale_by_fitted_schedule(peak, warmup, end, max(total_steps, warmup + 1)))
    schedule = lambda count: fitted_learning_rate(count, max(total_steps, warmup + 1), peak=peak, warmup=warmup,
                                                  end=end)
    return optimizer, schedule


def set_horizon(state: dict, horizon: int) -> dict:
    """The train state with the schedule of `make_fitted_optimizer` ending at step `horizon` (same sharding)."""
    *rest, fitted = state["opt_state"]
    value = jax.device_put(jnp.asarray(horizon, jnp.float32), fitted.horizon.sharding)
    return dict(state, opt_state=(*rest, fitted._replace(horizon=value)))


# Data workers: forked once per process, before JAX initialises a backend (fork is unsafe after that).
_POOL = None
_WORKERS = 0
# Seconds to wait for one batch from the workers before giving up with an error: a batch takes milliseconds, so
# only a dead or stuck worker gets near it. `concurrent.futures` (not `multiprocessing.Pool`, which waits forever
# on the task of a worker that died) turns a dead worker into `BrokenProcessPool` at once.
BATCH_TIMEOUT_S = 60.0


def start_data_workers(n: int):
    """Forks `n` processes that build training batches (`batch_stream`); call before anything touches a device."""
    global _POOL, _WORKERS
    if n > 0 and _POOL is None:
        import concurrent.futures
        import multiprocessing

        _POOL = concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
        # With "fork" the executor forks all n workers at its first task, before it starts its manager thread;
        # this task makes that happen now, while the process has no backend threads.
        _POOL.submit(os.getpid).result(timeout=BATCH_TIMEOUT_S)
        _WORKERS = n
    return _POOL


def stop_data_workers():
    """Ends the workers, killing any that is stuck (the executor's own shutdown, also at exit, would wait for it)."""
    global _POOL, _WORKERS
    if _POOL is not None:
        processes = list(_POOL._processes.values())
        _POOL.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()
            process.join()
        _POOL, _WORKERS = None, 0


def _make_batch(source, start: int, size: int) -> dict:
    rows = [source[start + i] for i in range(size)]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def batch_stream(source, batch_size: int, *, seed: int, prefetch: int | None = None):
    """The batches of `deltajax.data.train_iterator(source, batch_size, seed=seed)`, built by the data workers when
    they are started (batch s holds examples [s B, (s + 1) B) of an unshuffled synthetic source); endless."""
    if _POOL is None or len(source) < NUM_EXAMPLES:  # shuffled sources: grain's order
        yield from train_iterator(source, batch_size, seed=seed)
        return
    window = collections.deque()
    ahead = prefetch or 2 * _WORKERS
    s = 0
    while True:
        while len(window) < ahead:
            window.append(_POOL.submit(_make_batch, source, s * batch_size, batch_size))
            s += 1
        try:
            yield window.popleft().result(timeout=BATCH_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"the data workers gave no batch in {BATCH_TIMEOUT_S:.0f} s (a stuck worker); run "
                               f"with --data_workers=0 to build batches in this process") from None


class RunBudget:
    """Splits a wall-clock budget (seconds from construction) evenly over the runs still to come."""

    def __init__(self, seconds: float | None, runs: int):
        self.seconds, self.runs_left, self.start = seconds, runs, time.perf_counter()
        self.eval_seconds = None  # measured on the first run

    def next_share(self) -> float | None:
        """Seconds for the next run: what is left divided by the runs left (None: no budget)."""
        if self.seconds is None:
            return None
        left = self.seconds - (time.perf_counter() - self.start)
        share = left / max(self.runs_left, 1)
        self.runs_left -= 1
        return max(share, 0.0)

    def eval_reserve(self, share: float) -> float:
        """Seconds kept back from a run's share for its evaluation."""
        measured = 1.5 * self.eval_seconds if self.eval_seconds is not None else 0.0
        return min(max(0.1 * share, measured), 0.5 * share)


def train_in_budget(label: str, config: ModelConfig, train_source, eval_sets: dict, budget: RunBudget,
                    **train_kwargs) -> dict:
    """One run of a script: prints its label, parameter count and share of the script's budget, then
    `train_and_score` within that share (keeping back the evaluation's reserve); records the evaluation time."""
    share = budget.next_share()
    print(f"{label}: {count_parameters(config):,} parameters" + (f", {share:.0f} s budget" if share is not None else ""),
          flush=True)
    result = train_and_score(config, train_source, eval_sets, time_budget_s=share,
                             eval_reserve_s=budget.eval_reserve(share) if share else 0.0, **train_kwargs)
    budget.eval_seconds = result["eval_seconds"]
    return result


def write_runs(path: str | None, base: dict, records: list, started: float, *, complete: bool = False):
    """Writes a script's record (`base`: header, settings, ...) with its runs so far to `path` (if any); scripts
    call it after every run, so that one cut short keeps what it finished."""
    if path:
        write_json(path, dict(base, complete=complete, seconds=time.perf_counter() - started, runs=records))


def finish_runs(records: list, base: dict, started: float, *, out: str | None, plot_path: str | None, print_table,
                plot_fn):
    """The end of a script: its table, total time, complete record and plot."""
    print_table(records)
    print(f"\ntotal {time.perf_counter() - started:.0f} s on {base['device']}")
    write_runs(out, base, records, started, complete=True)
    if plot_path:
        try_plot(plot_fn, records, plot_path)


def make_predict(graphdef):
    @jax.jit
    def predict(params, rest, inputs):
        model = nnx.merge(graphdef, params, rest)
        return jnp.argmax(model(inputs), axis=-1)

    return predict


def train_and_score(config: ModelConfig, train_source, eval_sets: dict, *, steps: int, batch_size: int,
                    learning_rate: float, seed: int = 0, log_every: int = 50, log=print,
                    time_budget_s: float | None = None, eval_reserve_s: float = 0.0,
                    train_seconds: float | None = None) -> dict:
    """Trains `config` on `train_source` and returns losses, timings and {name: accuracy} for every eval set.

    eval_sets: {name: list of batches (dicts of numpy arrays with inputs, targets, weights)}; accuracy is the
    fraction of weighted positions whose argmax prediction equals the target.

    time_budget_s: wall seconds for this run from the call, compilation and evaluation included; training gets
    `time_budget_s - eval_reserve_s`. The schedule is fitted to the steps that fit (at most `steps`; see the
    module docstring) and training stops at the deadline in any case. None: exactly `steps` steps.

    train_seconds: training wall seconds counted from the end of the first (compiling) step, capped by
    `time_budget_s`; None: the deadline is the budget's.
    """
    called = time.perf_counter()
    optim = OptimConfig(learning_rate=learning_rate, warmup_steps=min(50, steps // 10), weight_decay=0.1)
    optimizer, schedule = make_fitted_optimizer(optim, steps)
    graphdef, state = init_state(config, optimizer, seed, make_mesh(1))
    step_fn = jax.jit(make_train_step(graphdef, optimizer, schedule), donate_argnums=0)
    # Evaluation compiles once per eval shape; doing it now keeps that time out of the training clock and out of
    # the evaluation reserve (at the end of a budgeted run there may be no time left to compile).
    compile_start = time.perf_counter()
    predict = make_predict(graphdef)
    compiled_predict = {}
    for batches in eval_sets.values():
        for batch in batches:
            shape = batch["inputs"].shape
            if shape not in compiled_predict:
                inputs = jax.ShapeDtypeStruct(shape, jnp.int32)
                compiled_predict[shape] = predict.lower(state["params"], state["rest"], inputs).compile()
    eval_compile_seconds = time.perf_counter() - compile_start
    iterator = batch_stream(train_source, batch_size, seed=seed)
    hard_deadline = None if time_budget_s is None else called + max(time_budget_s - eval_reserve_s, 0.0)
    if hard_deadline is None and train_seconds is not None:
        hard_deadline = math.inf
    deadline = hard_deadline
    window_start = called  # the training clock: the call, or the end of the first step with train_seconds
    horizon, refits = steps, []
    # Step 1 compiles; the horizon is fitted to the step time measured since then at step 11 and again once a
    # quarter and half of the training window have passed (after that the cosine decays undisturbed to its end).
    fit_fractions = [0.25, 0.5]
    last = None  # (step, time) of the last measurement
    losses = []
    start = time.perf_counter()
    step, train_len = 0, 0
    stopped_early = False
    first_step_seconds = None
    while step < horizon:
        step += 1
        batch = {k: jnp.asarray(v) for k, v in next(iterator).items()}
        train_len = batch["inputs"].shape[1]
        state, metrics = step_fn(state, batch)
        if step == 1:
            jax.block_until_ready(metrics)
            first_step_seconds = time.perf_counter() - start
            if deadline is not None and train_seconds is not None:
                window_start = time.perf_counter()
                deadline = min(hard_deadline, window_start + train_seconds)
        if step % log_every == 0 or step == horizon:
            loss = float(metrics["loss"])
            losses.append((step, loss))
            log(f"  step {step}: loss {loss:.4f}")
        if deadline is None:
            continue
        now = time.perf_counter()
        window = max(deadline - window_start, 1e-9)
        if step in (1, 11) or (fit_fractions and now - window_start >= fit_fractions[0] * window):
            jax.block_until_ready(metrics)
            now = time.perf_counter()
            if last is not None:
                per_step = (now - last[1]) / (step - last[0])
                fitted = max(min(step + int(0.95 * (deadline - now) / per_step), steps), step + 1)
                if fitted != horizon:
                    horizon = fitted
                    state = set_horizon(state, horizon)
                refits.append(dict(step=step, seconds_per_step=per_step, horizon=horizon))
            while fit_fractions and now - window_start >= fit_fractions[0] * window:
                fit_fractions.pop(0)
            last = (step, now)
        if now >= deadline and step < horizon:
            stopped_early = True
            loss = float(metrics["loss"])
            if not losses or losses[-1][0] != step:
                losses.append((step, loss))
            log(f"  step {step}: loss {loss:.4f} (time budget spent, stopping before step {horizon})")
            break
    jax.block_until_ready(state)
    train_seconds_done = time.perf_counter() - start
    eval_start = time.perf_counter()
    accuracy = {}
    for name, batches in eval_sets.items():
        hits = total = 0.0
        for batch in batches:
            run = compiled_predict[batch["inputs"].shape]
            pred = np.asarray(run(state["params"], state["rest"], jnp.asarray(batch["inputs"], jnp.int32)))
            w = batch["weights"]
            hits += float(np.sum((pred == batch["targets"]) * w))
            total += float(np.sum(w))
        accuracy[name] = hits / max(total, 1.0)
    return dict(parameters=count_parameters(config), losses=losses, train_seconds=train_seconds_done,
                first_step_seconds=first_step_seconds, eval_compile_seconds=eval_compile_seconds,
                train_window_s=None if deadline is None else deadline - window_start,
                eval_seconds=time.perf_counter() - eval_start, seconds=time.perf_counter() - called,
                final_loss=losses[-1][1] if losses else float("nan"), accuracy=accuracy, steps=step,
                max_steps=steps, schedule_steps=horizon, stopped_early=stopped_early, budget_s=time_budget_s,
                refits=refits, rule_impl=rule_impl(config, batch_size, train_len))


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


def try_plot(plot_fn, records, path: str):
    """Calls `plot_fn(records, path)` if matplotlib is installed (plots are optional)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no plot {path}")
        return
    plot_fn(records, path)


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


def tabulate(paths, print_table, plot_fn, plot_path: str):
    """The scripts' --tabulate: merge the runs of these result files, print their table, plot them (if a path)."""
    records = load_runs(paths)
    print_table(records)
    if plot_path:
        try_plot(plot_fn, records, plot_path)
