"""``proof.md``: the proof report's tables, ready for docs/benchmarks.md."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def to_markdown(report: dict[str, Any]) -> str:
    """Tables ready for docs/benchmarks.md."""
    m, fig = report["machine"], report["figures"]
    lines = [f"# grpo-kernels proof ({report['plan']} plan, {report['wall_s']:.0f} s)", "",
             f"Machine: {m.get('nvidia_smi') or m.get('device_kind', '?')}; backend "
             f"{m.get('backend', '?')}; jax {m.get('jax')}, jaxlib {m.get('jaxlib')}, torch "
             f"{m.get('torch')}, triton {m.get('triton')}, liger-kernel {m.get('liger-kernel')}; "
             f"Python {m.get('python')}.", ""]
    if fig["copy"]:
        c = fig["copy"]
        lines += [f"Copy bandwidth ({c.get('how')}, [{c.get('rows')}, {c.get('vocab')}] "
                  f"{c.get('dtype')}): {c['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s."]
        cb = fig.get("copy_pipelined")
        if cb:
            lines += [f"Back to back ({cb.get('how')}): "
                      f"{cb['pipelined_bytes_per_s'] / 1e12:.3f} TB/s."]
        lines += [""]
    lines += ["| phase | rc | wall s |", "|---|---|---|"]
    lines += [f"| {r['phase']} | {r['rc']} | {r['wall_s']:.1f} |" for r in report["phases"]]
    if fig["logits"]:
        lines += ["", "| shape | impl | median ms | first call s | process peak bytes | "
                  "TB/s (3 V b) | of copy | back to back ms | of copy, back to back |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for s, t in fig["logits"].items():
        for impl, r in t.items():
            lines.append(f"| {s} | {impl} | {_fmt(r['median_ms'])} | {_fmt(r['first_call_s'])}"
                         f" | {_fmt(r['peak_bytes_in_use'])} | {r['bytes_per_s'] / 1e12:.3f} | "
                         f"{_fmt(r['copy_fraction'])} | {_fmt(r.get('pipelined_ms'))} | "
                         f"{_fmt(r.get('pipelined_copy_fraction'))} |")
    if fig["layouts"]:
        lines += ["", "| N x V | GPU layout | statistics ms | statistics, of copy (V b) | "
                  "gradient ms | step ms | step, of copy (3 V b; one_pass 2 V b; xla_read V b) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {s} | {k} | {_fmt(v['stats_ms'])} | {_fmt(v['stats_copy_fraction'])} | "
                  f"{_fmt(v['grad_ms'])} | {_fmt(v['step_ms'])} | {_fmt(v['copy_fraction'])} |"
                  for s, t in fig["layouts"].items() for k, v in t.items()]
        lines += ["", f"GPU layout this run supports as the default: {_fmt(fig['gpu_layout'])} "
                  "(xla_copy's step is XLA's z + 1, the gradient kernel's bytes; xla_read's is "
                  "XLA's row max, the statistics kernel's).",
                  "", f"GPU one_pass=None this run supports: {_fmt(fig['gpu_one_pass'])}."]
    if fig["one_pass_tilings"]:
        lines += ["", "| N x V | one-pass tiling | tile | warps | programs | stages | L2 hints | "
                  "kernel ms | of copy (2 V b) |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {s} | {k} | {v['block_vocab']} | {v['num_warps']} | {v['programs']} | "
                  f"{_fmt(v['stages'])} | {_fmt(v['l2_hints'])} | {_fmt(v['kernel_ms'])} | "
                  f"{_fmt(v['copy_fraction'])} |"
                  for s, t in fig["one_pass_tilings"].items() for k, v in t.items()]
        lines += ["", f"One-pass kernel's fastest tiling (summed over the shapes): "
                  f"{_fmt(fig['one_pass_tiling'])} (one_pass: pallas_gpu_one_pass.plan_blocks's)."]
    if fig["tilings"]:
        lines += ["", "| N x V | aligned tiling | tile | warps | statistics ms | gradient ms |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {s} | {k} | {v['block_vocab']} | {v['num_warps']} | "
                  f"{_fmt(v['stats_ms'])} | {_fmt(v['grad_ms'])} |"
                  for s, t in fig["tilings"].items() for k, v in t.items()]
        lines += ["", f"Aligned layout's fastest tiling (statistics + gradient, summed over "
                  f"the shapes): {_fmt(fig['aligned_tiling'])} (aligned: pallas_gpu.plan_blocks's"
                  " tiling)."]
    if fig["memory"]:
        lines += ["", "| memory phase | peak bytes | peak / (logits + dlogits) |", "|---|---|---|"]
        lines += [f"| {k} | {_fmt(v['peak_bytes_in_use'])} | "
                  f"{_fmt(v['peak_over_logits_plus_dlogits'])} |" for k, v in fig["memory"].items()]
    if fig["lm_head"]:
        lines += ["", "| fused head | median ms | / reference | / 3 matmuls |", "|---|---|---|---|"]
        lines += [f"| {k} | {_fmt(v.get('median_step_ms'))} | "
                  f"{_fmt(v.get('median_step_ms_ratio_to_reference'))} | "
                  f"{_fmt(v.get('time_over_3_matmuls'))} |"
                  for k, v in fig["lm_head"].items() if k != "gradcheck"]
    if fig["gradcheck"]:
        lines += ["", "| gradcheck | passed | max rel dlogits |", "|---|---|---|"]
        lines += [f"| {k} | {v['passed']}/{v['checks']} | {_fmt(v['max_rel_diff_dlogits'])} |"
                  for k, v in fig["gradcheck"].items()]
    if fig["liger"]:
        lines += ["", "| Liger peer | Liger median ms (each variant) | ours / Liger |",
                  "|---|---|---|"]
        for k, v in fig["liger"].items():
            liger = v["liger"] or {}
            times = ({"": liger["median_ms"]} if "median_ms" in liger else
                     {name: r["median_ms"] for name, r in liger.items()})
            lines.append(f"| {k} | " + ", ".join(f"{n} {t:.4g}".strip() for n, t in times.items())
                         + " | " + ", ".join(f"{n} {r:.3f}" for n, r in
                                             (v["ours_over_liger"] or {}).items()) + " |")
    lines += step_markdown(fig)
    lines += ["", "| target | value | wanted | met | note |", "|---|---|---|---|---|"]
    lines += [f"| {t['name']} | {_fmt(t['value'])} | {t['target']} | {_fmt(t['met'])} | "
              f"{t['note']} |" for t in report["targets"]]
    lines += ["", f"impl='auto' entry this run supports: {_fmt(report['auto_impl'])} "
              "(docs/kernels.md says how to add it).", ""]
    return "\n".join(lines)


def _gb(v: Any) -> str:
    return "-" if v is None else f"{v / 1e9:.2f}"


def _logps_lines(logps: dict[str, Any], title: str) -> list[str]:
    """A log-prob pass table (:func:`~grpo_kernels.cli.proof_step.logps_table`), or none."""
    if not logps:
        return []
    return ["", f"| {title} | ms, alone | ms, back to back | time ratio | "
            "device peak GB | peak ratio | planned temp GB | mean log-prob | "
            "relative difference |", "|---|---|---|---|---|---|---|---|---|"] + [
        f"| {arm} | {_fmt(r['median_ms'])} | {_fmt(r['pipelined_ms'])} | "
        f"{_fmt(r.get('time_ratio'))} | {_gb(r['peak_bytes_in_use'])} | "
        f"{_fmt(r.get('peak_ratio'))} | {_gb(r.get('temp_bytes'))} | {_fmt(r['mean_logp'])} | "
        f"{_fmt(r.get('mean_logp_rel_diff'))} |" for arm, r in logps.items()]


def step_markdown(fig: dict[str, Any]) -> list[str]:
    """The step plan's tables (empty where its phases did not run)."""
    lines: list[str] = []
    for key, title, base in (("train_step", "trainer update", "logits-reference"),
                             ("tunix_step", "tunix update", "tunix"),
                             ("tunix_head_step", "tunix head update",
                              fig.get("tunix_head_base"))):
        table = fig.get(key) or {}
        if not table:
            continue
        r0 = next(iter(table.values()))
        lines += ["", f"{title}: {r0.get('layers')} layers, {r0.get('rows')} x "
                  f"({r0.get('prompt')} + {r0.get('completion')}) tokens, vocabulary "
                  f"{r0.get('vocab')}; time and peak ratios to {base}", "",
                  "| arm | ms, alone | ms, back to back | time ratio | device peak GB | "
                  "peak ratio | planned temp GB | compile s | first loss | first grad norm "
                  "| loss ok | grad norm ok |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {arm} | {_fmt(r['median_ms'])} | {_fmt(r['pipelined_ms'])} | "
                  f"{_fmt(r.get('time_ratio'))} | {_gb(r['peak_bytes_in_use'])} | "
                  f"{_fmt(r.get('peak_ratio'))} | {_gb(r['temp_bytes'])} | "
                  f"{_fmt(r['compile_s'])} | {_fmt(r['loss'])} | {_fmt(r['grad_norm'])} | "
                  f"{_fmt(r.get('loss_ok'))} | {_fmt(r.get('grad_norm_ok'))} |"
                  for arm, r in table.items()]
    for key, title in (("tunix_logps", "tunix log-prob pass"),
                       ("tunix_head_logps", "tunix head log-prob pass")):
        lines += _logps_lines(fig.get(key) or {}, title)
    peer = fig.get("head_peer") or {}
    if peer.get("ours") or peer.get("liger"):
        lines += ["", "| fused head vs Liger | median ms | planned temp GB | device / torch "
                  "peak GB | with the compile | time / Liger compiled | peak / Liger's lower |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| ours {k} | {_fmt(v.get('median_ms'))} | {_gb(v.get('temp_size_in_bytes'))}"
                  f" | {_gb(v.get('device_peak_bytes'))} | {_gb(v.get('peak_with_compile'))} | "
                  f"{_fmt(v.get('time_over_liger_compiled'))} | {_fmt(v.get('peak_over_liger'))} |"
                  for k, v in peer["ours"].items()]
        lines += [f"| Liger {k} | {_fmt(v.get('median_ms'))} | - | "
                  f"{_gb(v.get('torch_peak_allocated'))} | - | - | - |"
                  for k, v in peer["liger"].items()]
    ab = fig.get("ab") or {}
    if ab.get("runs"):
        lines += ["", f"trainer A/B ({ab.get('report')}, {ab.get('curves')}): means over the "
                  "steps after the first (which compiles)", "",
                  "| arm | rollout s | update s | device peak GB | update ratio | peak ratio | "
                  "step 1 loss ok | grad norm ok |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {arm} | {_fmt(r['rollout_after_step1_s'])} | "
                  f"{_fmt(r['update_after_step1_s'])} | {_gb(r['peak_bytes'])} | "
                  f"{_fmt(r.get('update_ratio'))} | {_fmt(r.get('peak_ratio'))} | "
                  f"{_fmt(r.get('step1_loss_ok'))} | {_fmt(r.get('step1_grad_norm_ok'))} |"
                  for arm, r in ab["runs"].items()]
    return lines
