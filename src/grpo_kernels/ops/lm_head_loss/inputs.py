"""Seeded random inputs of the fused LM-head loss for bench and tests: never zeros."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.core.inputs import normal, randint, sampler_logps_near, wants_sampler_logps


@dataclasses.dataclass(frozen=True)
class HeadInputs:
    hidden: jax.Array
    lm_head: jax.Array
    ids: jax.Array
    mask: jax.Array
    advantages: jax.Array
    old_logps: jax.Array
    ref_logps: jax.Array
    sampler_logps: jax.Array | None = None

    def kwargs(self) -> dict[str, Any]:
        """``old_logps``, ``ref_logps`` and, when present, ``sampler_logps``."""
        out = {"old_logps": self.old_logps, "ref_logps": self.ref_logps}
        if self.sampler_logps is not None:
            out["sampler_logps"] = self.sampler_logps
        return out


def random_head_inputs(seed: int, batch: int, time: int, hidden: int, vocab: int, dtype: Any,
                       config: GRPOLossConfig, *, layout: str = "hv",
                       noise: float = 0.1) -> HeadInputs:
    """Hidden ~ N(0, 1); W ~ N(0, 4/H) (logits of standard deviation about 2); ids uniform;
    right-padded masks of random length; advantages ~ N(0, 1); old/ref log-probs around
    ``-log V`` plus ``N(0, noise^2)`` (an off-policy step); sampler log-probs near the old
    ones when the config wants them (:func:`..core.inputs.wants_sampler_logps`)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 7)
    h = normal(k[0], (batch, time, hidden), jnp.float32).astype(dtype)
    shape = (hidden, vocab) if layout == "hv" else (vocab, hidden)
    w = (normal(k[1], shape, jnp.float32) * (2.0 / hidden ** 0.5)).astype(dtype)
    ids = randint(k[2], (batch, time), 0, vocab, dtype=jnp.int32)
    lengths = randint(k[3], (batch, 1), 1, time + 1)
    mask = (jnp.arange(time)[None, :] < lengths).astype(jnp.float32)
    adv = normal(k[4], (batch,), jnp.float32)
    base = -jnp.log(jnp.float32(vocab)) + noise * normal(k[5], (batch, time))
    ref = base + noise * normal(k[6], (batch, time))
    sampler = (sampler_logps_near(jax.random.fold_in(k[0], 11), base, noise)
               if wants_sampler_logps(config) else None)
    return HeadInputs(h, w, ids, mask, adv, base, ref, sampler)
