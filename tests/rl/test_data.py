"""Data: GSM8K loading and its errors, the arithmetic generator, the resumable order."""

import json
import os
import re

import numpy as np
import pytest

from grpo_kernels.rl.data import (arithmetic_problems, held_out_problems, load_gsm8k,
                                  prompt_ids, save_problems, step_indices)

GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gsm8k")


def test_gsm8k_test_split():
    path = os.path.join(GSM8K, "test.jsonl")
    if not os.path.isfile(path):
        pytest.skip(f"{path} absent (the shared GSM8K copy is for local runs and CI)")
    problems = load_gsm8k(path)
    assert len(problems) == 1319
    assert problems[0].answer == "18" and "ducks" in problems[0].question
    assert all(re.fullmatch(r"-?[\d.]+", p.answer) for p in problems)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"), ('["a"]', "expected a JSON object"),
    ('{"question": "q"}', "missing string field 'answer'"),
    ('{"question": "q", "answer": "no marker"}', "answer has no final '#### N'")])
def test_gsm8k_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "x\n#### 3"})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: {message}")):
        load_gsm8k(str(path))


def test_gsm8k_missing_file():
    with pytest.raises(ValueError, match="no such file"):
        load_gsm8k("/nonexistent/gsm8k.jsonl")


def _solve_level1(question: str) -> int:
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    if "more" in question:
        return a + b
    if "gave away" in question:
        return a - b
    if "bags with" in question:
        return a * b
    return a // b


def test_arithmetic_problems_are_correct_and_deterministic():
    problems = arithmetic_problems(200, 1, seed=3)
    assert problems == arithmetic_problems(200, 1, seed=3)
    assert problems != arithmetic_problems(200, 1, seed=4)
    for p in problems:
        assert int(p.answer) == _solve_level1(p.question) and int(p.answer) >= 0
    for level in (2, 3):
        answers = [int(p.answer) for p in arithmetic_problems(200, level, seed=0)]
        assert min(answers) >= 0 and len(set(answers)) > 20
    with pytest.raises(ValueError, match="difficulty"):
        arithmetic_problems(3, 5, seed=0)


def test_step_indices_cover_each_epoch_and_depend_only_on_the_step():
    size, count = 10, 4
    seen = [step_indices(s, count, size, seed=1) for s in range(5)]
    flat = np.concatenate(seen)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert step_indices(3, count, size, seed=1) == seen[3]
    assert step_indices(3, count, size, seed=2) != seen[3]


class _Tok:
    chat_template = None

    def encode(self, text):
        return [ord(c) for c in text]


def test_prompt_without_chat_template():
    ids = prompt_ids(_Tok(), "Be brief.", "What is 2+2?")
    assert "".join(map(chr, ids)).startswith("Be brief.\n\nQuestion: What is 2+2?")


def test_held_out_problems_are_disjoint_from_the_pool_and_saved_as_gsm8k(tmp_path):
    # level 1 with a pool of 5,000: small numbers make repeats likely, so the filter matters
    pool = arithmetic_problems(5000, 1, seed=3)
    held = held_out_problems(300, 1, 3, pool)
    assert len(held) == 300 and len({p.question for p in held}) == 300
    assert not {p.question for p in held} & {p.question for p in pool}
    assert held == held_out_problems(300, 1, 3, pool)  # deterministic
    assert held[:5] != arithmetic_problems(5, 1, seed=3)  # another stream than the pool's
    unfiltered = held_out_problems(300, 1, 3, [])
    assert {p.question for p in unfiltered} & {p.question for p in pool}  # the filter did work
    save_problems(str(tmp_path / "h.jsonl"), held)
    assert load_gsm8k(str(tmp_path / "h.jsonl")) == held


def test_held_out_problems_refuse_when_the_generator_runs_dry(monkeypatch):
    from grpo_kernels.rl import data

    monkeypatch.setitem(data._LEVELS, 1, lambda rng: data.Problem("same?", "1"))
    with pytest.raises(ValueError, match="eval.num_problems=2: only 1 arithmetic problems"):
        held_out_problems(2, 1, 3, [])


def test_held_out_set_errors_name_the_eval_keys(tmp_path):
    from grpo_kernels.rl.config import TrainConfig
    from grpo_kernels.rl.evaluate import held_out

    missing = TrainConfig.from_dict({"eval": {"num_problems": 2, "path": "/nonexistent.jsonl"}})
    with pytest.raises(ValueError, match="eval.path '/nonexistent.jsonl': no such file"):
        held_out(missing, [])
    path = tmp_path / "test.jsonl"
    save_problems(str(path), arithmetic_problems(3, 1, seed=0))
    short = TrainConfig.from_dict({"eval": {"num_problems": 5, "path": str(path)}})
    with pytest.raises(ValueError, match="3 problems, eval.num_problems asks for 5"):
        held_out(short, [])
    gsm8k = TrainConfig.from_dict({"data": {"source": "gsm8k", "path": str(path)},
                                   "eval": {"num_problems": 2}})
    with pytest.raises(ValueError, match="eval.path: held-out problems for data.source='gsm8k'"):
        held_out(gsm8k, [])
