"""``grpo-kernels proof``: its plans, its report on a recorded GPU run, its schema, and the dry
run that CI executes on the CPU.

A lent GPU comes with little device time, so the proof must work the first time it runs
there: the dry run executes every phase here, with pallas interpreted and the phases that need
a GPU (device memory_stats, the Liger peers) skipped with their reason.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_kernels.cli import proof, proof_plans, proof_report, proof_run
from grpo_kernels.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIXTURES = Path(__file__).parent / "fixtures"  # recorded H100 runs the report is built from
ALL = set(proof_plans.GROUPS)


def _names(plan):
    return [n for n, _, _ in proof.phases(ALL, plan)]


def test_plans_pick_their_groups():
    """The proof leaves the layouts group to its own plan (with it the proof would
    not fit in 8 minutes); the dry run runs every group."""
    def names(plan):
        return [n for n, _, _ in proof.phases(set(plan.groups), plan)]
    assert not any(n.startswith("gpu_") for n in names(proof_plans.REAL) + names(proof_plans.SHORT))
    assert [n for n in names(proof_plans.LAYOUTS) if n.startswith("gpu_")] == [
        "gpu_layouts", "gpu_one_pass", "gpu_tilings"]
    assert set(names(proof_plans.LAYOUTS)) == {"nvidia-smi", "versions", "copy_bandwidth",
                                         "gpu_layouts", "gpu_one_pass", "gpu_tilings"}
    assert set(proof_plans.DRY.groups) == set(proof_plans.GROUPS)
    argv = dict((n, a) for n, a, _ in proof.phases({"layouts"}, proof_plans.LAYOUTS))["gpu_one_pass"]
    assert argv[argv.index("--one-pass-tilings") + 1] == (
        "16384x16x132x1,16384x16x132x3,8192x16x132x2,8192x8x264x1,8192x8x132x2,"
        "16384x16x132x2x0")
    # Every tiling of the plan parses as the sweep's script parses it.
    from grpo_kernels.proof import gpu_layouts
    assert len(gpu_layouts.one_pass_list(argv[argv.index("--one-pass-tilings") + 1])) == 6


def test_every_plan_runs_the_same_phases():
    strip = lambda names: [n.split("_B")[0] for n in names]  # noqa: E731
    assert strip(_names(proof_plans.REAL)) == strip(_names(proof_plans.DRY))
    assert set(_names(proof_plans.SHORT)) < set(_names(proof_plans.REAL))
    assert len(set(_names(proof_plans.REAL))) == len(_names(proof_plans.REAL))


def _recorded(name: str) -> list[dict]:
    records = json.loads((FIXTURES / name).read_text())
    for r in records:  # the runner of the oldest recorded runs kept no argv
        r.setdefault("argv", [])
    return records


def test_report_of_the_recorded_h100_runs():
    """The report's figures and targets on two real H100 runs (fixtures/): a build where
    pallas beat xla, and a build whose xla gradient had regressed."""
    good = proof_report.build("real", _recorded("h100_proof_pallas_ahead.json"), 450.0)
    bad = proof_report.build("real", _recorded("h100_proof_xla_regressed.json"), 393.0)
    for report in (good, bad):
        proof_report.validate(report)
        assert report["all_phases_ok"]
    assert good["auto_impl"] == "pallas" and bad["auto_impl"] == "xla"
    targets = {t["name"]: t for t in bad["targets"]}
    t = targets["pallas / xla time, B1_T2048"]
    assert t["met"] is False and t["value"] == pytest.approx(1.561 / 1.408, rel=1e-3)
    assert t["note"] == "10.8% slower"
    copy_frac = targets["pallas fraction of copy bandwidth, B4_T1024"]
    # 3 V b bytes per token over the median, against the torch copy's 2.867 TB/s
    want = 3 * 151643 * 2 * 4096 / 2.797086e-3 / 2.866957e12
    assert copy_frac["value"] == pytest.approx(want, rel=1e-4) and copy_frac["met"] is False
    assert targets["pallas peak / (logits + dlogits), B4_T1024"]["met"] is True
    saving = targets["fused head peak saving vs reference (bytes)"]
    assert saving["value"] == 15070466048 - 9536406016 and saving["met"] is True
    md = proof_report.to_markdown(bad)
    assert "| B4_T1024 | pallas | 2.797 |" in md and "10.8% slower" in md


def test_the_h100_proof_json_validates():
    """A proof.json that `make gpu-proof` wrote on an H100 (fixtures/, the default plan)
    against the current schema, and rebuilt from its own phase records."""
    report = json.loads((FIXTURES / "h100_proof_real_plan.json").read_text())
    proof_report.validate(report)
    assert report["plan"] == "real" and report["all_phases_ok"]
    # That run had one more bench, at the aligned vocabulary, where the layouts group (a plan
    # of its own since) now times the layouts.
    now = [n for n, _, _ in proof.phases(set(proof_plans.REAL.groups), proof_plans.REAL)]
    at = now.index("bench_B4_T1024") + 1
    then = now[:at] + ["bench_B1_T2048_V151936"] + now[at:]
    assert [r["phase"] for r in report["phases"]] == then
    assert report["machine"]["backend"] == "gpu"
    rebuilt = proof_report.build(report["plan"], report["phases"], report["wall_s"])
    assert rebuilt["targets"] == report["targets"] and rebuilt["auto_impl"] == "pallas"


def test_report_of_the_back_to_back_h100_run():
    """The recorded run with the aligned layout the default: the step and the copy each timed
    alone and back to back; the back-to-back fraction divides by the back-to-back copy."""
    report = json.loads((RESULTS / "gpu_proof_back_to_back_h100_2026-11-24.json").read_text())
    proof_report.validate(report)
    rebuilt = proof_report.build(report["plan"], report["phases"], report["wall_s"])
    assert rebuilt["targets"] == report["targets"]
    fig = rebuilt["figures"]
    copy_back = fig["copy_pipelined"]
    assert copy_back["how"] == "torch copy_"
    row = fig["logits"]["B1_T2048"]["pallas"]
    want = 3 * 151643 * 2 * 2048 / (row["pipelined_ms"] * 1e-3)
    assert row["pipelined_copy_fraction"] == pytest.approx(
        want / copy_back["pipelined_bytes_per_s"])
    targets = {t["name"]: t for t in rebuilt["targets"]}
    for shape in ("B1_T2048", "B4_T1024"):
        assert targets[f"pallas fraction of copy bandwidth, both back to back, {shape}"]["met"]
    # Timed alone, one call at a time, B=1, T=2048 stays short (JAX's per-call host cost).
    assert targets["pallas fraction of copy bandwidth, B1_T2048"]["met"] is False
    assert "| back to back ms | of copy, back to back |" in proof_report.to_markdown(rebuilt)


def _layout_record(step_ms: dict[tuple[int, str], float]) -> dict:
    rows = [{"n": n, "vocab": 151643, "layout": layout, "stats_ms": 0.1, "grad_ms": 0.2,
             "step_ms": ms, "step_bytes_per_s": 3 * n * 151643 * 2 / (ms * 1e-3),
             "stats_bytes_per_s": n * 151643 * 2 / 1e-4}
            for (n, layout), ms in step_ms.items()]
    return {"phase": "gpu_layouts", "rc": 0, "wall_s": 1.0, "argv": [], "rows": rows}


def test_report_picks_the_gpu_layout_only_where_it_won_everywhere():
    copy_rec = {"phase": "copy_bandwidth", "rc": 0, "wall_s": 1.0, "argv": [],
                "rows": [{"bandwidth_bytes_per_s": 3e12}]}
    both = {(2048, "rows"): 1.3, (2048, "aligned"): 1.0, (4096, "rows"): 2.3,
            (4096, "aligned"): 1.9}
    won = proof_report.build("real", [copy_rec, _layout_record(both)], 1.0)
    proof_report.validate(won)
    assert won["figures"]["gpu_layout"] == "aligned"
    frac = won["figures"]["layouts"]["N2048_V151643"]["aligned"]["copy_fraction"]
    assert frac == pytest.approx(3 * 2048 * 151643 * 2 / 1e-3 / 3e12)
    stats = won["figures"]["layouts"]["N2048_V151643"]["aligned"]["stats_copy_fraction"]
    assert stats == pytest.approx(2048 * 151643 * 2 / 1e-4 / 3e12)
    assert "| N4096_V151643 | aligned | 0.1 | 4.141 | 0.2 | 1.9 |" in proof_report.to_markdown(won)
    lost = proof_report.build("real", [_layout_record({**both, (4096, "aligned"): 2.4})], 1.0)
    assert lost["figures"]["gpu_layout"] == "rows"
    assert lost["figures"]["layouts"]["N2048_V151643"]["rows"]["copy_fraction"] is None
    assert proof_report.build("real", [], 1.0)["figures"]["gpu_layout"] is None
    # The aligned targets come from the same phase's steps: 1.9 ms of 4096 rows is short of 70%.
    targets = {t["name"]: t for t in won["targets"]}
    short = targets["pallas (gpu_layout='aligned') fraction of copy bandwidth, N4096_V151643"]
    assert short["met"] is False and "points short" in short["note"]
    assert won["figures"]["layouts"]["N4096_V151643"]["aligned"]["step_ms"] == 1.9


def test_report_supports_the_one_pass_kernel_only_where_it_beat_both_layouts():
    copy_rec = {"phase": "copy_bandwidth", "rc": 0, "wall_s": 1.0, "argv": [],
                "rows": [{"bandwidth_bytes_per_s": 3e12}]}
    steps = {(2048, "rows"): 1.3, (2048, "aligned"): 1.0, (2048, "one_pass"): 0.55,
             (4096, "rows"): 2.3, (4096, "aligned"): 1.9, (4096, "one_pass"): 1.2}
    rec = _layout_record(steps)
    for row in rec["rows"]:  # the one-pass step moves 2 V b bytes per token
        if row["layout"] == "one_pass":
            row["step_bytes_per_s"] *= 2 / 3
    won = proof_report.build("real", [copy_rec, rec], 1.0)
    proof_report.validate(won)
    assert won["figures"]["gpu_one_pass"] == "one_pass"
    targets = {t["name"]: t for t in won["targets"]}
    frac = targets["pallas (one_pass=True) fraction of copy bandwidth, N2048_V151643"]
    assert frac["value"] == pytest.approx(2 * 2048 * 151643 * 2 / 0.55e-3 / 3e12)
    assert frac["met"] is True
    assert "GPU one_pass=None this run supports: one_pass." in proof_report.to_markdown(won)
    # Beating the rows layout is not enough: it must beat the faster of the two.
    lost = proof_report.build("real", [_layout_record({**steps, (4096, "one_pass"): 2.0})], 1.0)
    assert lost["figures"]["gpu_one_pass"] == "two kernels"
    assert proof_report.build("real", [_layout_record(
        {k: v for k, v in steps.items() if k[1] != "one_pass"})], 1.0)[
        "figures"]["gpu_one_pass"] is None


def test_report_names_the_one_pass_tiling_timed_at_every_shape():
    rows = [{"n": n, "vocab": 151643, "layout": name, "block_vocab": 8192, "num_warps": 8,
             "programs": 132, "stages": 2, "l2_hints": True, "kernel_ms": ms,
             "kernel_bytes_per_s": 1e12,
             "dlogits_max_rel_diff_to_planned": 0.0}
            for (n, name), ms in {(2048, "one_pass"): 0.5, (4096, "one_pass"): 1.0,
                                  (2048, "one_pass_8192x8x264"): 0.4,
                                  (4096, "one_pass_8192x8x264"): 0.9,
                                  (2048, "one_pass_32768x32x132"): 0.1}.items()]
    copy_rec = {"phase": "copy_bandwidth", "rc": 0, "wall_s": 1.0, "argv": [],
                "rows": [{"bandwidth_bytes_per_s": 2e12}]}
    report = proof_report.build("real", [copy_rec, {"phase": "gpu_one_pass", "rc": 0,
                                                    "wall_s": 1.0, "argv": [], "rows": rows}],
                                1.0)
    proof_report.validate(report)
    fig = report["figures"]
    assert fig["one_pass_tiling"] == "one_pass_8192x8x264"
    assert fig["one_pass_tilings"]["N2048_V151643"]["one_pass"]["copy_fraction"] == 0.5
    md = proof_report.to_markdown(report)
    assert "| N2048_V151643 | one_pass_8192x8x264 | 8192 | 8 | 132 | 2 | True | 0.4 | 0.5 |" in md
    assert "One-pass kernel's fastest tiling (summed over the shapes): one_pass_8192x8x264" in md


def _tiling_record(kernel_ms: dict[tuple[int, str], float]) -> dict:
    rows = [{"n": n, "vocab": 151643, "layout": name, "block_vocab": 4096, "num_warps": 4,
             "stats_ms": ms / 2, "grad_ms": ms / 2, "dlogits_max_rel_diff_to_planned": 0.0}
            for (n, name), ms in kernel_ms.items()]
    return {"phase": "gpu_tilings", "rc": 0, "wall_s": 1.0, "argv": [], "rows": rows}


def test_report_names_the_aligned_tiling_timed_at_every_shape():
    """Least statistics + gradient time summed over the shapes; a tiling missing at one shape
    (the phase ran out of time) does not count."""
    tilings = {(2048, "aligned"): 0.3, (4096, "aligned"): 0.5,
               (2048, "aligned_4096x4"): 0.25, (4096, "aligned_4096x4"): 0.6,
               (2048, "aligned_8192x8"): 0.2, (4096, "aligned_8192x8"): 0.45,
               (2048, "aligned_16384x8"): 0.1}
    report = proof_report.build("real", [_tiling_record(tilings)], 1.0)
    proof_report.validate(report)
    assert report["figures"]["aligned_tiling"] == "aligned_8192x8"
    slower = {k: v + (k[1] != "aligned") for k, v in tilings.items()}
    assert proof_report.build("real", [_tiling_record(slower)], 1.0)[
        "figures"]["aligned_tiling"] == "aligned"
    md = proof_report.to_markdown(report)
    assert "| N2048_V151643 | aligned_8192x8 | 4096 | 4 | 0.1 | 0.1 |" in md
    assert "fastest tiling (statistics + gradient, summed over the shapes): aligned_8192x8" in md
    assert proof_report.build("real", [], 1.0)["figures"]["aligned_tiling"] is None


def test_validate_names_the_bad_key():
    report = proof_report.build("dry", [], 1.0)
    proof_report.validate(report)
    broken = copy.deepcopy(report)
    del broken["machine"]
    with pytest.raises(ValueError, match=r"proof\.machine: missing"):
        proof_report.validate(broken)
    broken = copy.deepcopy(report)
    broken["all_phases_ok"] = 1
    with pytest.raises(ValueError, match=r"proof\.all_phases_ok: expected bool"):
        proof_report.validate(broken)
    broken = copy.deepcopy(report)
    broken["phases"] = [{"phase": "x", "rc": 0, "wall_s": True, "argv": [], "rows": []}]
    with pytest.raises(ValueError, match=r"proof\.phases\[0\]\.wall_s: expected int or float"):
        proof_report.validate(broken)


@pytest.mark.parametrize("argv,match", [
    (["--groups", "env,gpu"], "--groups must be a comma-separated subset"),
    (["--groups", ""], "--groups must be a comma-separated subset"),
    (["--budget-s", "0"], "--budget-s must be > 0"),
])
def test_bad_arguments_name_the_flag(tmp_path, capsys, argv, match):
    assert main(["proof", "--out", str(tmp_path), "--dry-run", *argv]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "proof.json").exists()


_BLOCKED = ("flax", "optax", "orbax", "wandb", "gguf", "tokenizers", "math_verify",
            "safetensors", "matplotlib", "jinja2", "tunix", "torch", "transformers")
# Each argv set in turn in one process (a process each cost the suite 20 s): an import of a
# blocked package anywhere fails the set that made it; each set must end with exit code 0.
_BLOCKER = f"""
import importlib.abc, runpy, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {_BLOCKED!r}:
            raise ImportError("the loss/bench path imported " + name)
sys.meta_path.insert(0, Blocker())
sets, argv = [[]], sys.argv[1:]
for a in argv:
    sets.append([]) if a == "--then" else sets[-1].append(a)
for args in sets:
    sys.argv = list(args)
    try:
        if args[0] == "-m":
            runpy.run_module("grpo_kernels.cli.main", run_name="__main__")
        elif args[0].endswith(".py"):
            runpy.run_path(args[0], run_name="__main__")
        else:
            runpy.run_module(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise SystemExit(f"{{args}}: exit code {{e.code}}")
    print("done:", args, flush=True)
"""

PROOF_PATH = [
    ["-m", "gradcheck", "--impl", "pallas", "--batch", "1", "--time", "4", "--vocab", "64"],
    ["-m", "bench", "--impl", "xla,pallas", "--batch", "1", "--time", "4", "--vocab", "64",
     "--iters", "1", "--warmup", "0", "--format", "json"],
    ["-m", "bench-lm-head", "--impl", "xla", "--batch", "1", "--time", "4", "--hidden", "8",
     "--vocab", "64", "--iters", "1", "--warmup", "0", "--format", "json"],
    ["grpo_kernels.proof.head_gradcheck", "--batch", "1", "--time", "4", "--hidden", "8",
     "--vocab", "64"],
    ["grpo_kernels.proof.copy_bandwidth", "--rows", "4", "--vocab", "64"],
    ["grpo_kernels.proof.gpu_layouts", "--shapes", "4x64", "--iters", "1", "--rounds", "1"],
    ["benchmarks/probes/gpu_ncu_step.py", "--impl", "xla", "--batch", "1", "--time", "4",
     "--vocab", "64", "--warmup", "1", "--iters", "2"],
]


def test_the_proof_path_needs_no_trainer_dependency():
    """What the accelerator host lacks (flax, optax, wandb, ... and torch) is never imported
    by any of the proof's phases (gradcheck, bench, bench-lm-head, head_gradcheck,
    copy_bandwidth, gpu_layouts, gpu_ncu_step), each run to a clean exit."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT / "src"))
    argv = [a for args in PROOF_PATH for a in ("--then", *args)][1:]
    r = subprocess.run([sys.executable, "-c", _BLOCKER, *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("done:") == len(PROOF_PATH), r.stdout[-2000:]


def test_a_phase_in_process_is_its_module_and_leaves_no_settings_behind(tmp_path):
    import jax
    step = proof._script("gpu_train_step.py", "--arm", "fused-xla")
    assert proof_run.in_process_main(step).__module__ == "grpo_kernels.proof.gpu_train_step"
    assert proof_run.in_process_main(proof._cli("bench")).__module__ == "grpo_kernels.cli.main"
    for own in (["nvidia-smi"], [sys.executable, "-c", "pass"],
                [*step, "--tunix-path", str(tmp_path)]):  # another tunix: a process of its own
        assert proof_run.in_process_main(own) is None
    cache, env = jax.config.jax_compilation_cache_dir, dict(os.environ)
    cmd = proof._script("device_memory.py", "--op", "lm_head", "--impl", "xla", "--batch", 1,
                        "--time", 4, "--hidden", 8, "--vocab", 16, "--compile-cache",
                        str(tmp_path / "cache"), "--buffer-report", str(tmp_path / "b.txt"))
    rec = proof_run.run_phase_in_process("memory", cmd, proof_run.in_process_main(cmd))
    assert rec["rc"] == 3 and "skipped" in rec["stderr"]  # no memory_stats on the CPU
    assert jax.config.jax_compilation_cache_dir == cache and dict(os.environ) == env
    bad = proof_run.run_phase_in_process("bad", proof._cli("bench", "--impl", "nope"),
                                         proof_run.in_process_main(proof._cli("bench")))
    assert bad["rc"] == 2 and "--impl" in bad["stderr"]


@pytest.mark.slow
def test_dry_run_records_every_phase(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "grpo_kernels.cli.main", "proof", "--dry-run",
                        "--in-process", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "proof.json").read_text())
    proof_report.validate(report)
    assert report["plan"] == "dry" and report["all_phases_ok"]
    assert report["machine"]["backend"] == "cpu" and report["machine"]["jax"]
    records = {rec["phase"]: rec for rec in report["phases"]}
    assert list(records) == _names(proof_plans.DRY)
    assert (tmp_path / "proof.log").read_text().count("=====") == len(records)
    for name, rec in records.items():
        if name.startswith(("gradcheck", "head_gradcheck")):
            assert rec["rc"] == 0 and rec["rows"] and all(row["passed"] for row in rec["rows"])
        elif name.startswith("bench"):
            assert rec["rc"] == 0
            impls = [row["impl"] for row in rec["rows"]]
            assert impls[:3] == (["reference", "xla", "pallas"] if name.startswith("bench_B")
                                 else ["reference", "xla", "matmul"])
            assert all(row["median_step_ms"] > 0 for row in rec["rows"])
        elif name.startswith(("memory", "liger")):  # no memory_stats, no CUDA here
            assert rec["rc"] == 3 and "skipped" in rec["stderr_tail"]
        elif name == "nvidia-smi":
            assert rec["rc"] in (0, "not run")
        else:
            assert rec["rc"] == 0, name
    assert records["gradcheck_family_pallas"]["rows"][0]["impl"] == "pallas"
    # the dry plan's family at the sequence level only (the pallas kernels' two-kernel path)
    assert len(records["gradcheck_family_pallas"]["rows"]) == 11
    fig = report["figures"]
    assert fig["copy"]["bandwidth_bytes_per_s"] > 0
    assert set(fig["logits"]) == {"B1_T8", "B2_T5"}
    assert set(fig["layouts"]) == {"N16_V300", "N8_V256"}
    designs = ("rows", "aligned", "one_pass")
    for t in fig["layouts"].values():
        assert set(t) == {*designs, "xla", "xla_copy", "xla_read"}
        assert all(t[k]["step_ms"] > 0 and t[k]["copy_fraction"] > 0
                   for k in (*designs, "xla_read"))
        assert all(t[k]["stats_copy_fraction"] > 0 for k in designs[:2])
        assert all(t[k]["dlogits_max_rel_diff_to_rows"] <= 1e-2 for k in designs[1:])
    assert fig["gpu_layout"] in ("rows", "aligned")
    assert fig["gpu_one_pass"] in ("one_pass", "two kernels")
    for label in ("gpu_layout='aligned'", "one_pass=True"):
        found = [t for t in report["targets"] if label in t["name"]]
        assert len(found) == 2 * 2 and all(t["met"] is not None for t in found)
    assert set(fig["one_pass_tilings"]) == set(fig["layouts"])
    swept = {"one_pass", "one_pass_128x4x3x1", "one_pass_128x4x3x3_no_l2_hints"}
    for t in fig["one_pass_tilings"].values():
        assert set(t) == swept and t["one_pass_128x4x3x1"]["programs"] == 3
        assert [t[k]["stages"] for k in sorted(swept)[1:]] == [1, 3]
        assert [t[k]["l2_hints"] for k in sorted(swept)] == [True, True, False]
        assert all(v["kernel_ms"] > 0 and v["dlogits_max_rel_diff_to_planned"] <= 1e-2
                   for v in t.values())
    assert fig["one_pass_tiling"] in swept
    assert set(fig["tilings"]) == set(fig["layouts"])
    for t in fig["tilings"].values():
        assert set(t) == {"aligned", "aligned_256x4"} and t["aligned_256x4"]["num_warps"] == 4
        assert all(v["stats_ms"] > 0 and v["dlogits_max_rel_diff_to_planned"] <= 1e-2
                   for v in t.values())
    assert fig["aligned_tiling"] in ("aligned", "aligned_256x4")
    assert all(0 < r["copy_fraction"] for t in fig["logits"].values() for r in t.values())
    assert report["auto_impl"] in ("pallas", "xla")
    md = (tmp_path / "proof.md").read_text()
    assert md.startswith("# grpo-kernels proof (dry plan") and "| target |" in md
    assert md in r.stdout


STEP_RUN = RESULTS / "gpu_proof_step_h100_2026-11-27.json"


def test_the_tunix_plan_runs_the_head_beside_ours_or_says_why_not(tmp_path, monkeypatch):
    from grpo_kernels.proof import gpu_tunix_step
    plan = proof_plans.TUNIX
    todo = proof.phases(set(plan.groups), plan)
    names = [n for n, _, _ in todo]
    assert names[:3] == ["nvidia-smi", "versions", "copy_bandwidth"]
    assert names[3:] == [f"tunixhead_{proof.head_arm(a, c)}" for a, c in plan.tunix_head_arms]
    assert {"tunixhead_tunix-chunk256", "tunixhead_logps-tunix-chunk256", "tunixhead_fused-xla",
            "tunixhead_logps-ours", "tunixhead_no-head"} <= set(names)
    (tmp_path / "tunix").mkdir()
    for name, argv, _ in todo[3:]:
        assert argv[argv.index("--tunix-path") + 1] == proof.TUNIX_HEAD
        args = gpu_tunix_step.parse_args(proof._fill(argv, {proof.TUNIX_HEAD: str(tmp_path)})[3:])
        assert args.chunk_size == (256 if "chunk256" in name else 0)
    assert proof.plan_of("tunix", True) is proof_plans.DRY_TUNIX
    assert [proof.head_arm(a, c) for a, c in proof_plans.DRY_TUNIX.tunix_head_arms] == [
        n[len("tunixhead_"):].replace("chunk256", "chunk8") for n in names[3:]]
    # Without the head where --tunix-head points, each of its phases is skipped with the reason.
    every = proof.phases
    monkeypatch.setattr(proof, "phases", lambda groups, plan: [
        (n, a, t) for n, a, t in every(groups, plan) if n.startswith("tunixhead_")])
    out = tmp_path / "out"
    rc = proof.run(argparse.Namespace(plan="tunix", dry_run=True, groups=None, out=str(out),
                                      tokenizer=None, tunix_head=str(tmp_path / "none"),
                                      budget_s=60.0))
    report = json.loads((out / "proof.json").read_text())
    assert rc == 0 and len(report["phases"]) == len(plan.tunix_head_arms)
    assert all(p["rc"] == "skipped" and "no tunix under" in p["reason"]
               for p in report["phases"])


def test_the_step_plan_and_its_dry_twin():
    names = [n for n, _, _ in proof.phases(set(proof_plans.STEP.groups), proof_plans.STEP)]
    assert names[:3] == ["nvidia-smi", "versions", "copy_bandwidth"] and names[-1] == "ab"
    assert [n for n in names if n.startswith("train_")] == [
        f"train_{arm}" for arm in proof_plans.STEP.train_arms]
    assert [n for n in names if n.startswith(("compile_", "memory_"))] == [
        f"{kind}_head_{v}" for v in ("tokens", "vocab", "tokens_2048")
        for kind in ("compile", "memory")]
    assert [n for n in names if n.startswith("tunix_")] == [
        "tunix_tunix", "tunix_fused-xla", "tunix_logps-tunix", "tunix_logps-ours"]
    assert not any(n.startswith(("bench", "gradcheck", "gpu_")) for n in names)
    dry = [n for n, _, _ in proof.phases(set(proof_plans.DRY_STEP.groups), proof_plans.DRY_STEP)]
    assert [n.rsplit("_", 1)[0] if n.endswith("_8") else n for n in dry] == [
        n for n in names if n not in ("compile_head_tokens_2048", "memory_head_tokens_2048")]
    assert proof.plan_of("step", False) is proof_plans.STEP
    assert proof.plan_of("step", True) is proof_plans.DRY_STEP
    assert proof.plan_of("real", True) is proof_plans.DRY is proof.plan_of("dry", False)
    # Every script phase's arguments parse as its script parses them; each compile phase
    # fills the cache its memory phase reads.
    from grpo_kernels.proof import gpu_train_step, gpu_tunix_step
    argv = {n: a for n, a, _ in proof.phases(set(proof_plans.STEP.groups), proof_plans.STEP)}
    for name, a in argv.items():
        if name.startswith("train_"):
            assert gpu_train_step.parse_args(a[3:]).layers == proof_plans.STEP.step_layers
        elif name.startswith("tunix_"):
            assert gpu_tunix_step.parse_args(a[3:]).rows == proof_plans.STEP.step_batch[0]
        elif name.startswith("compile_"):
            memory = argv["memory_" + name[len("compile_"):]]
            cache = a[a.index("--compile-cache") + 1]
            assert proof.SCRATCH in cache and memory[memory.index("--compile-cache") + 1] == cache
    filled = proof._fill(argv["ab"], {proof.SCRATCH: "/s", proof.TOKENIZER: "/t",
                                      proof.OUT_DIR: "/o"})
    assert "model.tokenizer=/t" in filled and filled[filled.index("--run-dir") + 1] == "/s/ab"


def test_report_of_the_step_h100_run():
    """The step plan's H100 run: its targets rebuild from its phases; what met and missed."""
    report = json.loads(STEP_RUN.read_text())
    proof_report.validate(report)
    assert report["plan"] == "step" and report["all_phases_ok"]
    rebuilt = proof_report.build(report["plan"], report["phases"], report["wall_s"])
    assert rebuilt["targets"] == report["targets"]
    fig = rebuilt["figures"]
    train = fig["train_step"]
    assert train["fused-xla"]["time_ratio"] == pytest.approx(68.94519 / 88.45914, rel=1e-6)
    assert train["fused-xla"]["peak_ratio"] == pytest.approx(11738631168 / 24963264256)
    assert train["fused-xla-chunk2048"]["peak_ratio"] == pytest.approx(12869817856 / 24963264256)
    assert all(r["loss_ok"] and r["grad_norm_ok"] for r in train.values())
    assert "fused-pallas" not in train  # skipped on a GPU, with the reason
    assert fig["tunix_step"]["fused-xla"]["peak_ratio"] == pytest.approx(8393995520 / 15678094848)
    logps = fig["tunix_logps"]
    assert logps["logps-ours"]["temp_bytes"] < logps["logps-tunix"]["temp_bytes"] / 3
    head = fig["head_peer"]
    assert head["liger_min_peak"] == 6562253312
    # Loaded from the compile cache: the step's own peak; with its compile, the autotuner's.
    assert head["ours"]["xla-tokens"]["device_peak_bytes"] == 5492844288
    assert head["ours"]["xla-tokens"]["peak_with_compile"] == 9216852480
    assert head["ours"]["xla-vocab"]["device_peak_bytes"] == 2986817536
    met = {t["name"]: t["met"] for t in rebuilt["targets"]}
    assert all(met.values()), [n for n, m in met.items() if not m]
    assert met["update step fused-xla / logits-reference device peak"] is True
    assert set(fig["ab"]["runs"]) == {"logits-reference", "fused-xla"}
    md = proof_report.to_markdown(rebuilt)
    assert "| fused-xla | 70.25 | 68.95 | 0.7794 | 11.74 | 0.4702 |" in md
    assert "| Liger compiled | 515.3 |" in md


@pytest.mark.slow
def test_dry_run_of_the_step_plan(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "grpo_kernels.cli.main", "proof", "--dry-run",
                        "--in-process", "--plan", "step", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "proof.json").read_text())
    proof_report.validate(report)
    assert report["plan"] == "dry-step" and report["all_phases_ok"]
    records = {rec["phase"]: rec for rec in report["phases"]}
    assert list(records) == [n for n, _, _ in proof.phases(set(proof_plans.STEP_GROUPS),
                                                           proof_plans.DRY_STEP)]
    for name, rec in records.items():
        if name.startswith(("compile_", "memory_", "liger")):  # no memory_stats, no CUDA
            assert rec["rc"] == 3 and "skipped" in rec["stderr_tail"], name
        elif name != "nvidia-smi":
            assert rec["rc"] == 0, (name, rec["stderr_tail"])
    fig = report["figures"]
    assert set(fig["train_step"]) == set(proof_plans.DRY_STEP.train_arms)
    for arm, row in fig["train_step"].items():
        assert row["loss_ok"] and row["grad_norm_ok"] and row["pipelined_ms"] > 0, arm
    assert set(fig["tunix_step"]) == {"tunix", "fused-xla"}
    assert fig["tunix_step"]["fused-xla"]["loss_ok"]
    assert set(fig["tunix_logps"]) == {"logps-tunix", "logps-ours"}
    assert fig["tunix_logps"]["logps-ours"]["mean_logp_rel_diff"] <= 1e-5
    runs = fig["ab"]["runs"]
    assert set(runs) == {"logits-reference", "fused-xla"} and runs["fused-xla"]["step1_loss_ok"]
    assert all(r["update_after_step1_s"] > 0 for r in runs.values())
    assert (tmp_path / "ab_report.md").is_file() and (tmp_path / "ab_curves.png").is_file()
    assert fig["ab"]["report"] == "ab_report.md"
    names = {t["name"] for t in report["targets"]}
    assert "update step fused-xla / logits-reference time, back to back" in names
    assert (tmp_path / "proof.md").read_text() in r.stdout
