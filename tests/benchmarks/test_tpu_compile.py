"""benchmarks/tpu_compile.py: programs compiled by libtpu's own compiler for a TPU, with no TPU.

Each compile runs the script in a subprocess: libtpu is loaded by path (``TPU_LIBRARY_PATH``),
and only there, so this process's JAX never probes for a TPU. A compile for a chip fails as on
the chip when a kernel's blocks exceed its VMEM, which is how v4's plans were found too big.
The arguments are checked in this process, before any backend would start.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tpu_compile  # noqa: E402

needs_libtpu = pytest.mark.skipif(
    tpu_compile.libtpu_path() is None,
    reason="no libtpu.so: `make .venv/.installed-dev` puts it in .venv/libtpu")
needs_tunix = pytest.mark.skipif(importlib.util.find_spec("tunix") is None,
                                 reason="google-tunix is not installed (the dev extras install it)")


def run(*argv: str) -> list[dict]:
    """The JSON rows of ``benchmarks/tpu_compile.py argv``, none of them failed (its exit
    code agreeing)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/tpu_compile.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == (1 if failed else 0), proc.stderr[-3000:]
    assert not failed, failed
    return rows


HEAD_KERNELS = ["grpo_head_dhidden", "grpo_head_dweight", "grpo_head_statistics"]
SHAPE = ("--rows", "1", "--prompt", "8", "--completion", "512", "--generations", "v5e")
STEP = ("--model", "qwen2.5-0.5b", *SHAPE)
# The trainer's update on the learn model's shape (configs/learn.yaml), 0.7x the compile time
# of Qwen2.5-0.5B's layer with the same margins (the buffer claims need the 512-token
# completion: at 128 they do not hold).
TRAIN_STEP = ("--model", "smollm2-135m", *SHAPE)


def planned_peak(row: dict) -> float:
    """The compiled step's arguments, outputs and temporaries over logits + dlogits."""
    used = row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
    return used / (2 * row["logits_bytes"])


@needs_libtpu
def test_the_logits_loss_compiles_for_every_generation():
    """B=1, T=2048, V=151,643 in bf16 and f32, token level (the one-pass kernel) and sequence
    level (the two kernels), for v4, v5e, v5p, v6e and v7x: every step compiles, moves no
    logits-sized copy, and plans at most logits + dlogits + 1% (the accelerator target allows 10%)."""
    rows = run()
    assert len(rows) == 20 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    for r in rows:
        assert r["logits_copies"] == 0 and planned_peak(r) <= 1.01, r
        kernels = (["grpo_one_pass"] if r["level"] == "token"
                   else ["grpo_logits_gradient", "grpo_row_statistics"])
        assert r["kernels"] == kernels and r["tpu_custom_calls"] == len(kernels), r


@needs_libtpu
def test_larger_batches_compile():
    rows = run("--generations", "v5e,v6e", "--batch", "4,8", "--time", "1024,2048",
               "--dtype", "bf16", "--level", "token")
    assert len(rows) == 8 and all(r["ok"] and planned_peak(r) <= 1.01 for r in rows), rows


@needs_libtpu
def test_the_fused_head_compiles_for_every_generation():
    """B=1, T=8192, H=4096, V=151,936 bf16: three kernels, no [B, T, V] buffer."""
    rows = run("--op", "lm_head", "--time", "8192", "--vocab", "151936", "--dtype", "bf16",
               "--level", "token")
    assert len(rows) == 5 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    for r in rows:
        assert r["tpu_custom_calls"] == 3 and r["temp_bytes"] < 64 << 20, r
        assert r["kernels"] == HEAD_KERNELS, r


@needs_libtpu
def test_an_argument_layout_without_the_vocabulary_minor_costs_two_copies():
    """A TPU lays out a [B, T, V] jit argument with V = 151,643 (not a multiple of 128) with
    the vocabulary off the minor dimension; the kernels read whole rows, so XLA transposes the
    logits in and the gradient out. With V = 151,936 the default layout is row-major."""
    odd, padded = (run("--generations", "v6e", "--dtype", "bf16", "--level", "token",
                       "--logits-layout", "default", "--vocab", v)[0]
                   for v in ("151643", "151936"))
    assert odd["logits_copies"] == 2 and planned_peak(odd) > 1.9
    assert padded["logits_copies"] == 0 and planned_peak(padded) <= 1.01


@needs_libtpu
def test_the_sharded_steps_compile_for_a_two_host_slice():
    """dp=2 x tp=4 over v5e:2x4 (8 chips on two hosts), B=8, T=2048, V=151,936 bf16, each
    implementation of each op. The logits loss: per device logits + dlogits + 1%, no relayout,
    collectives of [B/2, T] statistics only. The fused head: the Pallas kernels take each
    [H, V/4] shard (kept H-minor by the TPU) as W^T, no copy of it and under 64 MiB of
    temporaries; the reference plans its [B/2, T, V/4] logits."""
    rows = run("--impl", "reference,xla,pallas", "--op", "logits,lm_head", "--mesh",
               "dp=2,tp=4", "--batch", "8", "--generations", "v5e", "--dtype", "bf16",
               "--level", "token", "--vocab", "151936")
    assert len(rows) == 6 and all(r["ok"] and r["topology"] == "v5e:2x4" for r in rows), rows
    got = {(r["op"], r["impl"]): r for r in rows}
    for impl in ("reference", "xla", "pallas"):
        r = got["logits", impl]
        assert r["logits_copies"] == 0 and r["largest_collective_elements"] <= 4 * 2048, r
    assert planned_peak(got["logits", "pallas"]) <= 1.01
    # 64-row blocks cover each device's 8192 rows: two Mosaic calls, no leftover-row call
    assert got["logits", "pallas"]["kernels"] == ["grpo_logits_gradient", "grpo_row_statistics"]
    assert got["logits", "pallas"]["tpu_custom_calls"] == 2
    head = got["lm_head", "pallas"]
    assert head["head_copies"] == 0 and head["temp_bytes"] < 64 << 20, head
    assert head["kernels"] == HEAD_KERNELS and head["largest_collective_elements"] == 4096 * 37_984
    assert got["lm_head", "reference"]["temp_bytes"] >= head["logits_bytes"]


@needs_libtpu
def test_batch_axes_alone_run_the_one_pass_kernel():
    """dp=8 over v5e:2x4: with no vocab axis a token-level step compiles to the one-pass kernel
    (the logits read once) under shard_map's varying-axes typing; sequence level to two."""
    rows = run("--mesh", "dp=8", "--batch", "8", "--generations", "v5e", "--dtype", "bf16",
               "--vocab", "151936")
    assert len(rows) == 2 and all(r["ok"] and planned_peak(r) <= 1.01 for r in rows), rows
    kernels = {r["level"]: r["kernels"] for r in rows}
    assert kernels == {"token": ["grpo_one_pass"],
                       "sequence": ["grpo_logits_gradient", "grpo_row_statistics"]}


@needs_libtpu
def test_a_head_shard_as_given_costs_two_copies():
    """LmHeadPallasOptions(match_tpu_layout=False) on the same [H, V/4] shards: XLA copies each
    device's W into row-major for the kernels and dW back, two shard-sized temporaries."""
    as_given, matched = (run("--op", "lm_head", "--mesh", "tp=4", "--batch", "2", "--time",
                             "1024", "--generations", "v6e", "--dtype", "bf16", "--level",
                             "token", "--vocab", "151936", *flag)[0]
                         for flag in (["--head-as-given"], []))
    shard = 4096 * 37_984 * 2
    assert as_given["head_copies"] == 2 and matched["head_copies"] == 0
    assert as_given["temp_bytes"] - matched["temp_bytes"] >= 2 * shard


@needs_libtpu
def test_the_tpu_argument_layout_rule():
    """ops.core.tpu.row_major_by_default gives the layout XLA:TPU picks for a rank-2 argument,
    on the named shapes (Qwen's vocabulary, its shards, ties) and 20 random ones, bf16 and f32."""
    rows = run("--op", "layout-rule", "--generations", "v5e", "--shapes", "20")
    assert len(rows) == 2 * 33 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["xla_row_major"] for r in rows} == {True, False}


@needs_libtpu
def test_the_trainers_update_compiles_with_each_pallas_arm():
    """The trainer's own gradient program, with the options a TPU run's loss.kernel hands it:
    Mosaic kernels in the program, and the logits-level kernel writing dlogits over the logits
    (the trainer's default), which the buffer assignment shows as at least a bf16 [M, C, V]
    buffer less than with alias_logits: false (the float32 dlogits have no buffer of their
    own; the head's bf16 copy of them may then need one)."""
    logits, fused = run("--op", "train-step", *TRAIN_STEP,
                        "--arms", "logits-pallas,fused-pallas")
    assert logits["kernel"] == {"alias_logits": True, "interpret": False,
                                "tpu_generation": "v5e", "kernel": "tpu"}
    assert logits["kernels"] == ["grpo_one_pass"] and logits["tpu_custom_calls"] == 1
    assert fused["kernels"] == HEAD_KERNELS
    for r in (logits, fused):
        assert r["logits_copies"] == 0
        assert 0 < r["buffer_total_bytes"] <= (r["argument_bytes"] + r["output_bytes"]
                                               + r["temp_bytes"]) * 1.01
    (unaliased,) = run("--op", "train-step", *TRAIN_STEP, "--arms", "logits-pallas",
                       "--kernel", "logits-pallas.alias_logits=false")
    saved = unaliased["buffer_total_bytes"] - logits["buffer_total_bytes"]
    assert saved >= 0.95 * logits["logits_f32_bytes"] / 2, (saved, logits["logits_f32_bytes"])
    # The fused head never forms the logits at all.
    assert fused["buffer_total_bytes"] < logits["buffer_total_bytes"]
    # loss.logits_dtype bfloat16: the kernel's bf16 dlogits are the head's backward operand,
    # so the bf16 copy of float32 dlogits is gone too (2.49 GB, all of it, at Qwen2.5-1.5B's
    # 8 x 1,024 tokens; all of it at this shape, 88% at Qwen2.5-0.5B's, where the buffers
    # around it move).
    (bf16,) = run("--op", "train-step", *TRAIN_STEP, "--arms", "logits-pallas",
                  "--logits-dtype", "bf16")
    assert bf16["logits_dtype"] == "bfloat16"
    saved = logits["buffer_total_bytes"] - bf16["buffer_total_bytes"]
    assert saved >= 0.75 * logits["logits_f32_bytes"] / 2, (saved, logits["logits_f32_bytes"])


@needs_libtpu
@needs_tunix
def test_logits_formed_from_the_head_save_two_logits_sized_buffers():
    """The adapter's default on a tunix Qwen2 (logits_from="auto": bf16 logits of the
    completion's positions, formed from the hidden states and head) against the model's own
    float32 logits of every position (logits_from="model"), both on the Mosaic kernel: at
    least 1.5 bf16 [B, T, V] less (two at this shape; 4.24 GB at Qwen2.5-1.5B's, docs)."""
    head, model = run("--op", "tunix-step", *STEP, "--arms", "pallas,pallas-model")
    for r in (head, model):
        assert r["kernels"] == ["grpo_one_pass"] and r["logits_copies"] == 0
    saved = model["buffer_total_bytes"] - head["buffer_total_bytes"]
    assert saved >= 1.5 * head["logits_bf16_bytes"], (saved, head["logits_bf16_bytes"])


@pytest.mark.parametrize("argv, match", [
    (["--generations", "v3"], "not among"), (["--op", "logits,head"], "not among"),
    (["--dtype", "f16"], "not among"), (["--impl", "triton"], "not among"),
    (["--mesh", "dp=two"], "axis=size pairs"), (["--batch", "4,x"], "invalid literal"),
    (["--rows", "2"], "--rows does not apply to --op logits"),
    (["--op", "train-step", "--batch", "4"], "--batch does not apply to --op train-step"),
    (["--op", "tunix-step", "--remat"], "--remat does not apply to --op tunix-step"),
    (["--op", "train-step,logits"], "train-step runs alone"),
    (["--option", "dweight=vocab"], "expected IMPL.FIELD=VALUE"),
    (["--op", "lm_head", "--option", "xla.dweight=rows"], "LmHeadBlockSizes.dweight"),
    (["--option", "reference.chunk=8"], "the reference takes no options"),
    (["--op", "lm_head", "--option", "xla.chunk_rows=8"], "--option xla.chunk_rows (lm_head)"),
    (["--op", "lm_head", "--option", "xla.dweight=vocab", "--op", "train-step"],
     "--option does not apply to --op train-step"),
    (["--op", "train-step", "--arms", "tunix"], "['tunix'] not among train-step's"),
    (["--op", "train-step", "--kernel", "logits-reference.x=1"],
     "--kernel.logits-reference: names no implementation with options"),
    (["--op", "train-step", "--kernel", "logits-pallas.blocks={block_rows: 3}"],
     "PallasBlockSizes.block_rows"),
    (["--op", "train-step", "--kernel", "alias_logits=true"], "expected ARM.FIELD=VALUE"),
    (["--op", "train-step", "--model", "qwen2.5-0.5b", "--layers", "25"],
     "--layers must be in [1, 24] for qwen2.5-0.5b"),
    (["--op", "train-step", "--model", "gemma3-1b"], "a tunix preset"),
    (["--op", "train-step", "--rows", "0"], "--rows must be at least 1"),
    (["--op", "train-step", "--logits-dtype", "float16"], "invalid choice: 'float16'"),
    pytest.param(["--op", "tunix-step", "--model", "gemma3-1b", "--layers", "27"],
                 "--layers must be in [1, 26] for gemma3-1b", marks=needs_tunix),
    (["--op", "tunix-step", "--arms", "fused"], "['fused'] not among tunix-step's"),
    (["--op", "tunix-step", "--completion", "0"], "--completion must be at least 1")])
def test_bad_arguments_are_named_before_any_compile(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_:
        tpu_compile.parse_args(argv)
    assert exit_.value.code == 2 and match in capsys.readouterr().err


def test_without_libtpu_the_script_says_where_to_get_it(tmp_path, capsys):
    assert tpu_compile.main(["--libtpu", str(tmp_path / "none.so")]) == 2
    assert "no libtpu.so" in capsys.readouterr().err
