"""The cases of tests/sharding/test_multiprocess.py, shared with its worker processes."""

from __future__ import annotations

import jax.numpy as jnp

from grpo_kernels.config import CLASSIC_LOSS_TYPES
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.ops.logits_loss.inputs import random_inputs

B, T, V = 4, 6, 64            # logits op: 16 columns per device at tp=4
HT, HH, HV = 5, 32, 256       # LM-head op (B as above)

# Every loss type at token and sequence level (VESPO with the token-level sampler correction it
# needs, CISPO with a cap that acts), beta on for half of them.
_EXTRA = {"cispo": {"epsilon_high": 1.05}, "vespo": {
    "sampler_correction": "token_truncate", "sampler_correction_max": 1.05}}
CASES = [dict(loss_type=lt, importance_sampling_level=level, beta=(0.0, 0.04)[i % 2],
              max_completion_length=T + 2, **_EXTRA.get(lt, {}))
         for i, (lt, level) in enumerate(
             (lt, level) for lt in (*CLASSIC_LOSS_TYPES, "cispo", "sapo", "vespo", "luspo")
             for level in ("token", "sequence"))]


def logits_inputs(i, cfg):
    return random_inputs(100 + i, B, T, V, jnp.float32, cfg, noise=0.3)


def head_inputs(i, cfg):
    return random_head_inputs(200 + i, B, HT, HH, HV, jnp.float32, cfg)
