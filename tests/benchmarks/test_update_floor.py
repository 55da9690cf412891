"""benchmarks/update_floor.py: each head's update beside the head-free floor (in-process, on
the CPU, at one layer of the learn model and a few tokens)."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import update_floor  # noqa: E402


def test_the_floor_bounds_every_head_and_still_trains_the_layers(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert update_floor.main(["--layers", "1", "--rows", "2", "--prompt", "3",
                              "--completion", "4", "--iters", "1", "--out", str(out)]) == 0
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == list(update_floor.ARMS)
    floor = rows["floor"]
    assert all(floor["temp_bytes"] <= r["temp_bytes"] for r in rows.values())
    assert all(r["step_s"] > 0 and r["head_matmuls_s"] > 0 for r in rows.values())
    assert rows["logits-reference"]["temp_ratio"] == 1.0
    assert "| floor |" in capsys.readouterr().out


def test_the_floor_loss_reaches_the_layers_and_not_the_head_product():
    """Its gradient is nonzero in every layer, and its program has no [N, V] array."""
    import jax
    import numpy as np
    args = update_floor.parse_args(["--layers", "1", "--rows", "2", "--prompt", "3",
                                    "--completion", "4"])
    cfg = update_floor.tts.model_config(args.model, args.layers)
    graphdef, a = update_floor.inputs(cfg, args, jax.devices()[0], concrete=True)
    step = update_floor.program("floor", graphdef, args.prompt)
    (_, _), grads = step(*a)
    norms = [float(np.abs(np.asarray(g, np.float32)).sum()) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and sum(n > 0 for n in norms) >= len(norms) - 1
    def wide(arm):  # arrays whose last axis is the vocabulary (the table is [V, H])
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
