"""Forward-only per-token log-probs (and entropies): on logits, and from hidden states and an
LM head (its weights, or a function forming its logits) without ``[B, T, V]``."""

from grpo_kernels.ops.logps.api import token_logps, token_logps_from_hidden
from grpo_kernels.ops.logps.head_fn import token_logps_from_head_fn

__all__ = ["token_logps", "token_logps_from_head_fn", "token_logps_from_hidden"]
