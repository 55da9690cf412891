"""Logits-level GRPO loss: ``logits [B, T, V]`` -> ``(loss, metrics)``."""

from grpo_kernels.ops.logits_loss.api import (
    IMPL_CHOICES,
    IMPLEMENTATIONS,
    default_impl,
    grpo_loss,
)
from grpo_kernels.ops.logits_loss.pallas import PallasOptions, pallas_grpo_loss
from grpo_kernels.ops.logits_loss.reference import reference_grpo_loss
from grpo_kernels.ops.logits_loss.xla import XlaBlockSizes, xla_grpo_loss

__all__ = [
    "IMPL_CHOICES", "IMPLEMENTATIONS", "PallasOptions", "XlaBlockSizes", "default_impl",
    "grpo_loss", "pallas_grpo_loss", "reference_grpo_loss", "xla_grpo_loss",
]
