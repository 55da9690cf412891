"""Prompts: GSM8K from a jsonl file, arithmetic word problems generated here, chat formatting,
and a step-indexed order that a resumed run reproduces exactly."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Sequence

import numpy as np

_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$")


@dataclasses.dataclass(frozen=True)
class Problem:
    """A question and its final answer (a number, as text: ``"18"``)."""

    question: str
    answer: str


def load_gsm8k(path: str) -> list[Problem]:
    """GSM8K problems from a jsonl file of ``{"question": ..., "answer": "... #### N"}`` lines.

    Raises:
      ValueError: the file is missing, or a line is not JSON / lacks a field / has no
        ``#### N`` (naming the file and line).
    """
    if not os.path.isfile(path):
        raise ValueError(f"data.path {path!r}: no such file (expected a GSM8K jsonl file)")
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str):
                    raise ValueError(f"{where}: missing string field {key!r}")
            match = _GSM8K_ANSWER.search(row["answer"].strip())
            if match is None:
                raise ValueError(f"{where}: answer has no final '#### N' line")
            problems.append(Problem(row["question"], match.group(1).replace(",", "")))
    if not problems:
        raise ValueError(f"data.path {path!r}: no problems in the file")
    return problems


# --- arithmetic word problems ---------------------------------------------------------------

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jamal",
          "Kira", "Leo", "Maya", "Noah", "Olga", "Pablo")
_THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")


def _one_step(rng: np.random.Generator) -> Problem:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    kind = rng.integers(4)
    a, b = (int(x) for x in rng.integers(2, 20, 2))
    if kind == 0:
        return Problem(f"{name} has {a} {thing} and gets {b} more. How many {thing} does "
                       f"{name} have now?", str(a + b))
    if kind == 1:
        a, b = max(a, b) + b, min(a, b)
        return Problem(f"{name} had {a} {thing} and gave away {b}. How many {thing} are "
                       f"left?", str(a - b))
    if kind == 2:
        a, b = a % 9 + 2, b % 9 + 2
        return Problem(f"{name} has {a} bags with {b} {thing} in each bag. How many {thing} "
                       f"are there in total?", str(a * b))
    k, b = a % 9 + 2, b % 9 + 2
    return Problem(f"{name} shares {k * b} {thing} equally among {b} friends. How many "
                   f"{thing} does each friend get?", str(k))


def _two_step(rng: np.random.Generator) -> Problem:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b, c = (int(x) for x in rng.integers(2, 30, 3))
    if rng.integers(2) == 0:
        b, c = b % 9 + 2, c % 9 + 2
        return Problem(f"{name} has {a} {thing}. Then {name} buys {b} packs with {c} {thing} "
                       f"in each pack. How many {thing} does {name} have now?", str(a + b * c))
    a, b = a % 12 + 3, b % 8 + 2
    c = int(rng.integers(1, a * b))
    return Problem(f"{name} earns {a} dollars per hour and works {b} hours, then spends {c} "
                   f"dollars. How many dollars does {name} have left?", str(a * b - c))


def _three_step(rng: np.random.Generator) -> Problem:
    name = rng.choice(_NAMES)
    pen, book, n_pen, n_book = (int(x) for x in rng.integers(2, 10, 4))
    cost = pen * n_pen + book * n_book
    paid = (cost // 10 + 1 + int(rng.integers(0, 3))) * 10
    return Problem(f"Pens cost {pen} dollars each and notebooks cost {book} dollars each. "
                   f"{name} buys {n_pen} pens and {n_book} notebooks and pays with {paid} "
                   f"dollars. How much change does {name} get, in dollars?", str(paid - cost))


_LEVELS = {1: _one_step, 2: _two_step, 3: _three_step}


def arithmetic_problems(count: int, difficulty: int, seed: int) -> list[Problem]:
    """``count`` word problems with whole-number answers; ``difficulty`` 1, 2 or 3 is the
    number of arithmetic steps. The same ``(count, difficulty, seed)`` gives the same list."""
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty!r}")
    rng = np.random.default_rng([seed, difficulty])
    return [_LEVELS[difficulty](rng) for _ in range(count)]


# the random stream of held-out problems: the training pool's is ``[seed, difficulty]``
_HELD_OUT_STREAM = 1


def held_out_problems(count: int, difficulty: int, seed: int,
                      exclude: Sequence[Problem]) -> list[Problem]:
    """``count`` arithmetic problems for evaluation, none of whose questions is in ``exclude``
    (the training pool) nor repeated.

    They come from a random stream the training pool never draws from (``[seed, difficulty,
    1]`` against the pool's ``[seed, difficulty]``); a generated question that equals a
    training one (small numbers make that happen) is dropped, so the set is disjoint by
    construction and not only by chance. Deterministic in its arguments.

    Raises:
      ValueError: the generator cannot find ``count`` distinct unseen questions.
    """
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty!r}")
    rng = np.random.default_rng([seed, difficulty, _HELD_OUT_STREAM])
    seen = {p.question for p in exclude}
    out: list[Problem] = []
    attempts = 10 * count + 100
    while len(out) < count and attempts:
        attempts -= 1
        problem = _LEVELS[difficulty](rng)
        if problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
    if len(out) == count:
        return out
    raise ValueError(f"eval.num_problems={count}: only {len(out)} arithmetic problems of level "
                     f"{difficulty} are not in the training pool; ask for fewer")


def save_problems(path: str, problems: Sequence[Problem]) -> None:
    """Writes problems as jsonl in GSM8K's form (``answer`` ends in ``#### N``), so that
    :func:`load_gsm8k` reads them back."""
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"question": p.question, "answer": f"#### {p.answer}"}) + "\n")


# --- order and formatting -------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def step_indices(step: int, count: int, size: int, seed: int) -> list[int]:
    """Indices of the ``count`` problems of training step ``step`` (0-based): a fresh shuffle of
    the pool per epoch, consumed in order. Depends only on its arguments, so a resumed run
    sees the same problems as an uninterrupted one."""
    out = []
    for position in range(step * count, (step + 1) * count):
        epoch, i = divmod(position, size)
        out.append(int(_permutation(size, seed, epoch)[i]))
    return out


def prompt_ids(tokenizer: Any, system_prompt: str, question: str) -> list[int]:
    """Token ids of the chat prompt (system prompt, then the question as the user's turn), or a
    plain-text prompt when the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt},
             {"role": "user", "content": question}], add_generation_prompt=True)
    else:
        text = f"{system_prompt}\n\nQuestion: {question}\nAnswer:"
    return tokenizer.encode(text)


def load_problems(source: str, path: str | None, difficulty: int, num_problems: int,
                  seed: int) -> list[Problem]:
    """The prompt pool a ``data:`` config section names."""
    if source == "gsm8k":
        return load_gsm8k(path)
    return arithmetic_problems(num_problems, difficulty, seed)


def split_batches(rows: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]
