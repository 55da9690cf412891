"""The A/B report's numbers: step-1 gates, ratios, and the reward trend of each run."""

import math

import numpy as np
import pytest

from grpo_kernels.rl import report


def _records(rewards, step_s=2.0, peak=100 << 20, loss0=0.5, grad0=1.0):
    return [{"step": i + 1, "loss": loss0 if i == 0 else 0.1, "grad_norm": grad0 if i == 0 else 1.0,
             "reward/mean": float(r), "time/train/step_avg_last10_s": step_s,
             "time/train/update_s": step_s / 2, "memory/peak_bytes": peak,
             "memory/peak_rss_bytes": 2 * peak} for i, r in enumerate(rewards)]


def test_reward_trend_matches_the_matrix_form_of_least_squares():
    rng = np.random.default_rng(3)
    r = 0.2 + 0.01 * np.arange(1, 21) + rng.normal(0, 0.1, 20)
    t = report.reward_trend(r)
    x = np.stack([np.ones(20), np.arange(1, 21.0)], axis=1)
    beta, *_ = np.linalg.lstsq(x, r, rcond=None)
    resid = r - x @ beta
    cov = np.linalg.inv(x.T @ x) * (resid @ resid) / (20 - 2)
    assert t["slope"] == pytest.approx(beta[1], rel=1e-12)
    assert t["slope_se"] == pytest.approx(math.sqrt(cov[1, 1]), rel=1e-10)
    assert t["first"] == pytest.approx(r[:5].mean()) and t["last"] == pytest.approx(r[-5:].mean())
    assert t["rises"] == (beta[1] > 2 * math.sqrt(cov[1, 1]))


@pytest.mark.parametrize("slope, rises", [(0.03, True), (0.0, False), (-0.03, False)])
def test_reward_trend_verdict(slope, rises):
    rng = np.random.default_rng(0)
    r = 0.3 + slope * np.arange(20) + rng.normal(0, 0.05, 20)
    assert report.reward_trend(r)["rises"] is rises


def test_reward_trend_of_a_short_run_has_no_slope():
    t = report.reward_trend([0.1, 0.9])
    assert math.isnan(t["slope"]) and t["rises"] is False
    assert t["first"] == pytest.approx(0.5) and t["last"] == pytest.approx(0.5)


def test_summarize_and_markdown():
    rng = np.random.default_rng(1)
    base = _records(0.2 + 0.03 * np.arange(12) + rng.normal(0, 0.02, 12))
    kernel = _records(0.5 + 0.02 * (-1.0) ** np.arange(12), step_s=1.5, peak=40 << 20,
                      loss0=0.5 + 2e-5, grad0=1.005)
    s = report.summarize({"reference": base, "fused": kernel})
    f = s["runs"]["fused"]
    assert f["step_time_ratio"] == pytest.approx(0.75)
    assert f["peak_memory_ratio"] == pytest.approx(0.4)
    assert f["step1_loss_ok"] and f["step1_grad_norm_ok"]
    assert s["runs"]["reference"]["reward_trend"]["rises"] is True
    assert f["reward_trend"]["rises"] is False
    text = report.markdown(s, "t", None)
    assert "| reward rises (slope > 2 SE) | yes | no |" in text
    assert "| mean reward, first 5 steps |" in text
    assert "trainer/sampler" not in text  # runs without the metric
    for r, (ratio, outside) in zip((base, kernel), ((0.99979, 2e-3), (0.948, 0.0))):
        r[0]["sampler_ratio"] = ratio
        for i, step in enumerate(r):
            step["outside_truncation"] = outside * (i % 2) * 2
    text = report.markdown(report.summarize({"reference": base, "fused": kernel}), "t", None)
    assert "| step 1 mean ratio trainer/sampler | 0.99979 | 0.94800 |" in text
    assert "| outside_truncation, mean of all steps | 2.00e-03 | 0.00e+00 |" in text


def test_times_after_step_1_leave_out_the_compiling_step():
    records = _records([0.1, 0.2, 0.3, 0.4])
    for r, rollout, update in zip(records, (9.0, 1.0, 2.0, 3.0), (7.0, 0.5, 0.25, 0.75)):
        r.update({"time/train/rollout_s": rollout, "time/train/update_s": update})
    run = report.summarize({"a": records})["runs"]["a"]
    assert run["rollout_after_step1_s"] == pytest.approx(2.0)
    assert run["update_after_step1_s"] == pytest.approx(0.5)
    assert run["update_last10_s"] == pytest.approx(8.5 / 4)  # step 1's compile included
    one = report.summarize({"a": records[:1]})["runs"]["a"]
    assert one["rollout_after_step1_s"] is None
    assert "| mean update_s after step 1 | - |" in report.markdown(
        report.summarize({"a": records[:1]}), "t", None)


def test_step1_gates_fail_on_a_large_difference():
    base = _records([0.1, 0.2, 0.3])
    other = _records([0.1, 0.2, 0.3], loss0=0.6, grad0=1.5)
    f = report.summarize({"a": base, "b": other})["runs"]["b"]
    assert not f["step1_loss_ok"] and not f["step1_grad_norm_ok"]


def test_held_out_gain_uses_the_paired_standard_error():
    from grpo_kernels.rl.evaluate import binomial_se, compare

    rng = np.random.default_rng(4)
    before = (rng.random(250) < 0.2).astype(int)
    after = np.where(rng.random(250) < 0.15, 1 - before, before)  # some scores flip
    after[:30] = 1
    c = compare(before, after)
    d = after - before
    # the paired SE from its definition: sqrt(sum (d - mean)^2 / (n - 1) / n)
    se = math.sqrt(((d - d.mean()) ** 2).sum() / (d.size - 1) / d.size)
    assert c["diff"] == pytest.approx(d.mean()) and c["se"] == pytest.approx(se)
    assert c["changed"] == int((d != 0).sum())
    assert c["unpaired_se"] == pytest.approx(math.sqrt(
        before.mean() * (1 - before.mean()) / 250 + after.mean() * (1 - after.mean()) / 250))
    assert c["exceeds_2se"] is bool(abs(d.mean()) > 2 * se) is True
    assert binomial_se(0.2, 100) == pytest.approx(0.04)
    assert compare([0, 1, 0], [0, 1, 0])["exceeds_2se"] is False  # no change, no gain
    with pytest.raises(ValueError, match="equal-length"):
        compare([0, 1], [0, 1, 1])


def test_report_with_held_out_accuracy_and_correctness():
    records = _records(np.linspace(0.1, 0.5, 12))
    for i, r in enumerate(records):
        r["reward/correctness"] = 0.1 + 0.02 * i
    before = {"step": 0, "correct": [0] * 15 + [1] * 5}
    evals = {"reference": (before, {"step": 12, "correct": [0] * 5 + [1] * 15}),
             "fused": (before, {"step": 12, "correct": [0] * 6 + [1] * 14})}
    s = report.summarize({"reference": records, "fused": records}, evals)
    ev = s["eval"]
    assert ev["n"] == 20 and ev["runs"]["reference"]["diff"] == pytest.approx(0.5)
    assert ev["runs"]["reference"]["exceeds_2se"] is True
    assert ev["runs"]["fused"]["vs_baseline"]["diff"] == pytest.approx(-0.05)
    assert ev["runs"]["fused"]["vs_baseline"]["exceeds_2se"] is False
    text = report.markdown(s, "t", None)
    assert "| gain > 2 SE | yes | yes |" in text and "within 2 SE" in text
    assert "| correctness, first 5 -> last 5 steps | 0.140 -> 0.280 |" in text
    with pytest.raises(ValueError, match="different sizes"):
        report.summarize_evals({"a": evals["fused"], "b": (before, {"step": 1, "correct": [1]})})
