"""The step plan's figures and targets (the trainer's and tunix's updates, the log-prob
pass, the fused head beside Liger), and the phase-row helpers the report shares with them."""

from __future__ import annotations

from typing import Any

# The step plan's targets: the trainer's update of fused-xla and logits-pallas against
# logits-reference's (time back to back, device peak), the fused head against Liger's fused loss
# (device peak against the lower of Liger's two peaks; time against Liger compiled).
MAX_FUSED_STEP_TIME = 0.8
MAX_FUSED_STEP_PEAK = 0.5
MAX_PALLAS_STEP_TIME = 0.9
MAX_HEAD_TIME_OVER_LIGER_COMPILED = 0.5
# The tunix plan's: ours with the adapter's defaults against tunix's development head with its
# own chunking (the plan's chunked arm: 256 positions), update and log-prob pass (device peak,
# time back to back).
MAX_OURS_OVER_CHUNKED_PEAK = 0.5
MAX_OURS_OVER_CHUNKED_TIME = 1.0
# First-step agreement of an arm with the baseline arm: gradcheck's bfloat16 gates
# (cli.gradcheck.DEFAULT_TOLERANCES), the loss's absolute + relative and the gradient norm's
# relative (dlogits_rtol).
STEP_LOSS_ATOL = STEP_LOSS_RTOL = 1e-4
STEP_GRAD_NORM_RTOL = 1e-2
STEP_KEYS = ("median_ms", "pipelined_ms", "peak_bytes_in_use", "bytes_in_use_before",
             "temp_bytes", "compile_s", "loss", "grad_norm", "layers", "rows", "prompt",
             "completion", "vocab")


def _rows(records: list[dict], prefix: str) -> dict[str, list[dict]]:
    return {r["phase"]: r["rows"] for r in records if r["phase"].startswith(prefix)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _target(name: str, value: float | None, target: str, met: bool | None,
            note: str = "") -> dict[str, Any]:
    return {"name": name, "value": value, "target": target, "met": met, "note": note}


def step_table(records: list[dict], prefix: str, baseline: str) -> dict[str, Any]:
    """The rows of the step phases named ``prefix + arm``, by arm, each with its ratios to
    ``baseline``'s (time back to back, device peak) and its first step against it."""
    out = {phase[len(prefix):]: {k: rows[0].get(k) for k in STEP_KEYS}
           for phase, rows in _rows(records, prefix).items()
           if rows and rows[0].get("op") != "tunix-logps"}
    base = out.get(baseline)
    for arm, r in out.items():
        if base is None:
            break
        r["time_ratio"] = _ratio(r["pipelined_ms"], base["pipelined_ms"])
        r["peak_ratio"] = _ratio(r["peak_bytes_in_use"], base["peak_bytes_in_use"])
        r["loss_abs_diff"] = abs(r["loss"] - base["loss"])
        r["loss_ok"] = r["loss_abs_diff"] <= STEP_LOSS_ATOL + STEP_LOSS_RTOL * abs(base["loss"])
        r["grad_norm_rel_diff"] = abs(r["grad_norm"] - base["grad_norm"]) / max(
            abs(base["grad_norm"]), 1e-30)
        r["grad_norm_ok"] = r["grad_norm_rel_diff"] <= STEP_GRAD_NORM_RTOL
    return out


def logps_table(records: list[dict], prefix: str = "tunix_",
                baseline: str = "logps-tunix") -> dict[str, Any]:
    """The log-prob pass rows (``op == "tunix-logps"``) of the phases named ``prefix + arm``,
    by arm, with the time and peak ratios to ``baseline``'s pass and the relative difference
    of the mean log-prob."""
    out = {}
    for phase, rows in _rows(records, prefix).items():
        if rows and rows[0].get("op") == "tunix-logps":
            out[phase[len(prefix):]] = {k: rows[0].get(k) for k in (
                "median_ms", "pipelined_ms", "peak_bytes_in_use", "temp_bytes", "mean_logp")}
    base = out.get(baseline)
    for r in out.values():
        if base is not None:
            r["time_ratio"] = _ratio(r["pipelined_ms"], base["pipelined_ms"])
            r["peak_ratio"] = _ratio(r["peak_bytes_in_use"], base["peak_bytes_in_use"])
            if r["mean_logp"] is not None:  # None: the no-head floor, which has none
                r["mean_logp_rel_diff"] = abs(r["mean_logp"] - base["mean_logp"]) / max(
                    abs(base["mean_logp"]), 1e-30)
    return out


def chunked_arm(records: list[dict], prefix: str, arm: str) -> str | None:
    """The label of the first phase ``prefix + arm + "-chunkN"`` in ``records`` (tunix's own
    arm ``arm`` with its chunking), or None."""
    stem = prefix + arm + "-chunk"
    return next((r["phase"][len(prefix):] for r in records if r["phase"].startswith(stem)),
                None)


def head_peer(records: list[dict], memory: dict[str, Any]) -> dict[str, Any]:
    """The fused head beside Liger (the ``liger_head_modes`` phase): our variants' times and
    plans, Liger's times and torch peaks, and the device peaks of the variants that the
    ``memory_head_<dweight>[_<rows>]`` phases measured, each in its own process."""
    rows = _rows(records, "liger_head_modes").get("liger_head_modes") or [{}]
    row = rows[0]
    liger = row.get("liger") or {}
    ours = {name: dict(v) for name, v in (row.get("ours") or {}).items()}
    for key, m in memory.items():
        if key.startswith("head_"):
            ours.setdefault(_variant(key[len("head_"):]), {})["device_peak_bytes"] = m.get(
                "peak_bytes_in_use")
    peaks = [v["torch_peak_allocated"] for v in liger.values() if v.get("torch_peak_allocated")]
    compiled = liger.get("compiled", {}).get("median_ms")
    for v in ours.values():
        v["time_over_liger_compiled"] = _ratio(v.get("median_ms"), compiled)
        v["peak_over_liger"] = _ratio(v.get("device_peak_bytes"), min(peaks) if peaks else None)
    return {"ours": ours, "liger": liger, "liger_min_peak": min(peaks) if peaks else None,
            "loss_rel_diff": row.get("loss_rel_diff"), "torch_matmul_ms": row.get(
                "torch_matmul_ms")}


def _variant(key: str) -> str:
    """A head-memory phase's ``<dweight>[_<rows>]`` as liger_peer.py names the variant."""
    dweight, _, rows = key.partition("_")
    return f"xla-{dweight}" + (f"@{rows}" if rows else "")


def step_targets(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """The step plan's numbers, each met, missed or unmeasured (None)."""
    out = []
    train = fig.get("train_step", {})
    for arm, key, wanted in (("fused-xla", "time_ratio", MAX_FUSED_STEP_TIME),
                             ("fused-xla", "peak_ratio", MAX_FUSED_STEP_PEAK),
                             ("logits-pallas", "time_ratio", MAX_PALLAS_STEP_TIME)):
        if arm in train and "logits-reference" in train:
            v = train[arm].get(key)
            what = "time, back to back" if key == "time_ratio" else "device peak"
            out.append(_target(f"update step {arm} / logits-reference {what}", v,
                               f"<= {wanted}", None if v is None else v <= wanted))
    for table, base in ((train, "logits-reference"), (fig.get("tunix_step", {}), "tunix"),
                        (fig.get("tunix_head_step", {}), fig.get("tunix_head_base"))):
        for arm, r in table.items():
            if arm == base or "loss_ok" not in r or arm == "no-head":  # a floor, not a loss
                continue
            out.append(_target(f"first step loss, {arm} vs {base}", r["loss_abs_diff"],
                               f"<= {STEP_LOSS_ATOL} + {STEP_LOSS_RTOL}|loss|", r["loss_ok"]))
            out.append(_target(f"first step gradient norm, {arm} vs {base} (relative)",
                               r["grad_norm_rel_diff"], f"<= {STEP_GRAD_NORM_RTOL}",
                               r["grad_norm_ok"]))
    for key, ours, what in (("tunix_head_step", "fused-xla", "update"),
                            ("tunix_head_logps", "logps-ours", "log-prob pass")):
        r = (fig.get(key) or {}).get(ours) or {}
        base = fig.get("tunix_head_base") or ""
        for ratio, wanted, label in (("peak_ratio", MAX_OURS_OVER_CHUNKED_PEAK, "device peak"),
                                     ("time_ratio", MAX_OURS_OVER_CHUNKED_TIME,
                                      "time, back to back")):
            if r.get(ratio) is not None:
                out.append(_target(f"tunix head {what}: ours / {base} {label}",
                                   r[ratio], f"<= {wanted}", r[ratio] <= wanted))
    peer = fig.get("head_peer", {})
    for name, v in sorted(peer.get("ours", {}).items()):
        if v.get("peak_over_liger") is not None:
            r = v["peak_over_liger"]
            out.append(_target(f"fused head {name} device peak / Liger's lower peak", r, "<= 1",
                               r <= 1))
        if v.get("time_over_liger_compiled") is not None and name != "reference":
            r = v["time_over_liger_compiled"]
            out.append(_target(f"fused head {name} time / Liger compiled", r,
                               f"<= {MAX_HEAD_TIME_OVER_LIGER_COMPILED}",
                               r <= MAX_HEAD_TIME_OVER_LIGER_COMPILED))
    return out
