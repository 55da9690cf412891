"""The A/B report: two or more runs of one config that differ only in ``loss.impl``.

Markdown with step 1 (identical rollouts, so loss and grad norm must agree within the bfloat16
loss tolerances of ``grpo-kernels gradcheck``), the last-10-step means and their ratios to the
first (baseline) run, each run's reward trend, the held-out accuracy before and after where the
runs measured it (``eval.num_problems``), and a PNG of reward, correctness, loss, step time,
memory and held-out accuracy.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from grpo_kernels.rl.evaluate import binomial_se, compare
from grpo_kernels.rl.run_dir import read_evals, read_metrics

# step 1: the loss gate of gradcheck's bfloat16 tolerances, and its relative gradient gate
# (plus an absolute floor: with all-equal rewards the gradient is rounding noise near 0)
LOSS_ATOL, LOSS_RTOL, GRAD_NORM_RTOL, GRAD_NORM_ATOL = 1e-4, 1e-4, 1e-2, 1e-6
LAST = 10
PLOTS = (("reward/mean", "mean reward"), ("reward/correctness", "correctness reward"),
         ("loss", "loss"), ("time/train/step_s", "step time (s)"),
         ("memory/peak_bytes", "peak memory (MiB)"))

SMOOTHED = ("reward/mean", "reward/correctness", "loss")
SMOOTH = 5
EDGE = 5  # steps averaged at each end of a run for the reward trend


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Means of each ``window`` consecutive values (``len(values) - window + 1`` of them)."""
    c = np.cumsum(np.concatenate([[0.0], values]))
    return (c[window:] - c[:-window]) / window


def _last_mean(records: Sequence[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in records[-LAST:] if key in r]
    return float(np.mean(values)) if values else float("nan")


def _after_step1(records: Sequence[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the steps after the first (None for a one-step run, or where the
    records lack it)."""
    values = [r[key] for r in records[1:] if key in r]
    return float(np.mean(values)) if values else None


def _sem(records: Sequence[dict[str, Any]], key: str) -> float:
    values = np.array([r[key] for r in records[-LAST:] if key in r], np.float64)
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def reward_trend(rewards: Sequence[float]) -> dict[str, float | bool]:
    r"""Does the mean reward rise over a run? The least-squares line through the step means.

    With steps :math:`s_i` and rewards :math:`r_i`, the slope is
    :math:`\hat b = \sum (s_i - \bar s)(r_i - \bar r) / \sum (s_i - \bar s)^2` and its
    standard error :math:`\sqrt{\sum e_i^2 / (n - 2) / \sum (s_i - \bar s)^2}` with the
    residuals :math:`e_i`. The reward "rises" when :math:`\hat b > 2\,\mathrm{SE}`.

    The standard error treats the step means as independent around the line. In a GRPO run they
    are not quite: a policy that happens to improve early stays ahead for a few steps, so the
    check is optimistic; read it with the curve.

    Returns:
      ``first`` / ``last``: means of the first and last :data:`EDGE` steps; ``slope`` and
      ``slope_se`` per step (NaN below 3 steps); ``rises``.
    """
    r = np.asarray(rewards, np.float64)
    out: dict[str, float | bool] = {"first": float(r[:EDGE].mean()),
                                    "last": float(r[-EDGE:].mean()),
                                    "slope": float("nan"), "slope_se": float("nan"),
                                    "rises": False}
    if len(r) >= 3:
        s = np.arange(1, len(r) + 1, dtype=np.float64)
        sc = s - s.mean()
        slope = float(sc @ (r - r.mean()) / (sc @ sc))
        resid = r - r.mean() - slope * sc
        se = float(math.sqrt(resid @ resid / (len(r) - 2) / (sc @ sc)))
        out.update(slope=slope, slope_se=se, rises=bool(slope > 2 * se))
    return out


def summarize_evals(evals: dict[str, tuple[dict[str, Any], dict[str, Any]]]
                    ) -> dict[str, Any]:
    """Each run's held-out gain (:func:`grpo_kernels.rl.evaluate.compare` of its before and
    after scores) and each later run's final accuracy against the first run's.

    Raises:
      ValueError: the runs scored different numbers of problems.
    """
    names = list(evals)
    sizes = {f"{name} {which}": len(result["correct"]) for name, pair in evals.items()
             for which, result in zip(("before", "after"), pair)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"held-out results of different sizes: {sizes}")
    out: dict[str, Any] = {"n": next(iter(sizes.values())), "runs": {}}
    for name, (before, after) in evals.items():
        out["runs"][name] = {"step": after["step"], **compare(before["correct"],
                                                              after["correct"])}
    base_after = evals[names[0]][1]["correct"]
    for name in names[1:]:
        out["runs"][name]["vs_baseline"] = compare(base_after, evals[name][1]["correct"])
    return out


def summarize(runs: dict[str, list[dict[str, Any]]],
              evals: dict[str, tuple[dict[str, Any], dict[str, Any]]] | None = None
              ) -> dict[str, Any]:
    """Numbers of the report: per-run step 1 and last-10 means, ratios to the first run, the
    step-1 agreement, the reward-noise check, and (when every run has them) the held-out
    accuracies of :func:`summarize_evals` under ``"eval"``."""
    names = list(runs)
    base = names[0]
    out: dict[str, Any] = {"baseline": base, "runs": {}}
    for name, records in runs.items():
        if not records:
            raise ValueError(f"run {name!r} has no metrics")
        first = records[0]
        out["runs"][name] = {
            "steps": len(records),
            "step1_loss": first["loss"], "step1_grad_norm": first["grad_norm"],
            "step1_reward": first["reward/mean"],
            "reward_last10": _last_mean(records, "reward/mean"),
            "reward_last10_sem": _sem(records, "reward/mean"),
            "loss_last10": _last_mean(records, "loss"),
            "step_avg_last10_s": records[-1]["time/train/step_avg_last10_s"],
            "update_last10_s": _last_mean(records, "time/train/update_s"),
            # Step 1 compiles the rollout and update programs; the steps after it do not.
            "rollout_after_step1_s": _after_step1(records, "time/train/rollout_s"),
            "update_after_step1_s": _after_step1(records, "time/train/update_s"),
            "peak_bytes": max(r["memory/peak_bytes"] for r in records),
            "peak_rss_bytes": max(r["memory/peak_rss_bytes"] for r in records),
            "reward_trend": reward_trend([r["reward/mean"] for r in records]),
        }
        ratio = first.get("sampler_ratio")
        if ratio is not None and math.isfinite(ratio):  # the trainer against the sampler
            out["runs"][name].update(step1_sampler_ratio=ratio, outside_truncation_mean=float(
                np.mean([r.get("outside_truncation", 0.0) for r in records])))
        if all("reward/correctness" in r for r in records):
            out["runs"][name]["correctness_trend"] = reward_trend(
                [r["reward/correctness"] for r in records])
    b = out["runs"][base]
    for name in names[1:]:
        r = out["runs"][name]
        loss_diff = abs(r["step1_loss"] - b["step1_loss"])
        grad_rel = abs(r["step1_grad_norm"] - b["step1_grad_norm"]) / max(
            abs(b["step1_grad_norm"]), 1e-30)
        reward_diff = r["reward_last10"] - b["reward_last10"]
        noise = 2 * math.hypot(r["reward_last10_sem"], b["reward_last10_sem"])
        r.update({
            "step1_same_rollout": r["step1_reward"] == b["step1_reward"],
            "step1_loss_diff": loss_diff,
            "step1_loss_ok": loss_diff <= LOSS_ATOL + LOSS_RTOL * abs(b["step1_loss"]),
            "step1_grad_norm_rel_diff": grad_rel,
            "step1_grad_norm_ok": abs(r["step1_grad_norm"] - b["step1_grad_norm"])
            <= GRAD_NORM_RTOL * abs(b["step1_grad_norm"]) + GRAD_NORM_ATOL,
            "step_time_ratio": r["step_avg_last10_s"] / b["step_avg_last10_s"],
            "update_time_ratio": r["update_last10_s"] / b["update_last10_s"],
            "peak_memory_ratio": r["peak_bytes"] / b["peak_bytes"],
            "reward_last10_diff": reward_diff,
            "reward_noise_2se": noise,
            "reward_within_noise": abs(reward_diff) <= noise,
        })
    if evals and len(evals) == len(runs):
        out["eval"] = summarize_evals(evals)
    return out


def _eval_lines(ev: dict[str, Any], base: str) -> list[str]:
    """The held-out accuracy section of the report."""
    runs = ev["runs"]
    lines = ["## Held-out accuracy (greedy)", "",
             f"{ev['n']} held-out problems, the same for every run and both scorings. Standard "
             "errors of a difference are paired (the scorings share their problems; the "
             "unpaired one is in brackets).", "",
             "| | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    rows = [("before step 1", lambda r: f"{r['before']:.3f}"),
            ("after the last step", lambda r: f"{r['after']:.3f} (step {r['step']})"),
            ("gain (SE)", lambda r: f"{r['diff']:+.3f} ({r['se']:.3f} [{r['unpaired_se']:.3f}])"),
            ("problems whose score changed", lambda r: str(r["changed"])),
            ("gain > 2 SE", lambda r: "yes" if r["exceeds_2se"] else "no")]
    for label, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(r) for r in runs.values()) + " |")
    lines.append("")
    for name, r in list(runs.items())[1:]:
        v = r["vs_baseline"]
        lines.append(f"- {name} vs {base}, after: {v['diff']:+.3f} (2 SE = {2 * v['se']:.3f}): "
                     + ("within 2 SE" if not v["exceeds_2se"] else "outside 2 SE"))
    return lines + [""]


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:,.0f} MiB"


def markdown(summary: dict[str, Any], title: str, png: str | None) -> str:
    runs, base = summary["runs"], summary["baseline"]
    lines = [f"# {title}", ""]
    lines += ["| | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    rows = [("steps", "steps", str), ("step 1 loss", "step1_loss", lambda v: f"{v:.6g}"),
            ("step 1 grad norm", "step1_grad_norm", lambda v: f"{v:.6g}"),
            ("last-10 mean reward", "reward_last10", lambda v: f"{v:.3f}"),
            ("last-10 mean loss", "loss_last10", lambda v: f"{v:.4g}"),
            ("step_avg_last10_s", "step_avg_last10_s", lambda v: f"{v:.3f}"),
            ("last-10 mean update_s", "update_last10_s", lambda v: f"{v:.3f}"),
            ("mean rollout_s after step 1", "rollout_after_step1_s", _seconds),
            ("mean update_s after step 1", "update_after_step1_s", _seconds),
            ("peak memory (update)", "peak_bytes", _mib),
            ("process peak RSS", "peak_rss_bytes", _mib),
            (f"mean reward, first {EDGE} steps", "reward_trend", lambda t: f"{t['first']:.3f}"),
            (f"mean reward, last {EDGE} steps", "reward_trend", lambda t: f"{t['last']:.3f}"),
            ("reward slope per step (2 SE)", "reward_trend",
             lambda t: f"{t['slope']:+.4f} ({2 * t['slope_se']:.4f})"),
            ("reward rises (slope > 2 SE)", "reward_trend",
             lambda t: "yes" if t["rises"] else "no")]
    if all("correctness_trend" in r for r in runs.values()):
        rows.append((f"correctness, first {EDGE} -> last {EDGE} steps", "correctness_trend",
                     lambda t: f"{t['first']:.3f} -> {t['last']:.3f}"))
    if all("step1_sampler_ratio" in r for r in runs.values()):
        rows += [("step 1 mean ratio trainer/sampler", "step1_sampler_ratio",
                  lambda v: f"{v:.5f}"),
                 ("outside_truncation, mean of all steps", "outside_truncation_mean",
                  lambda v: f"{v:.2e}")]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(r[key]) for r in runs.values()) + " |")
    lines.append("")
    for name, r in list(runs.items())[1:]:
        lines += [f"## {name} vs {base}", "",
                  f"- step 1 rollouts identical: {r['step1_same_rollout']}",
                  f"- step 1 |loss difference| = {r['step1_loss_diff']:.3g} "
                  f"(gate {LOSS_ATOL:g} + {LOSS_RTOL:g}·|loss|): "
                  f"{'ok' if r['step1_loss_ok'] else 'FAIL'}",
                  f"- step 1 grad norm relative difference = "
                  f"{r['step1_grad_norm_rel_diff']:.3g} (gate {GRAD_NORM_RTOL:g}, or an absolute "
                  f"difference <= {GRAD_NORM_ATOL:g}): "
                  f"{'ok' if r['step1_grad_norm_ok'] else 'FAIL'}",
                  f"- step time ratio (step_avg_last10_s) = {r['step_time_ratio']:.3f}; "
                  f"update time ratio = {r['update_time_ratio']:.3f}",
                  f"- peak memory ratio = {r['peak_memory_ratio']:.3f}",
                  f"- last-10 reward difference = {r['reward_last10_diff']:+.3f} "
                  f"(2 standard errors: {r['reward_noise_2se']:.3f}): "
                  f"{'within noise' if r['reward_within_noise'] else 'outside noise'}", ""]
    if "eval" in summary:
        lines += _eval_lines(summary["eval"], base)
    lines.append("Peak memory is the device's peak_bytes_in_use where the backend reports it, "
                 "else the update step's compiled temp bytes (XLA's plan). The reward slope is "
                 "the least-squares line through the per-step means; its standard error "
                 "treats them as independent, which consecutive GRPO steps are not quite, so "
                 "read it with the curve.")
    if png:
        lines += ["", f"![A/B curves]({os.path.basename(png)})"]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict[str, Any]]], path: str, title: str,
         evals: dict[str, Any] | None = None) -> str:
    """Reward, correctness, loss, step time and memory per step for every run, and the
    held-out accuracy before and after (``evals``: :func:`summarize_evals`), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    _plot_evals(axes.flat[-1], evals)
    for ax, (key, label) in zip(axes.flat, PLOTS):
        for i, (name, records) in enumerate(runs.items()):
            steps = np.array([r["step"] for r in records if key in r])
            values = np.array([r[key] for r in records if key in r], np.float64)
            if key == "memory/peak_bytes":
                values = values / 2 ** 20
            color = f"C{i}"
            if key in SMOOTHED and len(values) >= SMOOTH:
                # the raw per-step values faint, their running mean over SMOOTH steps solid
                ax.plot(steps, values, color=color, alpha=0.3, marker=".")
                ax.plot(steps[SMOOTH - 1:], running_mean(values, SMOOTH), color=color,
                        label=f"{name} (mean of {SMOOTH})")
            else:
                ax.plot(steps, values, color=color, label=name,
                        marker="." if len(steps) < 40 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_evals(ax: Any, evals: dict[str, Any] | None) -> None:
    """Bars of each run's held-out accuracy before and after, with 2 binomial SE whiskers."""
    if not evals:
        ax.axis("off")
        ax.text(0.5, 0.5, "no held-out evaluation\n(eval.num_problems = 0)", ha="center",
                va="center", transform=ax.transAxes, color="0.4")
        return
    n = evals["n"]
    for i, (name, r) in enumerate(evals["runs"].items()):
        for j, (when, value) in enumerate((("before", r["before"]), ("after", r["after"]))):
            ax.bar(i + 0.4 * j - 0.2, value, width=0.38, color=f"C{i}",
                   alpha=0.45 if when == "before" else 0.95,
                   yerr=2 * binomial_se(value, n), capsize=4,
                   label=f"{name} {when}")
    ax.set_xticks(range(len(evals["runs"])), list(evals["runs"]), fontsize=8)
    ax.set_ylabel(f"held-out accuracy (n = {n}; bars: before, after; 2 SE)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def ab_report(run_dirs: dict[str, str], out_dir: str, title: str = "GRPO A/B"
              ) -> tuple[str, str, dict[str, Any]]:
    """Writes ``ab_report.md`` and ``ab_curves.png`` into ``out_dir``; returns
    ``(markdown path, png path, summary)``."""
    runs = {name: read_metrics(d) for name, d in run_dirs.items()}
    evals = {name: e for name, d in run_dirs.items() if (e := read_evals(d)) is not None}
    summary = summarize(runs, evals)
    os.makedirs(out_dir, exist_ok=True)
    png = plot(runs, os.path.join(out_dir, "ab_curves.png"), title, summary.get("eval"))
    md_path = os.path.join(out_dir, "ab_report.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(markdown(summary, title, png))
    return md_path, png, summary
