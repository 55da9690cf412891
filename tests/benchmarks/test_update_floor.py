"""benchmarks/update_floor.py: each head's update beside the head-free floor (in-process, on
the CPU, at the tiny model shape)."""

import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import update_floor  # noqa: E402

ARGV = ["--model", "tiny", "--rows", "2", "--prompt", "3", "--completion", "4"]


@pytest.mark.default_emitters
def test_the_floor_bounds_every_head_trains_the_layers_and_forms_no_logits(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert update_floor.main([*ARGV, "--iters", "1", "--out", str(out)]) == 0
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == list(update_floor.ARMS)
    assert all(rows["floor"]["temp_bytes"] <= r["temp_bytes"] for r in rows.values())
    assert all(r["step_s"] > 0 and r["head_matmuls_s"] > 0 for r in rows.values())
    assert rows["logits-reference"]["temp_ratio"] == 1.0
    assert "| floor |" in capsys.readouterr().out
    # The floor's gradient reaches every layer; its program has no array whose last axis is
    # the vocabulary (the table is [V, H]), where the reference's has.
    args = update_floor.parse_args(ARGV)
    cfg = update_floor.shapes.model_config(args.model, args.layers, update_floor.shapes.RUN_MODELS)
    graphdef, a = update_floor.inputs(cfg, args, jax.devices()[0], concrete=True)
    step = update_floor.program("floor", graphdef, args.prompt)
    (_, _), grads = step(*a)
    sums = [float(np.abs(np.asarray(g, np.float32)).sum()) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(sums)) and sum(x > 0 for x in sums) >= len(sums) - 1

    def wide(arm):
        text = update_floor.program(arm, graphdef, args.prompt).lower(*a).as_text()
        return re.findall(rf"x{cfg.vocab_size}x\w+>", text)
    assert wide("logits-reference") and not wide("floor")


@pytest.mark.parametrize("argv, message", [
    (["--layers", "31"], "--layers must be in [1, 30]"),
    (["--rows", "0"], "--rows must be at least 1"),
])
def test_bad_arguments_name_themselves(argv, message, capsys):
    with pytest.raises(SystemExit):
        update_floor.parse_args(argv)
    assert message in capsys.readouterr().err
