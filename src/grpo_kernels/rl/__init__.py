"""GRPO training: data, rewards, advantages, the trainer and the A/B report.

Data flows one way: rollout -> rewards -> advantages -> model forward to hidden states -> the
loss op that ``loss.impl`` names -> gradients -> optimizer. This package is the only place that
joins models and loss ops.
"""

from grpo_kernels.rl.config import TrainConfig
from grpo_kernels.rl.trainer import Trainer, load_policy

__all__ = ["TrainConfig", "Trainer", "load_policy"]
