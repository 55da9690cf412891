"""A step's rollout, after sampling: the completions scored, the rows the update takes, the
metrics of the step's record. Pure functions of the sampler's output (the trainer samples and
gathers the processes' shares)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grpo_kernels.rl import rewards as rewards_lib
from grpo_kernels.rl.policy import Batch


def step_seed(seed: int, step: int, process: int = 0) -> int:
    """The sampling seed of step ``step``: a function of ``(seed, step)`` only; process
    ``p > 0`` of a multi-process run samples its share with its own stream."""
    key = [seed, step] if process == 0 else [seed, step, process]
    return int(np.random.default_rng(key).integers(2 ** 31 - 1))


def score(texts: Sequence[str], problems: Sequence[Any], num_generations: int,
          functions: Sequence[Any]) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
    """``(reward, parts, sample)`` of ``num_generations`` completions per problem (in order):
    the weighted reward of ``functions`` (the config's ``rewards.functions``), each function's
    part, and the first completion as a sample for the run directory."""
    rows = [p for p in problems for _ in range(num_generations)]
    reward, parts = rewards_lib.score(texts, rows, [(f.name, f.weight) for f in functions])
    sample = {"question": problems[0].question, "answer": problems[0].answer,
              "completion": texts[0], "reward": float(reward[0])}
    return reward, parts, sample


def to_batch(gen: Any, advantages: np.ndarray) -> Batch:
    """The update's :class:`~grpo_kernels.rl.policy.Batch` of a generation (prompt and
    completion side by side), with the sampler's log-probs."""
    return Batch(ids=np.concatenate([gen.prompt_ids, gen.ids], axis=1),
                 attention=np.concatenate([gen.prompt_mask, gen.mask], axis=1),
                 mask=gen.mask, advantages=advantages,
                 prompt_width=int(gen.prompt_ids.shape[1]),
                 sampler_logps=gen.logps)


def metrics(gen: Any, reward: np.ndarray, parts: dict[str, np.ndarray],
            eos_ids: Sequence[int]) -> dict[str, Any]:
    """The rollout's figures in a step's record: rewards, completion lengths, the share cut
    off before an end-of-sequence token, and the tokens processed."""
    lengths = gen.mask.sum(axis=1)
    ended = np.isin(gen.ids, eos_ids).any(axis=1)
    return {"reward/mean": float(reward.mean()), "reward/std": float(reward.std()),
            **{f"reward/{name}": float(v.mean()) for name, v in parts.items()},
            "completion/length_mean": float(lengths.mean()),
            "completion/length_max": int(lengths.max()),
            "completion/truncated_ratio": float(1 - ended.mean()),
            "tokens": int(gen.prompt_mask.sum() + gen.mask.sum())}
