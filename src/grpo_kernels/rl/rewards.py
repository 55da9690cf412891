r"""Rewards of completions, and GRPO's group-relative advantages.

A reward function maps ``(completion text, Problem)`` to a float. The config names them and
weighs them; the step's reward is :math:`r_i = \sum_f w_f\, r_{f,i}`.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from grpo_kernels.rl.data import Problem

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FINAL_LINE = re.compile(r"^\s*####\s*\$?\s*-?\d[\d,]*(?:\.\d+)?\s*\.?\s*$")


def final_answer(completion: str) -> str | None:
    """The answer a completion commits to: the one number on the first line after its last
    ``####``, else its last number; ``None`` when it has neither.

    A ``####`` line with several numbers (``#### 5 or 6``, ``#### 2*3``) commits to none and
    gives ``None``, so hedging earns nothing; so does a second ``####`` line after the right
    one (only the last counts)."""
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        numbers = _NUMBER.findall(tail.splitlines()[0]) if tail else []
        return numbers[0] if len(numbers) == 1 else None
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def correctness_reward(completion: str, problem: Problem) -> float:
    """1.0 when the final answer equals the problem's, checked by math-verify (so ``1,000``,
    ``1000.0`` and ``$1000`` all match ``1000``); else 0.0."""
    from math_verify import parse, verify

    answer = final_answer(completion)
    if answer is None:
        return 0.0
    gold = parse(problem.answer)
    guess = parse(answer.replace(",", ""))
    return 1.0 if gold and guess and verify(gold, guess) else 0.0


def format_reward(completion: str, problem: Problem) -> float:
    """1.0 when the last non-empty line is ``#### <number>`` (the system prompt's format), 0.5
    when a ``#### <number>`` line appears earlier, else 0.0."""
    del problem
    lines = [line for line in completion.splitlines() if line.strip()]
    if not lines:
        return 0.0
    if _FINAL_LINE.match(lines[-1]):
        return 1.0
    return 0.5 if any(_FINAL_LINE.match(line) for line in lines) else 0.0


BREVITY_CHARS = 200


def brevity_reward(completion: str, problem: Problem) -> float:
    """``max(0, 1 - len(completion) / 200)``: shorter is better, whatever the content.

    Not a task reward. It is for A/B runs of models too small to solve the task (the 2-layer
    model of ``configs/head_ab_cpu.yaml`` earns 0 from ``correctness`` and ``format``, so every
    advantage would be 0 and the two arms could not differ): any policy can earn it by ending
    sooner, so both arms learn and their reward curves can be compared. In the spirit of the
    length reward of TRL's GRPOTrainer quickstart.
    """
    del problem
    return max(0.0, 1.0 - len(completion) / BREVITY_CHARS)


REWARD_FUNCTIONS: dict[str, Callable[[str, Problem], float]] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "brevity": brevity_reward,
}


def register_reward(name: str, fn: Callable[[str, Problem], float]) -> None:
    """Makes ``fn(completion, problem) -> float`` available to configs as ``name``."""
    if not name or not callable(fn):
        raise ValueError(f"register_reward needs a name and a callable, got {name!r}, {fn!r}")
    REWARD_FUNCTIONS[name] = fn


def score(completions: Sequence[str], problems: Sequence[Problem],
          functions: Sequence[tuple[str, float]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Weighted total reward ``[N]`` and each function's unweighted rewards ``{name: [N]}``."""
    if len(completions) != len(problems):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
    parts = {name: np.array([REWARD_FUNCTIONS[name](c, p)
                             for c, p in zip(completions, problems)], np.float32)
             for name, _ in functions}
    total = np.zeros(len(completions), np.float32)
    for name, weight in functions:
        total += np.float32(weight) * parts[name]
    return total, parts


def group_advantages(rewards: np.ndarray, num_generations: int,
                     scale_rewards: str = "group") -> np.ndarray:
    r"""GRPO advantages of rewards ``[N]`` laid out as consecutive groups of ``G``.

    .. math::

        A_i = \frac{r_i - \mathrm{mean}_{g(i)}(r)}{\sigma + 10^{-4}}

    with :math:`\sigma` the (unbiased) std of the group (``"group"``), of the whole batch
    (``"batch"``), or :math:`\sigma + 10^{-4} := 1` (``"none"``), as TRL's ``scale_rewards``.
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % num_generations:
        raise ValueError(f"rewards must be [N] with N divisible by num_generations="
                         f"{num_generations}, got shape {r.shape}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2, got {num_generations}")
    groups = r.reshape(-1, num_generations)
    centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    if scale_rewards == "group":
        std = np.repeat(groups.std(axis=1, ddof=1), num_generations)
    elif scale_rewards == "batch":
        std = np.full_like(r, r.std(ddof=1) if r.size > 1 else 0.0)
    elif scale_rewards == "none":
        return centred.astype(np.float32)
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got "
                         f"{scale_rewards!r}")
    return (centred / (std + 1e-4)).astype(np.float32)
