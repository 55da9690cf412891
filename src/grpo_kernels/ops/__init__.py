"""The loss ops: ``logits_loss`` (from ``[B, T, V]`` logits) and ``lm_head_loss`` (from hidden
states and the head's weights, fused), on the shared ``core``."""

# The names a training config or a CLI uses to pick an op and its implementation. Kept here,
# free of the trainer's imports, so the loss and bench commands run where only jax is installed.
LOSS_HEADS = ("logits", "fused")  # grpo_loss / grpo_loss_from_hidden
LOSS_IMPLS = ("auto", "reference", "xla", "pallas")
