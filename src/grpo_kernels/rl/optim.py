"""The trainer's optimizer: AdamW, global-norm clipping, a warmup-cosine schedule."""

from __future__ import annotations

import optax

from grpo_kernels.rl.config import TrainConfig


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a warmup-cosine schedule over every update."""
    o = config.optim
    updates = config.train.steps * config.train.ppo_epochs
    warmup = min(o.warmup_steps, max(updates - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else o.learning_rate, peak_value=o.learning_rate,
        warmup_steps=warmup, decay_steps=max(updates, warmup + 1),
        end_value=o.learning_rate * o.end_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(o.max_grad_norm),
                       optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                                   weight_decay=o.weight_decay))
