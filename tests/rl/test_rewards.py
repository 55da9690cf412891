"""Rewards (math-verify correctness, format, brevity) and group advantages against float64 formulas."""

import numpy as np
import pytest

from grpo_kernels.rl.data import Problem
from grpo_kernels.rl.rewards import (brevity_reward, correctness_reward, final_answer,
                                     format_reward, group_advantages, score)

P = Problem("q", "1000")


@pytest.mark.parametrize("text, answer", [
    ("so 3 + 4 = 7\n#### 7", "7"), ("#### 1,000\nthanks", "1,000"), ("it is 12 then 15.", "15"),
    ("no numbers", None), ("####", None), ("#### 6 apples", "6"),
    # a hedged answer line commits to nothing; only the last #### counts
    ("#### 5 or 6", None), ("#### 2*3", None), ("#### 6, 60", None), ("#### 6\n#### 5", "5")])
def test_final_answer(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize("text, reward", [
    ("#### 1000", 1.0), ("#### 1,000", 1.0), ("The total is 1000.0", 1.0), ("#### $1000", 1.0),
    ("#### 999", 0.0), ("1000 apples, minus 1 is 999", 0.0), ("nothing", 0.0),
    ("#### 999 or 1000", 0.0), ("#### 1000\n#### 1000", 1.0), ("#### 1000\n#### 999", 0.0)])
def test_correctness_uses_math_verify(text, reward):
    assert correctness_reward(text, P) == reward


@pytest.mark.parametrize("text, reward", [
    ("3 + 4 = 7\n#### 7", 1.0), ("#### -2.5\n\n", 1.0), ("#### 7\nso that is it", 0.5),
    ("the answer is 7", 0.0), ("", 0.0), ("#### seven", 0.0)])
def test_format_reward(text, reward):
    assert format_reward(text, P) == reward


@pytest.mark.parametrize("text, reward", [
    ("", 1.0), ("x" * 50, 0.75), ("x" * 200, 0.0), ("x" * 999, 0.0)])
def test_brevity_reward(text, reward):
    assert brevity_reward(text, P) == reward


def test_score_weights_and_parts():
    problems = [Problem("q", "7")] * 3
    total, parts = score(["#### 7", "#### 8", "7"], problems,
                         [("correctness", 1.0), ("format", 0.5)])
    np.testing.assert_allclose(parts["correctness"], [1, 0, 1])
    np.testing.assert_allclose(parts["format"], [1, 1, 0])
    np.testing.assert_allclose(total, [1.5, 0.5, 1.0])


def test_group_advantages_match_trl_formulas():
    rng = np.random.default_rng(0)
    r = rng.uniform(size=12)
    g = r.reshape(3, 4)
    want = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()
    np.testing.assert_allclose(group_advantages(r, 4, "group"), want, rtol=1e-6)
    want_b = (g - g.mean(1, keepdims=True)).ravel() / (r.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(group_advantages(r, 4, "batch"), want_b, rtol=1e-6)
    np.testing.assert_allclose(group_advantages(r, 4, "none"),
                               (g - g.mean(1, keepdims=True)).ravel(), rtol=1e-6, atol=1e-7)
    # a group with equal rewards has zero advantage, not NaN
    assert np.all(group_advantages(np.ones(4), 4) == 0)


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(np.ones(6), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(np.ones(4), 4, "std")
