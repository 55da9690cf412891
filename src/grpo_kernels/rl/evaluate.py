"""Greedy accuracy of a policy on a problem set (GSM8K test split, or generated problems),
the held-out set of a run, and the statistics that compare two accuracies."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import numpy as np

from grpo_kernels.models.sampling import generate
from grpo_kernels.rl import data as data_lib
from grpo_kernels.rl.rewards import correctness_reward, format_reward


def evaluate(model: Any, tokenizer: Any, problems: Sequence[data_lib.Problem], *,
             system_prompt: str, max_new_tokens: int, batch_size: int = 16,
             progress: bool = True) -> dict[str, Any]:
    """Greedy completions of every problem; returns accuracy (math-verify against the answer),
    its binomial standard error, the rate of the strict ``#### N`` format, the count, each
    problem's 0/1 score (``correct``, in the order given) and a few samples."""
    from tqdm.auto import tqdm

    correct, formatted, samples = [], [], []
    batches = data_lib.split_batches(list(problems), batch_size)
    for batch in tqdm(batches, desc="eval", disable=not progress, dynamic_ncols=True):
        prompts = [data_lib.prompt_ids(tokenizer, system_prompt, p.question) for p in batch]
        gen = generate(model, prompts, num_generations=1, max_new_tokens=max_new_tokens,
                       temperature=0.0, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
        for problem, ids, mask in zip(batch, gen.ids, gen.mask):
            text = tokenizer.decode(ids[mask == 1])
            correct.append(correctness_reward(text, problem))
            formatted.append(format_reward(text, problem) == 1.0)
            if len(samples) < 3:
                samples.append({"question": problem.question, "answer": problem.answer,
                                "completion": text})
    accuracy = float(np.mean(correct))
    return {"n": len(correct), "accuracy": accuracy,
            "accuracy_se": binomial_se(accuracy, len(correct)),
            "format_rate": float(np.mean(formatted)),
            "correct": [int(c) for c in correct], "samples": samples}


def binomial_se(p: float, n: int) -> float:
    r"""Standard error of an accuracy :math:`p` measured on :math:`n` problems,
    :math:`\sqrt{p (1 - p) / n}`."""
    return math.sqrt(p * (1.0 - p) / n) if n > 0 else float("nan")


def compare(before: Sequence[float], after: Sequence[float]) -> dict[str, float | bool]:
    r"""The change of accuracy between two scorings of the same problems.

    With per-problem scores :math:`a_i, b_i \in \{0, 1\}` and :math:`d_i = b_i - a_i`, the
    gain is :math:`\bar d` and its standard error is the paired one,
    :math:`s_d / \sqrt{n}` with :math:`s_d` the sample standard deviation of :math:`d`: the two
    scorings share their problems, so only the problems whose score changed carry noise. The
    unpaired :math:`\sqrt{\mathrm{SE}_a^2 + \mathrm{SE}_b^2}` (as if the problems were drawn
    twice) is returned beside it. ``exceeds_2se`` tests :math:`|\bar d| > 2\,\mathrm{SE}`
    with the paired one.

    Raises:
      ValueError: the two lists differ in length or are shorter than 2.
    """
    a, b = np.asarray(before, np.float64), np.asarray(after, np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"compare needs two equal-length score lists of 2 or more, got "
                         f"{a.shape} and {b.shape}")
    d = b - a
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    unpaired = math.hypot(binomial_se(float(a.mean()), a.size),
                          binomial_se(float(b.mean()), b.size))
    return {"before": float(a.mean()), "after": float(b.mean()), "diff": float(d.mean()),
            "se": se, "unpaired_se": unpaired, "changed": int(np.count_nonzero(d)),
            "exceeds_2se": bool(abs(d.mean()) > 2 * se)}


def held_out(config: Any, pool: Sequence[data_lib.Problem], count: int | None = None
             ) -> list[data_lib.Problem]:
    """The held-out problems of a run's ``config`` (its ``eval`` section), disjoint from the
    training ``pool``: the first ``count`` (default ``eval.num_problems``) of ``eval.path``,
    or generated ones (:func:`grpo_kernels.rl.data.held_out_problems`).

    Raises:
      ValueError: GSM8K training data without ``eval.path``, a missing ``eval.path``, or too
        few problems.
    """
    count = config.eval.num_problems if count is None else count
    if config.eval.path:
        if not os.path.isfile(config.eval.path):
            raise ValueError(f"eval.path {config.eval.path!r}: no such file (expected a GSM8K "
                             "jsonl file)")
        problems = data_lib.load_gsm8k(config.eval.path)[:count]
        if len(problems) < count:
            raise ValueError(f"eval.path {config.eval.path!r}: {len(problems)} problems, "
                             f"eval.num_problems asks for {count}")
        return problems
    if config.data.source != "arithmetic":
        raise ValueError("eval.path: held-out problems for data.source="
                         f"{config.data.source!r} must come from a file (e.g. GSM8K's test "
                         "split)")
    return data_lib.held_out_problems(count, config.data.difficulty, config.seed, pool)


def evaluate_into(run_dir: str, which: str, step: int, evaluate_fn: Callable[[int], dict],
                  problems: Sequence[data_lib.Problem], primary: bool = True) -> None:
    """``evaluate_fn(step)`` written to the run directory's ``EVAL_FILES[which]`` (``"before"``
    with the held-out ``problems`` beside it) and reported on stderr, unless the directory
    already holds that file for ``step`` (a resumed run does not score twice). Only the
    ``primary`` process writes; every process evaluates."""
    import json
    import sys

    from grpo_kernels.rl.run_dir import EVAL_FILES, write_json

    path = os.path.join(run_dir, EVAL_FILES[which])
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if json.load(f).get("step") == step:
                return
    result = evaluate_fn(step)
    if primary:
        write_json(path, result)
        if which == "before":
            data_lib.save_problems(os.path.join(run_dir, EVAL_FILES["problems"]), problems)
        print(f"held-out accuracy {which} (step {step}): {result['accuracy']:.3f} "
              f"± {result['accuracy_se']:.3f} on {result['n']} problems", file=sys.stderr)
