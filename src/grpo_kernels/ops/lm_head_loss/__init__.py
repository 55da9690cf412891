"""Fused LM-head GRPO loss: ``hidden [B, T, H]`` + head weights -> ``(loss, metrics)``."""

from grpo_kernels.ops.lm_head_loss.api import (
    IMPL_CHOICES,
    IMPLEMENTATIONS,
    default_impl,
    grpo_loss_from_hidden,
)
from grpo_kernels.ops.lm_head_loss.head import LAYOUTS
from grpo_kernels.ops.lm_head_loss.pallas_options import (
    LmHeadPallasBlockSizes,
    LmHeadPallasOptions,
)
from grpo_kernels.ops.lm_head_loss.xla_plan import LmHeadBlockSizes

__all__ = ["IMPL_CHOICES", "IMPLEMENTATIONS", "LAYOUTS", "LmHeadBlockSizes",
           "LmHeadPallasBlockSizes", "LmHeadPallasOptions", "default_impl",
           "grpo_loss_from_hidden"]
