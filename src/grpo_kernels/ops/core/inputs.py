"""What the random inputs of both ops share (tests, gradcheck and bench build them)."""

from __future__ import annotations

import jax

from grpo_kernels.config import GRPOLossConfig


def wants_sampler_logps(config: GRPOLossConfig) -> bool:
    """Whether random inputs for ``config`` carry sampler log-probs: a sampler correction
    needs them, the off-policy mask reads them when given."""
    return config.needs_sampler_logps or config.off_policy_mask_threshold is not None


def sampler_logps_near(key: jax.Array, logps: jax.Array, noise: float) -> jax.Array:
    """A sampler's log-probs: ``logps`` plus ``N(0, noise^2)`` (vLLM and the trainer disagree
    a little on every token)."""
    return logps + noise * jax.random.normal(key, logps.shape)
