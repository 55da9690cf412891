"""benchmarks/tpu_tunix_iteration.py: tunix's chunked log-prob passes beside ours, compiled for
a TPU. Against tunix's development head (make test-tunix-head runs this file with it first on
the path) it compiles a short case; against 0.1.7, which has no chunking, it says what it
needs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tpu_tunix_iteration as tti  # noqa: E402
from tpu_compile import libtpu_path  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tunix") is None,
                                reason="google-tunix is not installed (the dev extras install it)")


def test_roofline_is_the_larger_of_the_two_times():
    flops, bw = tti.PEAKS["v6e"]
    assert tti.roofline_s(flops, bw, "v6e") == 1.0
    assert tti.roofline_s(2 * flops, bw, "v6e") == 2.0
    assert tti.roofline_s(flops, 3 * bw, "v6e") == 3.0
    assert tti.roofline_s(None, bw, "v6e") is None


def test_ours_options_are_the_xla_heads_or_none():
    from grpo_kernels.ops.lm_head_loss.xla_plan import LmHeadBlockSizes
    assert tti.ours_options(None, None) is None
    assert tti.ours_options(1 << 24, "vocab") == LmHeadBlockSizes(chunk_bytes=1 << 24,
                                                                  dweight="vocab")
    assert tti.ours_options(None, "vocab") == LmHeadBlockSizes(dweight="vocab")
    # a chunk budget alone keeps the adapter's dweight="vocab"
    assert tti.ours_options(1 << 24, None) == LmHeadBlockSizes(chunk_bytes=1 << 24,
                                                               dweight="vocab")


def test_summary_compares_with_the_default_and_the_lowest_chunked_plan():
    group = {"tunix-chunk0": {"temp_bytes": 1000, "roofline_ms": 2.0},
             "tunix-chunk128": {"temp_bytes": 300, "roofline_ms": 8.0},
             "tunix-chunk256": {"temp_bytes": 200, "roofline_ms": 4.0},
             "ours": {"temp_bytes": 50, "roofline_ms": 1.0},
             "no-head": {"temp_bytes": 40, "roofline_ms": 0.1}}
    s = tti.summary("v6e", "qwen3-8b", 8192, "update", group)
    assert s["best_chunk"] == "tunix-chunk256" and s["ok"]
    assert s["temp_over_default"] == 0.05 and s["temp_over_best"] == 0.25
    assert s["roofline_over_default"] == 0.5 and s["roofline_over_best"] == 0.25
    assert s["best_over_floor"] == 5.0
    # one entry per budget where several of ours ran
    group = {"tunix-chunk128": {"temp_bytes": 300}, "ours-cb64": {"temp_bytes": 30},
             "ours-cb128": {"temp_bytes": 60}}
    s = tti.summary("v5e", "qwen3-1.7b", 8192, "logps", group)
    assert s["temp_over_best_ours-cb64"] == 0.1 and s["temp_over_best_ours-cb128"] == 0.2
    assert "roofline_over_best_ours-cb64" not in s and "best_over_floor" not in s


@pytest.mark.parametrize("argv, message", [
    (["--heads", "qwen3-4b"], "not among"), (["--chunks", "-1"], "--chunks must be non-negative"),
    (["--time", "0"], "--prompt and --time must be at least 1"),
    (["--generations", "v4"], "not among"),
    (["--ours-chunk-bytes", "0"], "--ours-chunk-bytes must be at least 1"),
    (["--ours-dweight", "rows"], "invalid choice: 'rows'")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        tti.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(libtpu_path() is None, reason="no libtpu.so: `make .venv/.installed-dev`")
def test_a_short_case_compiles_or_the_script_says_it_needs_the_head():
    import json
    import os

    from grpo_kernels.integrations.tunix.offers import chunks_log_probs
    head = chunks_log_probs()
    path = [os.environ.get("PYTHONPATH", ""), str(ROOT / "src")]  # the head stays first
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/tpu_tunix_iteration.py"),
                        "--heads", "qwen3-1.7b", "--time", "256", "--chunks", "0,128",
                        "--passes", "logps", "--generations", "v6e"],
                       capture_output=True, text=True, env=env, timeout=600)
    if not head:
        assert r.returncode == 2 and "needs tunix's development head" in r.stderr
        return
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row.get("arm") for row in rows] == ["tunix-chunk0", "tunix-chunk128", "ours", None]
    for row in rows[:3]:
        assert row["ok"] and row["temp_bytes"] >= 0 and row["flops"] > 0
    # tunix's passes keep their float32 logits; ours, at this length, can fuse the head's
    # matmul into the reductions that read it and plan no temporaries at all
    assert rows[0]["temp_bytes"] > 0 and rows[1]["temp_bytes"] > 0
    # ours holds no [T, V] float32 logits; tunix's unchunked pass does
    assert rows[2]["temp_bytes"] < rows[0]["temp_bytes"]
    assert rows[3]["temp_over_default"] < 1
