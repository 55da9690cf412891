r"""What ``grpo-kernels proof`` derives from its phases: figures, targets, proof.json, proof.md.

Bandwidth: a logits-level step must read the logits twice and write the dlogits once,
``3 V b`` bytes per token (``b`` bytes per element); the one-pass kernels read them once from
HBM, ``2 V b`` (the GPU one's second read is meant to hit L2). An implementation's fraction is
``bytes / median time`` over the highest copy bandwidth the ``copy_bandwidth`` phase measured
(bytes read + written of an ``[N, V]`` copy). Each is also figured back to back (``calls``
calls, one wait: :func:`grpo_kernels.cli.bench.pipelined_ms`), the step's time over the
copy's, which leaves out JAX's per-call host cost on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_kernels.cli.proof_markdown import to_markdown
from grpo_kernels.cli.proof_step import (_ratio, _rows, _target, _variant, chunked_arm,
                                         head_peer,
                                         logps_table, step_table, step_targets)

SCHEMA_VERSION = 1
# Phases a backend may lack, recorded with their reason: rc 3 (the proof's scripts' "skipped"),
# nvidia-smi missing ("not run"), or the time budget ("skipped").
SKIP_CODES = (3, "not run", "skipped")
# The accelerator targets: a step moves its bytes at >= 70% of a device copy's rate, and peaks
# at <= logits + dlogits + 10%.
MIN_COPY_FRACTION = 0.70
MAX_PEAK_OVER_LOGITS_PLUS_DLOGITS = 1.10
MIN_HEAD_PEAK_SAVING_BYTES = 4e9

_RECORD_KEYS = {"phase": str, "rc": (int, str), "wall_s": (int, float), "argv": list,
                "rows": list}
_TOP_KEYS = {"schema_version": int, "plan": str, "wall_s": (int, float), "machine": dict,
             "phases": list, "figures": dict, "targets": list, "all_phases_ok": bool,
             "auto_impl": (str, type(None))}
_TARGET_KEYS = {"name": str, "value": (int, float, type(None)), "target": str,
                "met": (bool, type(None)), "note": str}


def validate(report: Any) -> None:
    """Raises ``ValueError`` naming the first key of ``report`` that is missing or mistyped."""
    def check(obj: Any, keys: dict[str, Any], where: str) -> None:
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        for key, types in keys.items():
            if key not in obj:
                raise ValueError(f"{where}.{key}: missing")
            allowed = types if isinstance(types, tuple) else (types,)
            value = obj[key]
            # bool is an int to isinstance; a flag where a number belongs is still wrong
            if not isinstance(value, allowed) or (isinstance(value, bool)
                                                  and bool not in allowed):
                names = " or ".join(t.__name__ for t in allowed)
                raise ValueError(f"{where}.{key}: expected {names}, got {value!r}")

    check(report, _TOP_KEYS, "proof")
    if report["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"proof.schema_version: expected {SCHEMA_VERSION}, "
                         f"got {report['schema_version']}")
    for i, rec in enumerate(report["phases"]):
        check(rec, _RECORD_KEYS, f"proof.phases[{i}]")
    for i, t in enumerate(report["targets"]):
        check(t, _TARGET_KEYS, f"proof.targets[{i}]")


def _bytes_per_element(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def machine(records: list[dict]) -> dict[str, Any]:
    """Versions (the ``versions`` phase) and the GPU line of nvidia-smi, when there is one."""
    out: dict[str, Any] = {}
    for r in records:
        if r["phase"] == "versions" and r["rows"]:
            out.update(r["rows"][0])
        if r["phase"] == "nvidia-smi" and r["rc"] == 0:
            out["nvidia_smi"] = (r.get("stdout_tail") or "").strip()
    return out


def figures(records: list[dict]) -> dict[str, Any]:
    """The proof's figures, from the phases' JSON rows (absent phases give absent figures)."""
    copies = [row for rows in _rows(records, "copy_bandwidth").values() for row in rows]
    copy = max(copies, key=lambda r: r["bandwidth_bytes_per_s"]) if copies else None
    backs = [r for r in copies if r.get("pipelined_bytes_per_s")]
    copy_back = max(backs, key=lambda r: r["pipelined_bytes_per_s"]) if backs else None

    def of_copy(bytes_per_s: float | None) -> float | None:
        return bytes_per_s / copy["bandwidth_bytes_per_s"] if bytes_per_s and copy else None

    def of_copy_back(moved: float, ms: float | None) -> float | None:
        if not ms or not copy_back:
            return None
        return moved / (ms * 1e-3) / copy_back["pipelined_bytes_per_s"]

    fig: dict[str, Any] = {"copy": copy, "copy_pipelined": copy_back, "logits": {},
                           "memory": {}, "lm_head": {},
                           "gradcheck": {}, "liger": {}, "layouts": {}, "tilings": {},
                           "one_pass_tilings": {}}
    for phase, rows in _rows(records, "gradcheck").items():
        fig["gradcheck"][phase] = {"checks": len(rows),
                                   "passed": sum(bool(r.get("passed")) for r in rows),
                                   "max_rel_diff_dlogits": max(
                                       (r["max_rel_diff_dlogits"] for r in rows), default=None)}
    for phase, rows in _rows(records, "bench_B").items():
        shape = {}
        for row in rows:
            tokens = row["batch"] * row["time"]
            moved = 3 * row["vocab"] * _bytes_per_element(row["dtype"]) * tokens
            bw = moved / (row["median_step_ms"] * 1e-3)
            shape[row["impl"]] = {
                "median_ms": row["median_step_ms"], "first_call_s": row["first_call_s"],
                "peak_bytes_in_use": row.get("peak_bytes_in_use"), "bytes_moved": moved,
                "bytes_per_s": bw, "copy_fraction": of_copy(bw),
                "pipelined_ms": row.get("pipelined_step_ms"),
                "pipelined_copy_fraction": of_copy_back(moved, row.get("pipelined_step_ms"))}
        fig["logits"][phase[len("bench_"):]] = shape
    for phase, rows in _rows(records, "memory_").items():
        for row in rows:
            fig["memory"][phase[len("memory_"):]] = {
                k: row.get(k) for k in ("peak_bytes_in_use", "peak_over_logits_plus_dlogits",
                                        "logits_plus_dlogits", "temp_size_in_bytes")}
    for row in _rows(records, "bench_lm_head").get("bench_lm_head", []):
        fig["lm_head"][row["impl"]] = {k: row.get(k) for k in (
            "median_step_ms", "median_step_ms_ratio_to_reference", "time_over_3_matmuls",
            "first_call_s", "temp_size_in_bytes")}
    for row in _rows(records, "head_gradcheck").get("head_gradcheck", []):
        fig["lm_head"]["gradcheck"] = {k: row.get(k) for k in (
            "passed", "bound", "dhidden_err_xla", "dW_err_xla")}
    for row in _rows(records, "gpu_layouts").get("gpu_layouts", []):
        fig["layouts"].setdefault(f"N{row['n']}_V{row['vocab']}", {})[row["layout"]] = {
            **{k: row.get(k) for k in ("stats_ms", "grad_ms", "step_ms",
                                       "dlogits_max_rel_diff_to_rows")},
            "stats_copy_fraction": of_copy(row.get("stats_bytes_per_s")),
            "copy_fraction": of_copy(row.get("step_bytes_per_s"))}
    fig["gpu_layout"] = gpu_layout(fig["layouts"])
    fig["gpu_one_pass"] = gpu_one_pass(fig["layouts"])
    for row in _rows(records, "gpu_tilings").get("gpu_tilings", []):
        fig["tilings"].setdefault(f"N{row['n']}_V{row['vocab']}", {})[row["layout"]] = {
            k: row.get(k) for k in ("block_vocab", "num_warps", "stats_ms", "grad_ms",
                                    "dlogits_max_rel_diff_to_planned")}
    fig["aligned_tiling"] = fastest(fig["tilings"], ("stats_ms", "grad_ms"))
    for row in _rows(records, "gpu_one_pass").get("gpu_one_pass", []):
        fig["one_pass_tilings"].setdefault(f"N{row['n']}_V{row['vocab']}", {})[
            row["layout"]] = {
            **{k: row.get(k) for k in ("block_vocab", "num_warps", "programs", "stages",
                                       "l2_hints", "kernel_ms",
                                       "dlogits_max_rel_diff_to_planned")},
            "copy_fraction": of_copy(row.get("kernel_bytes_per_s"))}
    fig["one_pass_tiling"] = fastest(fig["one_pass_tilings"], ("kernel_ms",))
    for phase, rows in _rows(records, "liger").items():
        for row in rows:
            fig["liger"][phase[len("liger_"):]] = {
                "liger": row.get("liger"), "ours_over_liger": row.get("ours_over_liger"),
                "loss_rel_diff": row.get("loss_rel_diff")}
    fig["train_step"] = step_table(records, "train_", "logits-reference")
    fig["tunix_step"] = step_table(records, "tunix_", "tunix")
    fig["tunix_logps"] = logps_table(records)
    fig["tunix_head_base"] = chunked_arm(records, "tunixhead_", "tunix")
    fig["tunix_head_step"] = step_table(records, "tunixhead_", fig["tunix_head_base"] or "")
    fig["tunix_head_logps"] = logps_table(records, "tunixhead_",
                                          chunked_arm(records, "tunixhead_", "logps-tunix") or "")
    fig["head_peer"] = head_peer(records, fig["memory"])
    for phase, rows in _rows(records, "compile_head_").items():
        for row in rows:
            name = _variant(phase[len("compile_head_"):])
            fig["head_peer"]["ours"].setdefault(name, {})["peak_with_compile"] = row.get(
                "peak_bytes_in_use")
    fig["ab"] = {}
    for row in _rows(records, "ab").get("ab", []):
        fig["ab"] = {"report": row.get("report"), "curves": row.get("curves"),
                     "baseline": row.get("baseline"),
                     "runs": {arm: {k: r.get(k) for k in (
                         "steps", "rollout_after_step1_s", "update_after_step1_s",
                         "step_avg_last10_s", "peak_bytes", "step1_loss", "step1_grad_norm",
                         "step1_loss_ok", "step1_grad_norm_ok")}
                         for arm, r in (row.get("runs") or {}).items()}}
        base = fig["ab"]["runs"].get(fig["ab"]["baseline"], {})
        for r in fig["ab"]["runs"].values():
            r["update_ratio"] = _ratio(r["update_after_step1_s"], base.get("update_after_step1_s"))
            r["peak_ratio"] = _ratio(r["peak_bytes"], base.get("peak_bytes"))
    return fig


def _winner(tables: list[dict[str, Any]], new: str, old: str, key: str) -> str | None:
    """``new`` when its ``key`` time beat ``old``'s in every table that has both, ``old`` when
    it lost in one, None when no table has both."""
    wins = [t[new][key] < t[old][key] for t in tables if new in t and old in t]
    return None if not wins else (new if all(wins) else old)


def gpu_layout(layouts: dict[str, Any]) -> str | None:
    """The ``PallasOptions.gpu_layout`` default this run supports: "aligned" when its step beat
    the rows layout's at every shape, "rows" when it lost at one, None when unmeasured."""
    return _winner(list(layouts.values()), "aligned", "rows", "step_ms")


def gpu_one_pass(layouts: dict[str, Any]) -> str | None:
    """What the gpu_layouts phase supports for ``PallasOptions.one_pass=None`` on GPU:
    "one_pass" when the one-pass step beat both two-kernel layouts' at every shape,
    "two kernels" when it lost at one, None when unmeasured."""
    tables = [{"one_pass": t["one_pass"],
               "two kernels": min((t[k] for k in ("rows", "aligned") if k in t),
                                  key=lambda v: v["step_ms"])}
              for t in layouts.values()
              if "one_pass" in t and ("rows" in t or "aligned" in t)]
    return _winner(tables, "one_pass", "two kernels", "step_ms")


def fastest(tilings: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """The tiling (a sweep's row name: the planner's, e.g. ``"aligned"``, or a given one's,
    ``"aligned_<tile>x<warps>"``) whose ``keys`` times, summed over the shapes, are least;
    only tilings timed at every shape count. None when unmeasured."""
    names = set.intersection(*(set(t) for t in tilings.values())) if tilings else set()
    totals = {name: sum(t[name][k] for t in tilings.values() for k in keys) for name in names}
    return min(sorted(totals), key=totals.__getitem__) if totals else None


def _issue_shapes(fig: dict[str, Any]) -> list[str]:
    """The logits shapes the accelerator targets name (``B.._T..``), not the aligned-vocabulary
    extra (``B.._T.._V..``)."""
    return [s for s in fig["logits"] if s.count("_") == 1]


def _speed_targets(label: str, shape: str, ms: dict[str, float], frac: float | None,
                   key: str = "pallas") -> list[dict[str, Any]]:
    """``label``'s time over xla's and the reference's (where ``ms`` has them) and its
    fraction of the copy bandwidth, at ``shape``; ``ms[key]`` is its own time."""
    out = []
    for other in ("xla", "reference"):
        if other in ms:
            r = ms[key] / ms[other]
            out.append(_target(f"{label} / {other} time, {shape}", r, "< 1", r < 1,
                               "" if r < 1 else f"{100 * (r - 1):.1f}% slower"))
    out.append(_copy_target(f"{label} fraction of copy bandwidth, {shape}", frac))
    return out


def _copy_target(name: str, frac: float | None) -> dict[str, Any]:
    """A fraction of the copy bandwidth against :data:`MIN_COPY_FRACTION`."""
    return _target(name, frac, f">= {MIN_COPY_FRACTION}",
                   None if frac is None else frac >= MIN_COPY_FRACTION,
                   "" if frac is None or frac >= MIN_COPY_FRACTION
                   else f"{100 * (MIN_COPY_FRACTION - frac):.1f} points short")


def targets(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """The accelerator targets, each met, missed (by how much, in ``note``) or unmeasured (None)."""
    out = []
    for s in _issue_shapes(fig):
        t = fig["logits"][s]
        if "pallas" not in t:
            continue
        out += _speed_targets("pallas", s, {k: v["median_ms"] for k, v in t.items()},
                              t["pallas"]["copy_fraction"])
        back = t["pallas"].get("pipelined_copy_fraction")
        if back is not None:
            out.append(_copy_target(
                f"pallas fraction of copy bandwidth, both back to back, {s}", back))
        mem = fig["memory"].get(f"pallas_{s}", {}).get("peak_over_logits_plus_dlogits")
        out.append(_target(f"pallas peak / (logits + dlogits), {s}", mem,
                           f"<= {MAX_PEAK_OVER_LOGITS_PLUS_DLOGITS}",
                           None if mem is None else mem <= MAX_PEAK_OVER_LOGITS_PLUS_DLOGITS,
                           "" if mem is not None else "no device memory_stats"))
    # The designs that are not the default yet, from the gpu_layouts phase's whole steps.
    for s, t in fig["layouts"].items():
        for key, label in (("aligned", "pallas (gpu_layout='aligned')"),
                           ("one_pass", "pallas (one_pass=True)")):
            if key in t and t[key]["step_ms"] is not None:
                out += _speed_targets(label, s, {k: v["step_ms"] for k, v in t.items()
                                                 if k in (key, "xla")
                                                 and v["step_ms"] is not None},
                                      t[key]["copy_fraction"], key=key)
    head = fig["lm_head"]
    if "xla" in head:
        r = head["xla"]["median_step_ms_ratio_to_reference"]
        out.append(_target("fused head / reference time", r, "< 1", r < 1))
    ref, ours = (fig["memory"].get(f"lm_head_{i}", {}).get("peak_bytes_in_use")
                 for i in ("reference", "xla"))
    saving = None if ref is None or ours is None else ref - ours
    peer = fig.get("head_peer") or {}
    step_plan = any(fig.get(k) for k in ("train_step", "tunix_step", "tunix_logps",
                                         "tunix_head_step", "tunix_head_logps", "ab")) or bool(
        peer.get("ours") or peer.get("liger"))
    if not step_plan:  # the op plans' head target (unmeasured: None, with the reason)
        out.append(_target("fused head peak saving vs reference (bytes)", saving,
                           f">= {MIN_HEAD_PEAK_SAVING_BYTES:.0e}",
                           None if saving is None else saving >= MIN_HEAD_PEAK_SAVING_BYTES,
                           "" if saving is not None else "no device memory_stats"))
    return out + step_targets(fig)


def auto_impl(fig: dict[str, Any]) -> str | None:
    """The ``MEASURED_DEFAULTS`` entry this run supports: "pallas" when it beat xla at every
    logits shape, "xla" when it lost at one, None when unmeasured."""
    return _winner([fig["logits"][s] for s in _issue_shapes(fig)], "pallas", "xla", "median_ms")


def build(plan: str, records: list[dict], wall_s: float) -> dict[str, Any]:
    fig = figures(records)
    ok = all(r["rc"] == 0 or r["rc"] in SKIP_CODES for r in records)
    return {"schema_version": SCHEMA_VERSION, "plan": plan, "wall_s": wall_s,
            "machine": machine(records), "phases": records, "figures": fig,
            "targets": targets(fig), "all_phases_ok": ok, "auto_impl": auto_impl(fig)}


def write(out: Path, plan: str, records: list[dict], wall_s: float) -> dict[str, Any]:
    """Builds, validates and writes ``proof.json`` and ``proof.md``; returns the report."""
    report = build(plan, records, wall_s)
    validate(report)
    (out / "proof.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "proof.md").write_text(to_markdown(report), encoding="utf-8")
    return report
