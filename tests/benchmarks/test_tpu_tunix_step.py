"""benchmarks/tpu_tunix_step.py: one tunix update with our logits-level loss compiled by libtpu
for a TPU, with no TPU (in a subprocess, as tests/benchmarks/test_tpu_train_step.py)."""

import importlib.util

import pytest

from tests.benchmarks.test_tpu_train_step import pytestmark as needs_libtpu
from tests.benchmarks.test_tpu_train_step import run as run_script

pytestmark = [needs_libtpu, pytest.mark.skipif(
    importlib.util.find_spec("tunix") is None,
    reason="google-tunix is not installed (the dev extras install it)")]

SMALL = ("--model", "qwen2.5-0.5b", "--rows", "1", "--prompt", "8", "--completion", "512",
         "--generations", "v5e")


def run(*argv):
    return run_script(*argv, script="tpu_tunix_step.py")


def test_logits_formed_from_the_head_save_two_logits_sized_buffers():
    """The adapter's default on a tunix Qwen2 (logits_from="auto": bf16 logits of the
    completion's positions, formed from the hidden states and head) against the model's own
    float32 logits of every position (logits_from="model"), both on the Mosaic kernel: at
    least 1.5 bf16 [B, T, V] less (two at this shape; 4.24 GB at Qwen2.5-1.5B's, docs)."""
    code, rows, err = run(*SMALL, "--arms", "pallas,pallas-model")
    assert code == 0 and len(rows) == 2 and all(r["ok"] for r in rows), err[-3000:]
    head, model = rows
    for r in rows:
        assert r["kernels"] == ["grpo_one_pass"] and r["logits_copies"] == 0
    saved = model["buffer_total_bytes"] - head["buffer_total_bytes"]
    assert saved >= 1.5 * head["logits_bf16_bytes"], (saved, head["logits_bf16_bytes"])


@pytest.mark.parametrize("argv, message", [
    (("--layers", "25"), "--layers must be in [1, 24] for qwen2.5-0.5b"),
    (("--model", "gemma3-1b", "--layers", "27"), "--layers must be in [1, 26] for gemma3-1b"),
    (("--arms", "fused"), "fused"),
    (("--completion", "0"), "--completion must be at least 1"),
])
def test_bad_arguments_fail_before_any_compile(argv, message):
    code, rows, err = run("--model", "qwen2.5-0.5b", *argv)
    assert code == 2 and not rows and message in err, err[-2000:]
