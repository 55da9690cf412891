"""Qwen2 / Llama family decoders in Flax NNX and their checkpoint loaders."""

from grpo_kernels.models.config import ModelConfig
from grpo_kernels.models.decoder import Decoder
from grpo_kernels.models.hf import load_hf_checkpoint
from grpo_kernels.models.sampling import Generation, generate

__all__ = ["Decoder", "Generation", "ModelConfig", "generate", "load_hf_checkpoint"]
