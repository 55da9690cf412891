"""The ground truth of both ops' statistics: a materialised float32 ``log_softmax``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_kernels.ops.core.online_softmax import soft_cap
from grpo_kernels.ops.core.truncation import Truncation, outside, support_floor, truncate

Array = jax.Array


def token_logp_and_entropy(logits: Array, ids: Array, temperature: float,
                           softcap: float | None = None) -> tuple[Array, Array]:
    """Chosen-token log-probs and entropies of ``softmax(logits / temperature)`` in float32,
    the logits soft-capped first when ``softcap`` is set (:func:`.online_softmax.soft_cap`).

    Ids outside ``[0, V)`` are clamped into range (see ``docs/loss.md``).
    """
    return _logp_and_entropy(*_scaled(logits, ids, temperature, softcap))


def truncated_token_logps(logits: Array, ids: Array, temperature: float,
                          softcap: float | None, trunc: Truncation | None,
                          by_sorting: bool = True) -> tuple[Array, Array, Array | None]:
    """``(logp, entropy, outside)`` of the sampler's truncated distribution
    (:mod:`.truncation`): the floor of each row found by sorting it whole (``by_sorting``;
    else by :func:`.truncation.support_floor`'s top-k and bisection, no sorted copy), the
    row's entries below it (but the chosen one) at ``-inf``, then
    :func:`token_logp_and_entropy`'s ``log_softmax``; ``outside`` marks the ids below their
    floor. The floor is a constant of the gradient. ``trunc=None``:
    :func:`token_logp_and_entropy` and ``outside`` None."""
    if trunc is None:
        return (*token_logp_and_entropy(logits, ids, temperature, softcap), None)
    scaled, ids = _scaled(logits, ids, temperature, softcap)
    floor = jax.lax.stop_gradient(support_floor(jax.lax.stop_gradient(scaled), trunc,
                                                by_sorting=by_sorting))
    hit = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1) == ids[..., None]
    chosen = jnp.take_along_axis(jax.lax.stop_gradient(scaled), ids[..., None], axis=-1)
    return (*_logp_and_entropy(truncate(scaled, floor, hit), ids), outside(chosen[..., 0], floor))


def _scaled(logits: Array, ids: Array, temperature: float,
            softcap: float | None) -> tuple[Array, Array]:
    """The float32 scaled (soft-capped) logits and the ids clamped into ``[0, V)``."""
    scaled = soft_cap(logits.astype(jnp.float32), softcap) / temperature
    return scaled, jnp.clip(ids.astype(jnp.int32), 0, logits.shape[-1] - 1)


def _logp_and_entropy(scaled: Array, ids: Array) -> tuple[Array, Array]:
    logsm = jax.nn.log_softmax(scaled, axis=-1)
    logp = jnp.take_along_axis(logsm, ids[..., None], axis=-1)[..., 0]
    p = jnp.exp(logsm)
    # Differentiable (the entropy bonus needs its gradient); where p = 0 the log is replaced by
    # 0 before the product, so no 0 * inf enters the backward.
    safe = jnp.where(jax.lax.stop_gradient(p) > 0, logsm, 0.0)
    entropy = -jnp.sum(p * safe, axis=-1)
    return logp, entropy
