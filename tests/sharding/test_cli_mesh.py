"""``bench --mesh`` and ``bench-lm-head --mesh`` on 8 simulated devices (see conftest.py)."""

import json

from grpo_kernels.cli.main import main


def _rows(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]


def test_bench_mesh_reports_per_device_memory_and_collectives(capsys):
    rc = main(["bench", "--impl", "reference,xla", "--batch", "4", "--time", "8", "--vocab",
               "512", "--iters", "1", "--warmup", "0", "--format", "json", "--mesh",
               "dp=2,tp=4"])
    rows = _rows(capsys)
    assert rc == 0 and [r["impl"] for r in rows] == ["reference", "xla"]
    for r in rows:
        assert r["mesh"] == {"dp": 2, "tp": 4} and r["vocab_axis"] == "tp"
        assert r["batch_axes"] == ["dp"] and r["vocab_shards"] == 4
        assert r["collective_bytes_in_program"] > 0
        assert r["one_device_temp_bytes"] > 0 and r["temp_scaling"] > 0


def test_bench_lm_head_mesh_gate(capsys):
    argv = ["bench-lm-head", "--batch", "2", "--time", "64", "--hidden", "64", "--vocab",
            "4096", "--iters", "1", "--warmup", "0", "--format", "json", "--mesh", "tp=8"]
    rc = main(argv + ["--max-temp-scaling", "1.2"])
    rows = _rows(capsys)
    fused = [r for r in rows if r["impl"] == "xla"][0]
    assert fused["vocab_shards"] == 8 and fused["temp_scaling"] is not None
    assert rc == (0 if fused["gate_temp_scaling"] else 1)
    assert main(argv + ["--max-temp-scaling", "0.01"]) == 1  # a gate that must fail
    assert _rows(capsys)[1]["gate_temp_scaling"] is False


def test_bad_mesh_flags(capsys):
    assert main(["bench", "--mesh", "dp=2,tp"]) == 2
    assert "--mesh must be axis=size pairs" in capsys.readouterr().err
    assert main(["bench", "--mesh", "dp=2", "--vocab-axis", "tp"]) == 2
    assert "--vocab-axis 'tp' is not an axis of --mesh" in capsys.readouterr().err
    assert main(["bench-lm-head", "--max-temp-scaling", "1.2"]) == 2
    assert "--max-temp-scaling needs --mesh" in capsys.readouterr().err
    assert main(["bench", "--mesh", "dp=4,tp=4"]) == 2
    assert "needs 16 devices, only 8 present" in capsys.readouterr().err
