"""Forward-only per-token log-probs (and entropies): on logits, and from hidden states and an
LM head without ``[B, T, V]``."""

from grpo_kernels.ops.logps.api import token_logps, token_logps_from_hidden

__all__ = ["token_logps", "token_logps_from_hidden"]
