"""The training loop: `train(config)` runs (or resumes) one run and returns its final metrics.

Everything it does besides stepping is a function it calls: state creation and restore, the jitted steps,
evaluation at 1x and 2x the training length, logging, checkpoints, the plot.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from deltajax.data import build_data, eval_batches, train_iterator
from deltajax.nn import LanguageModel, flops_per_token
from deltajax.rules.sequence_parallel import use_sequence_parallel
from deltajax.train import parallel
from deltajax.train.checkpoint import Checkpointer, abstract_like
from deltajax.train.config import TrainConfig
from deltajax.train.metrics import MetricsLog, ProgressBar, loss_metrics, peak_flops_per_device, plot_curves, \
    read_records
from deltajax.train.step import make_eval_step, make_optimizer, make_train_step


class NonFiniteLossError(FloatingPointError):
    """The loss (or the gradients, or the updated parameters) stopped being finite."""


def init_state(model_config, optimizer, seed: int, mesh):
    """(graphdef, state) with parameters initialised from `seed`, replicated over `mesh`."""
    make_model = lambda: LanguageModel(model_config, rngs=nnx.Rngs(seed))
    graphdef = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)[0]

    def create():
        _, params, rest = nnx.split(make_model(), nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        return dict(step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=optimizer.init(params))

    return graphdef, jax.jit(create, out_shardings=parallel.replicated(mesh))()


def with_mesh(fn, mesh):
    """Traces `fn` with the sequence axis of `mesh` active, so delta-rule layers shard time over it."""
    if mesh.shape[parallel.SEQ] == 1:
        return fn

    def traced(*args):
        with use_sequence_parallel(mesh, parallel.SEQ, batch_axis=parallel.DATA):
            return fn(*args)

    return traced


def evaluate(eval_step, state, eval_sets, sharding, is_bytes) -> dict:
    """Mean token loss (and perplexity, bits per byte) over the fixed evaluation batches of every length."""
    out = {}
    for multiple, batches in eval_sets.items():
        total = count = 0.0
        for local in batches:
            rows = local["inputs"].shape[0] * jax.process_count()
            t, c = eval_step(state["params"], state["rest"], parallel.global_batch(local, sharding, rows))
            total, count = total + float(t), count + float(c)
        for name, value in loss_metrics(total / max(count, 1.0), is_bytes).items():
            out[f"eval_{name}@{multiple}x"] = value
    return out


def train(config: TrainConfig, *, data=None, stop_after: Optional[int] = None,
          time_budget_s: Optional[float] = None, log: Callable[[str], None] = print) -> dict:
    """Trains `config` (resuming from its run directory if it holds checkpoints); returns the last metrics.

    `data` overrides the sources built from `config.data`; `stop_after` ends the run after that step (saving a
    checkpoint), as a preemption would. `time_budget_s` (wall seconds from the call) ends the run after the first
    step that finishes past it, evaluating and saving there (the learning-rate schedule still runs to
    `config.steps`); the returned metrics then hold `stopped_early: True`.
    """
    called = time.perf_counter()
    config.validate()
    main = jax.process_index() == 0
    say = log if main else (lambda *_: None)
    mesh = parallel.make_mesh(config.sequence_parallel)
    parallel.check_batch(mesh, config.batch_size, config.seq_len, config.grad_accum_steps)
    data = data or build_data(config.data, config.seq_len, config.eval_multiples)
    if config.model.vocab_size < data.vocab_size:
        raise ValueError(f"the model's vocab_size ({config.model.vocab_size}) is smaller than the data's "
                         f"({data.vocab_size})")
    optimizer, schedule = make_optimizer(config.optim, config.steps)
    graphdef, state = init_state(config.model, optimizer, config.seed, mesh)

    checkpoints = Checkpointer(os.path.join(config.run_dir, "checkpoints"), every=config.checkpoint_every,
                               keep=config.keep_checkpoints, asynchronous=config.async_checkpoints)
    start, data_state = 0, None
    if checkpoints.latest_step() is not None:
        start = int(checkpoints.latest_step())
        try:
            state, data_state = checkpoints.restore(start, abstract_like(state), config.identity())
        except Exception:
            checkpoints.close()  # leave no orbax background thread behind the error
            raise
        say(f"resumed from {checkpoints.directory}/{start}")
    iterator = train_iterator(data.train, config.batch_size, seed=config.seed, process_index=jax.process_index(),
                              process_count=jax.process_count(), state=data_state and data_state["iterator"])
    eval_sets = {m: eval_batches(data.validation[m], config.batch_size, config.eval_batches,
                                 process_index=jax.process_index(), process_count=jax.process_count())
                 for m in config.eval_multiples}

    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    train_step = jax.jit(with_mesh(make_train_step(graphdef, optimizer, schedule, config.grad_accum_steps), mesh),
                         donate_argnums=0, out_shardings=(state_sharding, parallel.replicated(mesh)))
    eval_step = jax.jit(with_mesh(make_eval_step(graphdef), mesh))
    batch_sharding = parallel.batch_sharding(mesh)
    metrics_log = MetricsLog(os.path.join(config.run_dir, "metrics.jsonl"), resume_step=start, enabled=main)
    end = config.steps if stop_after is None else min(stop_after, config.steps)
    tokens_per_step = config.batch_size * config.seq_len
    flops_per_step = flops_per_token(config.model, config.seq_len) * tokens_per_step
    peak = config.peak_flops or peak_flops_per_device(jax.devices()[0].device_kind)
    say(f"{data.description}\nmesh {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} "
        f"device(s), {jax.process_count()} process(es); steps {start} -> {end}")

    def identity_and_config():
        return config.identity(), config.to_dict()

    def save(step):
        checkpoints.save(step, state, {"iterator": iterator.get_state()}, *identity_and_config())

    clock = {"time": time.perf_counter(), "step": start}
    last_saved = checkpoints.latest_step()
    summary = {}

    def record(step, metrics):
        """Fetches the metrics of `step` (waiting for it only), checks them, logs them."""
        nonlocal summary
        m = jax.device_get(metrics)
        if not bool(m["finite"]):
            checkpoints.wait()
            raise NonFiniteLossError(
                f"step {step}: the loss became {float(m['loss'])} (gradient norm {float(m['grad_norm'])}); "
                f"stopped. The parameters were not updated by this step; the last good checkpoint is step "
                f"{last_saved} in {checkpoints.directory}. Lower --learning_rate or raise --warmup_steps and "
                f"resume.")
        summary = dict(step=step, **loss_metrics(float(m["loss"]), data.is_bytes))
        if step % config.log_every == 0 or step == end:
            now = time.perf_counter()
            rate = (step - clock["step"]) * tokens_per_step / max(now - clock["time"], 1e-9)
            clock.update(time=now, step=step)
            summary.update(grad_norm=float(m["grad_norm"]), learning_rate=float(m["learning_rate"]),
                           tokens_per_s=rate, mfu=(rate / tokens_per_step * flops_per_step / (peak * jax.device_count())
                                                   if peak else None))
            metrics_log.write(dict(kind="train", **summary))
        bar.update(step, f"loss {summary['loss']:.4f}")

    bar = ProgressBar(end, start, enabled=main and config.progress_bar, every=config.log_every)
    pending = None
    out_of_time = False
    for step in range(start + 1, end + 1):
        local = next(iterator)
        state, metrics = train_step(state, parallel.global_batch(local, batch_sharding, config.batch_size))
        if pending is not None:
            record(*pending)  # the previous step, while this one runs
        pending = (step, metrics)
        if time_budget_s is not None and step < end:
            out_of_time = time.perf_counter() - called >= time_budget_s
            if jax.process_count() > 1:  # every process stops at the same step: process 0's clock decides
                out_of_time = step % config.log_every == 0 and bool(
                    multihost_utils.broadcast_one_to_all(np.asarray(out_of_time)))
            if out_of_time:
                end = step
        eval_now = (step == config.steps or (config.eval_every and step % config.eval_every == 0)
                    or out_of_time)
        save_now = step == end or checkpoints.should_save(step)
        if eval_now or save_now:
            record(*pending)
            pending = None
        if save_now:
            save(step)
            last_saved = step
        if eval_now:
            results = evaluate(eval_step, state, eval_sets, batch_sharding, data.is_bytes)
            metrics_log.write(dict(kind="eval", step=step, **results))
            summary.update(results)
            bar.close()
            say(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
            clock.update(time=time.perf_counter(), step=step)
        if out_of_time:
            say(f"time budget of {time_budget_s:.0f} s spent: stopped at step {step} of {config.steps}")
            summary["stopped_early"] = True
            break
    bar.close()
    checkpoints.close()
    if start >= end and main:
        say(f"nothing to do: the run in {config.run_dir} is already at step {start}")
    if (end == config.steps or out_of_time) and main:
        records = read_records(metrics_log.path)
        plot_curves(records, os.path.join(config.run_dir, "loss.png"),
                    title=f"{config.model.layer_pattern} x{config.model.n_layers}, d={config.model.d_model}, "
                          f"T={config.seq_len}")
    summary["step"] = max(end, start)
    return summary
