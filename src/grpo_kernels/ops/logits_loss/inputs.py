"""Seeded random inputs for gradcheck, bench and tests: never zeros, off-policy like a real step."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.core.inputs import (normal, randint, sampler_logps_near, uniform,
                                          wants_sampler_logps)
from grpo_kernels.ops.core.reference import token_logp_and_entropy

@dataclasses.dataclass(frozen=True)
class LossInputs:
    """Arguments of :func:`grpo_kernels.grpo_loss` besides ``config`` and ``impl``."""

    logits: jax.Array
    ids: jax.Array
    mask: jax.Array
    advantages: jax.Array
    old_logps: jax.Array | None
    ref_logps: jax.Array | None
    sampler_weights: jax.Array | None = None
    sampler_logps: jax.Array | None = None

    def kwargs(self) -> dict[str, Any]:
        """The optional per-token arguments (``sampler_weights`` and ``sampler_logps`` only
        when present)."""
        out = {"old_logps": self.old_logps, "ref_logps": self.ref_logps}
        for name in ("sampler_weights", "sampler_logps"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def random_inputs(
    seed: int,
    batch: int,
    time: int,
    vocab: int,
    dtype: Any,
    config: GRPOLossConfig,
    *,
    noise: float = 0.1,
    logit_scale: float = 2.0,
    on_policy: bool = False,
    sampler_weights: bool = False,
) -> LossInputs:
    """Random GRPO inputs shaped like one training step.

    Logits ~ ``N(0, logit_scale^2)``; ids uniform in ``[0, V)``; each row's mask is a prefix of
    random length in ``[1, T]`` (right padding, as completions have); advantages ~ ``N(0, 1)``;
    ``old_logps`` and ``ref_logps`` are the reference log-probs plus ``N(0, noise^2)`` (a real
    off-policy step), ``old_logps`` omitted when ``on_policy``. With ``sampler_weights``,
    per-token weights uniform in ``[0.2, 2)`` (truncated importance weights of a sampler).
    ``sampler_logps`` (when :func:`wants_sampler_logps`): the old log-probs (or the
    reference's, on-policy) plus ``N(0, noise^2)``.
    """
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    logits = (normal(keys[0], (batch, time, vocab), jnp.float32) * logit_scale)
    logits = logits.astype(dtype)
    ids = randint(keys[1], (batch, time), 0, vocab, dtype=jnp.int32)
    lengths = randint(keys[2], (batch, 1), 1, time + 1)
    mask = (jnp.arange(time)[None, :] < lengths).astype(jnp.float32)
    advantages = normal(keys[3], (batch,), jnp.float32)
    logp, _ = token_logp_and_entropy(logits, ids, config.temperature)
    old = None if on_policy else logp + noise * normal(keys[4], logp.shape)
    ref = logp + noise * normal(keys[5], logp.shape)
    weights = (uniform(jax.random.fold_in(keys[0], 7), logp.shape, jnp.float32, 0.2, 2.0)
               if sampler_weights else None)
    sampler = (sampler_logps_near(jax.random.fold_in(keys[0], 11),
                                  logp if old is None else old, noise)
               if wants_sampler_logps(config) else None)
    return LossInputs(logits, ids, mask, advantages, old, ref, weights, sampler)


def to_numpy(x: jax.Array | None) -> np.ndarray | None:
    return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)
