"""Step-size rules (seeds 000 and 003) and the normalised-key reduction that lets them share one delta-rule path.

With an un-normalised key k = |k| k_hat, one delta step S <- S + beta k (v - S^T k)^T equals the step on the unit
key with

    beta_hat = beta |k|^2,   v_hat = v / |k|,   (q unchanged)

so the transition's eigenvalue along k is 1 - beta_hat. Every rule below is written by its beta_hat, which for
all of them stays in [0, 1] (or [0, 2) for relaxed Kaczmarz with rho > 1): well-conditioned chunk inverses.

| rule              | beta on the raw key          | beta_hat = beta |k|^2            |
|-------------------|------------------------------|-----------------------------------|
| kaczmarz          | 1 / |k|^2                    | 1                                 |
| relaxed_kaczmarz  | rho / (|k|^2 + eps)          | rho |k|^2 / (|k|^2 + eps)         |
| longhorn          | gamma / (1 + gamma |k|^2)    | gamma |k|^2 / (1 + gamma |k|^2)   |
| efla              | (1 - exp(-eta |k|^2)) / |k|^2 | 1 - exp(-eta |k|^2)              |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltajax.rules.checks import check_range

# A key whose squared norm is below this takes no step (beta_hat = 0) instead of dividing by ~0.
TINY_SQUARED_NORM = 1e-30


def beta_sigmoid(logits):
    """DeltaNet's write strength: sigmoid(logits) in (0, 1)."""
    return jax.nn.sigmoid(logits)


def beta_negative_eigenvalues(logits):
    """2 sigmoid(logits) in (0, 2): the transition eigenvalue 1 - beta reaches (-1, 1] (state tracking)."""
    return 2.0 * jax.nn.sigmoid(logits)


def _squared_norm(k):
    return jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1)


def _step_hat(rule, squared_norm, param, eps):
    """beta_hat for each rule as a function of |k|^2 (>= 0) and the per-token parameter."""
    if rule == "kaczmarz":
        return jnp.ones_like(squared_norm)
    if rule == "relaxed_kaczmarz":
        return param * squared_norm / (squared_norm + eps)
    if rule == "longhorn":
        return param * squared_norm / (1.0 + param * squared_norm)
    if rule == "efla":
        return -jnp.expm1(-param * squared_norm)
    raise ValueError(f"step rule must be one of {STEP_RULES}, got {rule!r}")


STEP_RULES = ("kaczmarz", "relaxed_kaczmarz", "longhorn", "efla")


def check_step_parameter(rule, param, eps):
    """Range checks: rho in [0, 2] with eps >= 0 (eps > 0 when rho may meet a zero key), gamma >= 0, eta >= 0."""
    if rule == "kaczmarz":
        if param is not None:
            raise ValueError("kaczmarz takes no step parameter (its step is 1 / |k|^2); pass None")
        return
    if param is None:
        raise ValueError(f"{rule} needs its per-token step parameter with shape [B, T, Hv]")
    if rule == "relaxed_kaczmarz":
        check_range("rho", param, 0.0, 2.0)
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
    elif rule == "longhorn":
        check_range("gamma", param, 0.0)
    elif rule == "efla":
        check_range("eta", param, 0.0)


def raw_key_beta(rule, k, param, eps=0.0):
    """The rule's step size on the raw key, beta [B, T, Hv] (0 where |k| is ~0). k: [B, T, Hv, K]."""
    squared_norm = _squared_norm(k)
    nonzero = squared_norm > TINY_SQUARED_NORM
    safe = jnp.where(nonzero, squared_norm, 1.0)
    return jnp.where(nonzero, _step_hat(rule, safe, param, eps) / safe, 0.0)


def normalise_keys(rule, k, v, param, eps=0.0):
    """The reduction: (k_hat [B,T,H,K], v_hat [B,T,Hv,V], beta_hat [B,T,Hv]) for the unit-key delta rule.

    k has H key heads, v and param have Hv = H * group value heads; v_hat divides by the norm of its key head.
    """
    H, Hv = k.shape[2], v.shape[2]
    squared_norm = _squared_norm(k)  # [B, T, H]
    nonzero = squared_norm > TINY_SQUARED_NORM
    inv_norm = jnp.where(nonzero, jax.lax.rsqrt(jnp.where(nonzero, squared_norm, 1.0)), 0.0)
    k_hat = (k.astype(jnp.float32) * inv_norm[..., None]).astype(k.dtype)
    group = Hv // H
    inv_norm_v = jnp.repeat(inv_norm, group, axis=2) if group > 1 else inv_norm
    squared_norm_v = jnp.repeat(squared_norm, group, axis=2) if group > 1 else squared_norm
    v_hat = (v.astype(jnp.float32) * inv_norm_v[..., None]).astype(v.dtype)
    beta_hat = jnp.where(jnp.repeat(nonzero, group, axis=2) if group > 1 else nonzero,
                         _step_hat(rule, squared_norm_v, param, eps), 0.0)
    return k_hat, v_hat, beta_hat


def delta_rule_with_step_size(rule, q, k, v, param, log_decay=None, *, eps=0.0, scale=None, initial_state=None,
                              segment_ids=None, return_final_state=True, impl="auto", chunk_size=64,
                              state_passing="sequential"):
    """The delta rule on raw keys with the step size of `rule`; see the table in the module docstring.

    `impl="scan"` runs the raw-key recurrence directly (the oracle); every other implementation runs the
    normalised-key reduction.
    """
    from deltajax.rules.delta_rule import delta_rule  # late: delta_rule's module imports the dispatch

    if rule not in STEP_RULES:
        raise ValueError(f"rule must be one of {STEP_RULES}, got {rule!r}")
    if getattr(k, "ndim", None) != 4 or getattr(v, "ndim", None) != 4:
        raise ValueError(f"k and v must be 4-D [B, T, heads, dim], got {getattr(k, 'shape', None)} and "
                         f"{getattr(v, 'shape', None)}")
    B, T, H, _ = k.shape
    Hv = v.shape[2]
    if v.shape[:2] != (B, T) or Hv % max(H, 1):
        raise ValueError(f"v must have shape [B, T, Hv, V] with B, T = {(B, T)} and Hv a multiple of {H}, "
                         f"got {v.shape}")
    check_step_parameter(rule, param, eps)
    if param is not None and tuple(param.shape) != (B, T, Hv):
        raise ValueError(f"the step parameter of {rule} must have shape [B, T, Hv] = {(B, T, Hv)}, "
                         f"got {tuple(param.shape)}")
    if param is not None:
        param = param.astype(jnp.float32)
    kwargs = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                  return_final_state=return_final_state, impl=impl, chunk_size=chunk_size,
                  state_passing=state_passing)
    if scale is None:
        kwargs["scale"] = k.shape[-1] ** -0.5
    if impl == "scan":
        k_rep = jnp.repeat(k, Hv // H, axis=2) if Hv != H else k
        beta = raw_key_beta(rule, k_rep, param, eps)
        return _raw_key_delta_rule(delta_rule, q, k, v, beta, log_decay, kwargs)
    k_hat, v_hat, beta_hat = normalise_keys(rule, k, v, param, eps)
    return delta_rule(q, k_hat, v_hat, beta_hat, log_decay, **kwargs)


def _raw_key_delta_rule(delta_rule, q, k, v, beta, log_decay, kwargs):
    # beta on raw keys may exceed 2 (e.g. 1 / |k|^2 for short keys); the range check of the unit-key rule does
    # not apply, so call the reference implementation directly after the shared checks on everything else.
    from deltajax.rules import dispatch
    from deltajax.rules.checks import check_rule_inputs

    scale, initial_state, segment_ids = check_rule_inputs(
        q, k, v, None, log_decay, initial_state=kwargs["initial_state"], segment_ids=kwargs["segment_ids"],
        chunk_size=kwargs["chunk_size"], state_passing=kwargs["state_passing"], scale=kwargs["scale"],
        needs_beta=False)
    fn = dispatch.implementations("delta_rule")["scan"].fn
    o, final_state = fn(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                        segment_ids=segment_ids)
    return o, (final_state if kwargs["return_final_state"] else None)
