"""grpo_kernels: fast, memory-light GRPO policy losses for JAX."""

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.segments import Segments
from grpo_kernels.ops.lm_head_loss import (
    LmHeadBlockSizes,
    LmHeadPallasBlockSizes,
    LmHeadPallasOptions,
    grpo_loss_from_hidden,
)
from grpo_kernels.ops.logits_loss import PallasBlockSizes, PallasOptions, XlaBlockSizes, grpo_loss
from grpo_kernels.ops.logps import (token_logps, token_logps_from_head_fn,
                                   token_logps_from_hidden)

__version__ = "0.1.0"
__all__ = ["GRPOLossConfig", "LmHeadBlockSizes", "LmHeadPallasBlockSizes", "LmHeadPallasOptions",
           "PallasBlockSizes", "PallasOptions", "Segments", "XlaBlockSizes", "grpo_loss",
           "grpo_loss_from_hidden", "token_logps", "token_logps_from_head_fn",
           "token_logps_from_hidden", "__version__"]
