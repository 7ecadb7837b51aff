"""The optimiser, the train step and the evaluation step, as pure functions of a state dict.

State: {"step": int32, "params": pure dict of float32 parameters, "rest": the model's other variables,
"opt_state": the optax state}. The model runs in its own compute dtype (bfloat16 by default); logits come back
float32 and the loss is computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from deltajax.train.config import OptimConfig


def learning_rate_schedule(config: OptimConfig, total_steps: int):
    """Linear warmup from 0 to the peak over `warmup_steps`, then cosine decay to `min_lr_ratio * peak`."""
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=config.learning_rate * config.min_lr_ratio)


def make_optimizer(config: OptimConfig, total_steps: int):
    """Clip by global norm, then AdamW (decay on matrices only). Returns (optimizer, schedule)."""
    schedule = learning_rate_schedule(config, total_steps)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.grad_clip) if config.grad_clip > 0 else optax.identity(),
        optax.adamw(schedule, b1=config.beta1, b2=config.beta2, eps=config.eps, weight_decay=config.weight_decay,
                    mask=decay_mask))
    return optimizer, schedule


def cross_entropy_sums(logits, targets, weights):
    """(sum_t w_t * -log p(target_t), sum_t w_t) in float32."""
    logits = logits.astype(jnp.float32)
    log_normaliser = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    return jnp.sum((log_normaliser - target_logits) * weights), jnp.sum(weights)


def loss_sums(graphdef, params, rest, batch):
    """Forward pass of the model on one batch: (summed token loss, scored-token count)."""
    model = nnx.merge(graphdef, params, rest)
    logits = model(batch["inputs"], segment_ids=batch["segment_ids"])
    return cross_entropy_sums(logits, batch["targets"], batch["weights"])


def _all_finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_train_step(graphdef, optimizer, schedule, grad_accum_steps: int = 1):
    """step(state, batch) -> (state, metrics). Gradients of the mean token loss over the whole batch (micro-batches
    are summed before dividing by the global token count, so accumulation does not change the objective).

    A step whose loss, gradients or new parameters are not finite leaves the parameters and optimiser state
    unchanged and reports `finite = False`; the loop stops on it, so the state never holds NaN or Inf.
    """

    def gradients(params, rest, batch):
        (total, count), grads = jax.value_and_grad(
            lambda p: loss_sums(graphdef, p, rest, batch), has_aux=True)(params)
        return total, count, grads

    def step(state, batch):
        params, rest = state["params"], state["rest"]
        if grad_accum_steps == 1:
            total, count, grads = gradients(params, rest, batch)
        else:
            # Micro-batch a takes rows a, a + A, a + 2A, ...: each device keeps its rows under data parallelism.
            micro = jax.tree.map(
                lambda x: jnp.swapaxes(x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps,
                                                 *x.shape[1:]), 0, 1), batch)

            def accumulate(carry, micro_batch):
                total, count, grads = gradients(params, rest, micro_batch)
                return jax.tree.map(jnp.add, carry, (total, count, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                     jax.tree.map(jnp.zeros_like, params))
            (total, count, grads), _ = jax.lax.scan(accumulate, zeros, micro)
        count = jnp.maximum(count, 1.0)
        loss = total / count
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(new_params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = dict(step=state["step"] + 1, params=keep(new_params, params), rest=rest,
                         opt_state=keep(opt_state, state["opt_state"]))
        metrics = dict(loss=loss, grad_norm=grad_norm, learning_rate=schedule(state["step"]), tokens=count,
                       finite=finite)
        return new_state, metrics

    return step


def make_eval_step(graphdef):
    """eval_step(params, rest, batch) -> (summed token loss, scored-token count)."""
    return lambda params, rest, batch: loss_sums(graphdef, params, rest, batch)
