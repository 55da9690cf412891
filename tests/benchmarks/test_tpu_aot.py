"""benchmarks/tpu_aot.py: the TPU kernels through libtpu's own compiler, with no TPU.

Each test runs the script in a subprocess: libtpu is loaded by path (``TPU_LIBRARY_PATH``),
and only there, so this process's JAX never probes for a TPU. A compile for a chip fails as on
the chip when a kernel's blocks exceed its VMEM, which is how v4's plans were found too big.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tpu_aot  # noqa: E402

pytestmark = pytest.mark.skipif(
    tpu_aot.libtpu_path() is None,
    reason="no libtpu.so: `make .venv/.installed-dev` puts it in .venv/libtpu")


def run(*argv: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/tpu_aot.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == (1 if failed else 0), proc.stderr[-3000:]
    return rows


def planned_peak(row: dict) -> float:
    """The compiled step's arguments, outputs and temporaries over logits + dlogits."""
    used = row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
    return used / (2 * row["logits_bytes"])


def test_the_logits_loss_compiles_for_every_generation():
    """B=1, T=2048, V=151,643 in bf16 and f32, token level (the one-pass kernel) and sequence
    level (the two kernels), for v4, v5e, v5p, v6e and v7x: every step compiles, moves no
    logits-sized copy, and plans at most logits + dlogits + 1% (issue 20 allows 10%)."""
    rows = run()
    assert len(rows) == 20 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    for r in rows:
        assert r["logits_copies"] == 0 and planned_peak(r) <= 1.01, r
        kernels = (["grpo_one_pass"] if r["level"] == "token"
                   else ["grpo_logits_gradient", "grpo_row_statistics"])
        assert r["kernels"] == kernels and r["tpu_custom_calls"] == len(kernels), r


def test_larger_batches_compile():
    rows = run("--generations", "v5e,v6e", "--batch", "4,8", "--time", "1024,2048",
               "--dtype", "bf16", "--level", "token")
    assert len(rows) == 8 and all(r["ok"] and planned_peak(r) <= 1.01 for r in rows), rows


def test_the_fused_head_compiles_for_every_generation():
    """B=1, T=8192, H=4096, V=151,936 bf16: three kernels, no [B, T, V] buffer."""
    rows = run("--op", "lm_head", "--time", "8192", "--vocab", "151936", "--dtype", "bf16",
               "--level", "token")
    assert len(rows) == 5 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    for r in rows:
        assert r["tpu_custom_calls"] == 3 and r["temp_bytes"] < 64 << 20, r


def test_an_argument_layout_without_the_vocabulary_minor_costs_two_copies():
    """A TPU lays out a [B, T, V] jit argument with V = 151,643 (not a multiple of 128) with
    the vocabulary off the minor dimension; the kernels read whole rows, so XLA transposes the
    logits in and the gradient out. With V = 151,936 the default layout is row-major."""
    odd, padded = (run("--generations", "v6e", "--dtype", "bf16", "--level", "token",
                       "--logits-layout", "default", "--vocab", v)[0]
                   for v in ("151643", "151936"))
    assert odd["logits_copies"] == 2 and planned_peak(odd) > 1.9
    assert padded["logits_copies"] == 0 and planned_peak(padded) <= 1.01


@pytest.mark.parametrize("argv,match", [
    (["--generations", "v3"], "not among"), (["--op", "logits,head"], "not among"),
    (["--dtype", "f16"], "not among")])
def test_bad_arguments_are_named(argv, match, capsys):
    with pytest.raises(SystemExit):
        tpu_aot.parse_args(argv)
    assert match in capsys.readouterr().err
