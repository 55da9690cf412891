"""Logits-level GRPO loss: ``logits [B, T, V]`` -> ``(loss, metrics)``."""

from grpo_kernels.ops.logits_loss.api import IMPL_CHOICES, IMPLEMENTATIONS, default_impl, grpo_loss
from grpo_kernels.ops.logits_loss.pallas import PallasBlockSizes, PallasOptions
from grpo_kernels.ops.logits_loss.xla import XlaBlockSizes

__all__ = ["IMPL_CHOICES", "IMPLEMENTATIONS", "PallasBlockSizes", "PallasOptions",
           "XlaBlockSizes", "default_impl", "grpo_loss"]
