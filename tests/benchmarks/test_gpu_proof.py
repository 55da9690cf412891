"""benchmarks/gpu_proof.py: the accelerator proof, run here at tiny shapes (``--plan dry``).

A GPU session gets 30 minutes of device time, so the proof must work the first time it runs
there; this runs every phase of it on the CPU, where the pallas kernels are interpreted and the
phases that need a GPU (device memory_stats, the Liger peers) exit with their reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_proof  # noqa: E402

GROUPS = "env,logits,lm_head,liger"


def test_every_plan_runs_the_same_phases():
    names = {plan: [n for n, _, _ in gpu_proof.phases(set(GROUPS.split(",")), plan)]
             for plan in (gpu_proof.REAL, gpu_proof.DRY)}
    assert [n.split("_B")[0] for n in names[gpu_proof.REAL]] == [
        n.split("_B")[0] for n in names[gpu_proof.DRY]]
    short = [n for n, _, _ in gpu_proof.phases(set(GROUPS.split(",")), gpu_proof.SHORT)]
    assert set(short) < set(names[gpu_proof.REAL])


@pytest.mark.slow
def test_dry_run_records_every_phase(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "benchmarks/gpu_proof.py", "--plan", "dry", "--groups",
                        GROUPS, "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "===== summary" in r.stdout
    records = {rec["phase"]: rec for rec in json.loads((tmp_path / "proof.json").read_text())}
    expected = [n for n, _, _ in gpu_proof.phases(set(GROUPS.split(",")), gpu_proof.DRY)]
    assert list(records) == expected
    assert (tmp_path / "proof.log").read_text().count("=====") == len(expected)
    for name, rec in records.items():
        if name.startswith(("gradcheck", "head_gradcheck")):
            assert rec["rc"] == 0 and rec["rows"] and all(row["passed"] for row in rec["rows"])
        elif name.startswith("bench"):
            assert rec["rc"] == 0
            impls = [row["impl"] for row in rec["rows"]]
            assert impls[:3] == (["reference", "xla", "pallas"] if name.startswith("bench_B")
                                 else ["reference", "xla", "matmul"])
            assert all(row["median_step_ms"] > 0 for row in rec["rows"])
        elif name.startswith("memory"):  # the CPU backend has no memory_stats()
            assert rec["rc"] == 2 and "no memory_stats" in rec["stderr_tail"]
        elif name.startswith("liger"):  # no CUDA (and maybe no liger-kernel) here
            assert rec["rc"] == 3 and "skipped" in rec["stderr_tail"]
        elif name == "copy_bandwidth":
            assert rec["rc"] == 0 and rec["rows"][0]["bandwidth_bytes_per_s"] > 0
        elif name == "nvidia-smi":
            assert rec["rc"] in (0, "not run")
        else:
            assert rec["rc"] == 0, name
