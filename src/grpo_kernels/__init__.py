"""grpo_kernels: fast, memory-light GRPO policy losses for JAX."""

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.logits_loss import PallasOptions, XlaBlockSizes, grpo_loss

__version__ = "0.1.0"
__all__ = ["GRPOLossConfig", "PallasOptions", "XlaBlockSizes", "grpo_loss", "__version__"]
