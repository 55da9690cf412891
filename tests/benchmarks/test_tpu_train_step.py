"""benchmarks/tpu_train_step.py: the trainer's update program compiled by libtpu for a TPU,
with no TPU (as tests/benchmarks/test_tpu_aot.py, in a subprocess)."""

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

SMALL = ("--model", "qwen2.5-0.5b", "--rows", "1", "--prompt", "8", "--completion", "512",
         "--generations", "v5e")


def run(*argv: str, script: str = "tpu_train_step.py") -> tuple[int, list[dict], str]:
    """``(exit code, JSON rows, stderr)`` of ``benchmarks/<script> argv``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv],
                          capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, rows, proc.stderr


def test_the_trainers_update_compiles_with_each_pallas_arm():
    """The trainer's own gradient program, with the options a TPU run's loss.kernel hands it:
    Mosaic kernels in the program, and the logits-level kernel writing dlogits over the logits
    (the trainer's default), which the buffer assignment shows as at least a bf16 [M, C, V]
    buffer less than with alias_logits: false (the float32 dlogits have no buffer of their
    own; the head's bf16 copy of them may then need one)."""
    code, rows, err = run(*SMALL, "--arms", "logits-pallas,fused-pallas")
    assert code == 0 and len(rows) == 2 and all(r["ok"] for r in rows), err[-3000:]
    logits, fused = rows
    assert logits["kernel"] == {"alias_logits": True, "interpret": False,
                                "tpu_generation": "v5e", "kernel": "tpu"}
    assert logits["kernels"] == ["grpo_one_pass"] and logits["tpu_custom_calls"] == 1
    assert fused["kernels"] == ["grpo_head_dhidden", "grpo_head_dweight",
                                "grpo_head_statistics"]
    for r in rows:
        assert r["logits_copies"] == 0
        assert 0 < r["buffer_total_bytes"] <= (r["argument_bytes"] + r["output_bytes"]
                                               + r["temp_bytes"]) * 1.01
    code, (unaliased,), err = run(*SMALL, "--arms", "logits-pallas",
                                  "--kernel", "logits-pallas.alias_logits=false")
    assert code == 0, err[-3000:]
    saved = unaliased["buffer_total_bytes"] - logits["buffer_total_bytes"]
    assert saved >= 0.95 * logits["logits_f32_bytes"] / 2, (saved, logits["logits_f32_bytes"])
    # The fused head never forms the logits at all.
    assert fused["buffer_total_bytes"] < logits["buffer_total_bytes"]
    # loss.logits_dtype bfloat16: the kernel's bf16 dlogits are the head's backward operand,
    # so the bf16 copy of float32 dlogits is gone too (2.49 GB, all of it, at Qwen2.5-1.5B's
    # 8 x 1,024 tokens; 88% of it at this shape, where the buffers around it move).
    code, (bf16,), err = run(*SMALL, "--arms", "logits-pallas", "--logits-dtype", "bf16")
    assert code == 0 and bf16["logits_dtype"] == "bfloat16", err[-3000:]
    saved = logits["buffer_total_bytes"] - bf16["buffer_total_bytes"]
    assert saved >= 0.75 * logits["logits_f32_bytes"] / 2, (saved, logits["logits_f32_bytes"])


@pytest.mark.parametrize("argv, message", [
    (("--kernel", "logits-reference.x=1"), "--kernel.logits-reference: names no "
                                            "implementation with options"),
    (("--kernel", "logits-pallas.blocks={block_rows: 3}"), "PallasBlockSizes.block_rows"),
    (("--kernel", "alias_logits=true"), "expected ARM.FIELD=VALUE"),
    (("--layers", "25"), "--layers must be in [1, 24] for qwen2.5-0.5b"),
    (("--rows", "0"), "--rows must be at least 1"),
    (("--logits-dtype", "float16"), "--logits-dtype: invalid choice: 'float16'"),
])
def test_bad_arguments_fail_before_any_compile(argv, message):
    code, rows, err = run("--model", "qwen2.5-0.5b", *argv)
    assert code == 2 and not rows and message in err, err[-2000:]
