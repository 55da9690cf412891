"""Fused LM-head GRPO loss: ``hidden [B, T, H]`` + head weights -> ``(loss, metrics)``."""

from grpo_kernels.ops.lm_head_loss.api import (
                                               IMPL_CHOICES,
                                               IMPLEMENTATIONS,
                                               LAYOUTS,
                                               default_impl,
                                               grpo_loss_from_hidden,
)
from grpo_kernels.ops.lm_head_loss.pallas_tpu import (
                                               LmHeadPallasOptions,
                                               pallas_lm_head_loss,
)
from grpo_kernels.ops.lm_head_loss.reference import reference_lm_head_loss
from grpo_kernels.ops.lm_head_loss.xla import LmHeadBlockSizes, xla_lm_head_loss

__all__ = [
    "IMPL_CHOICES", "IMPLEMENTATIONS", "LAYOUTS", "LmHeadBlockSizes", "LmHeadPallasOptions",
    "default_impl", "grpo_loss_from_hidden", "pallas_lm_head_loss", "reference_lm_head_loss",
    "xla_lm_head_loss",
]
