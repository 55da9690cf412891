"""The ground truth of both ops' statistics: a materialised float32 ``log_softmax``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def token_logp_and_entropy(logits: Array, ids: Array, temperature: float) -> tuple[Array, Array]:
    """Chosen-token log-probs and entropies of ``softmax(logits / temperature)`` in float32.

    Ids outside ``[0, V)`` are clamped into range (see ``docs/loss.md``).
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / temperature
    logsm = jax.nn.log_softmax(scaled, axis=-1)
    ids = jnp.clip(ids.astype(jnp.int32), 0, vocab - 1)
    logp = jnp.take_along_axis(logsm, ids[..., None], axis=-1)[..., 0]
    p = jnp.exp(logsm)
    # Differentiable (the entropy bonus needs its gradient); where p = 0 the log is replaced by
    # 0 before the product, so no 0 * inf enters the backward.
    safe = jnp.where(jax.lax.stop_gradient(p) > 0, logsm, 0.0)
    entropy = -jnp.sum(p * safe, axis=-1)
    return logp, entropy
