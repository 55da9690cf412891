"""Greedy accuracy of a policy on a problem set (GSM8K test split, or generated problems)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from grpo_kernels.models.sampling import generate
from grpo_kernels.rl import data as data_lib
from grpo_kernels.rl.rewards import correctness_reward, format_reward


def evaluate(model: Any, tokenizer: Any, problems: Sequence[data_lib.Problem], *,
             system_prompt: str, max_new_tokens: int, batch_size: int = 16,
             progress: bool = True) -> dict[str, Any]:
    """Greedy completions of every problem; returns accuracy (math-verify against the answer),
    the rate of the strict ``#### N`` format, the count and a few samples."""
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
    return {"n": len(correct), "accuracy": float(np.mean(correct)),
            "format_rate": float(np.mean(formatted)), "samples": samples}
