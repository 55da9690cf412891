"""The grpo-kernels command: gradcheck gates and exit codes, bench output, config errors, --help."""

import json

import jax.numpy as jnp
import pytest

from grpo_kernels.cli.bench import pipelined_ms
from grpo_kernels.cli.main import main
from grpo_kernels.ops.logits_loss import IMPLEMENTATIONS
from grpo_kernels.ops.logits_loss.xla import xla_grpo_loss


def run_json(capsys, argv):
    code = main(argv)
    out = capsys.readouterr().out
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("argv", [[], ["gradcheck"], ["bench"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0
    assert "usage: grpo-kernels" in capsys.readouterr().out


def test_gradcheck_passes_and_reports_every_field(capsys):
    code, recs = run_json(capsys, ["gradcheck", "--json", "--batch", "2", "--time", "8",
                                   "--vocab", "257", "--dtype", "bfloat16", "--beta", "0.04",
                                   "--importance-sampling-level", "sequence"])
    assert code == 0 and len(recs) == 1
    r = recs[0]
    for key in ("loss_ref", "loss_kernel", "abs_diff_loss", "max_abs_diff_dlogits",
                "max_rel_diff_dlogits", "gate_loss_abs", "gate_dlogits_rel", "gate_finite"):
        assert key in r
    assert r["passed"] and r["dtype"] == "bfloat16" and r["beta"] == 0.04
    assert r["loss_ref"] != 0.0


def test_gradcheck_fails_with_exit_1_on_a_wrong_gradient(capsys, monkeypatch):
    def broken(*args, **kwargs):
        loss, metrics = xla_grpo_loss(*args, **kwargs)
        return loss * 1.001, metrics  # loss and every gradient 0.1% off

    monkeypatch.setitem(IMPLEMENTATIONS, "xla", broken)
    code = main(["gradcheck", "--time", "8", "--vocab", "50", "--beta", "0.04"])
    out = capsys.readouterr().out
    assert code == 1
    assert "gate dlogits_rel             FAIL" in out


def test_gradcheck_fails_on_nan(capsys, monkeypatch):
    def nan_impl(*args, **kwargs):
        loss, metrics = xla_grpo_loss(*args, **kwargs)
        return loss * jnp.nan, metrics

    monkeypatch.setitem(IMPLEMENTATIONS, "xla", nan_impl)
    code, recs = run_json(capsys, ["gradcheck", "--json", "--time", "4", "--vocab", "20"])
    assert code == 1 and recs[0]["gate_finite"] == "FAIL"


def test_gradcheck_config_file_and_tolerance_gate(tmp_path, capsys):
    path = tmp_path / "gc.yaml"
    path.write_text("loss: {loss_type: dr_grpo, max_completion_length: 16, delta: 2.0}\n"
                    "shape: {batch: 3, time: 7, vocab: 33, dtype: float32}\n"
                    "tolerances: {float32: {dlogits_rtol: 0.0, dlogits_atol: 0.0}}\n")
    code, recs = run_json(capsys, ["gradcheck", "--json", "--config", str(path)])
    r = recs[0]
    assert (r["loss_type"], r["batch"], r["vocab"], r["delta"]) == ("dr_grpo", 3, 33, 2.0)
    # A zero tolerance fails unless both gradients agree bit for bit.
    assert code == (0 if r["max_abs_diff_dlogits"] == 0 else 1)


@pytest.mark.parametrize("text, fragment", [
    ("loss: {epsilon: 0.2}\n", "unknown GRPOLossConfig key(s) ['epsilon']"),
    ("shape: {batch: 2, heads: 3}\n", "shape: unknown key(s) ['heads']"),
    ("tolerances: {float32: {loss_tol: 1}}\n", "tolerances.float32: unknown key(s) ['loss_tol']"),
    ("tolerances: {float32: {loss_atol: -1}}\n", "tolerances.loss_atol must be a number >= 0"),
    ("optimizer: adam\n", "unknown key(s) ['optimizer']"),
    ("- a\n- b\n", "top level must be a mapping"),
])
def test_config_errors_name_the_key(tmp_path, capsys, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["gradcheck", "--config", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_missing_config_and_bad_flags(capsys):
    assert main(["gradcheck", "--config", "/nonexistent.yaml"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["gradcheck", "--temperature", "0"]) == 2
    assert "temperature must be > 0" in capsys.readouterr().err
    assert main(["bench", "--impl", "reference,cuda"]) == 2
    assert "--impl must be a comma list" in capsys.readouterr().err


@pytest.mark.default_emitters
def test_bench_reports_time_memory_and_ratios(capsys):
    code, recs = run_json(capsys, ["bench", "--format", "json", "--impl", "xla", "--batch", "2", "--time",
                                   "16", "--vocab", "512", "--iters", "2", "--warmup", "1",
                                   "--max-temp-ratio", "1.0"])
    assert code == 0
    assert [r["impl"] for r in recs] == ["reference", "xla"]
    for r in recs:
        for key in ("avg_step_ms", "median_step_ms", "first_call_s", "temp_size_in_bytes",
                    "argument_size_in_bytes", "output_size_in_bytes", "peak_bytes_in_use",
                    "host_rss_before_bytes", "host_peak_rss_bytes",
                    "median_step_ms_ratio_to_reference", "machine"):
            assert key in r
        assert r["avg_step_ms"] > 0 and r["pipelined_step_ms"] > 0
    assert recs[0]["median_step_ms_ratio_to_reference"] == 1.0
    assert recs[1]["temp_size_in_bytes"] < recs[0]["temp_size_in_bytes"]
    assert recs[1]["gate_temp"] is True


def test_bench_with_donated_logits(capsys):
    code, recs = run_json(capsys, ["bench", "--format", "json", "--donate", "--batch", "2",
                                   "--time", "8", "--vocab", "128", "--iters", "2", "--warmup", "1"])
    assert code == 0 and all(r["donate"] for r in recs)
    # Back-to-back calls would time the fresh copy each donated call needs: not timed.
    assert all(r["pipelined_step_ms"] is None for r in recs)
    # dlogits take the donated logits' buffer in both implementations.
    assert all(r["alias_size_in_bytes"] == 2 * 8 * 128 * 2 for r in recs)


def test_pipelined_ms_waits_for_the_last_call_of_each_round_only():
    calls, waited = [], []

    def fn():
        calls.append(len(calls))
        return len(calls)

    ms = pipelined_ms(fn, calls=5, rounds=3, wait=waited.append)
    assert len(calls) == 15 and waited == [5, 10, 15] and ms >= 0


def test_bench_table_format(capsys):
    assert main(["bench", "--format", "table", "--batch", "1", "--time", "4", "--vocab", "64",
                 "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "{" not in out and "median_step_ms_ratio_to_reference" in out and "xla" in out


def test_bench_time_gate_fails_when_unmeetable(capsys):
    code, recs = run_json(capsys, ["bench", "--format", "json", "--batch", "1", "--time", "4", "--vocab",
                                   "64", "--iters", "1", "--warmup", "0", "--max-time-ratio", "0"])
    assert code == 1 and recs[1]["gate_time"] is False


def test_wandb_offline_without_package_is_a_clear_error(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(SystemExit, match=r"needs the wandb package"):
        main(["gradcheck", "--time", "4", "--vocab", "20", "--wandb-mode", "offline"])


@pytest.mark.default_emitters
def test_bench_lm_head_runs_and_gates(capsys):
    from grpo_kernels.cli.main import main

    rc = main(["bench-lm-head", "--batch", "1", "--time", "16", "--hidden", "128", "--vocab",
               "512", "--iters", "1", "--warmup", "0", "--format", "json",
               "--max-temp-ratio", "1.0"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert [r["impl"] for r in rows] == ["reference", "xla", "matmul"]
    assert rc == 0 and rows[1]["gate_temp"] is True
    assert rows[1]["time_over_3_matmuls"] > 0


def test_bench_lm_head_rejects_bad_flags(capsys):
    from grpo_kernels.cli.main import main

    assert main(["bench-lm-head", "--impl", "xla,magic"]) == 2
    assert "--impl must be a comma list" in capsys.readouterr().err


def test_mesh_without_the_devices_says_how_to_get_them(capsys):
    import jax

    from grpo_kernels.cli.main import main

    n = jax.device_count() * 2
    assert main(["bench", "--mesh", f"dp={n}", "--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert f"needs {n} devices" in err and "xla_force_host_platform_device_count" in err
