"""rl.run_dir and rl.checkpoint: what a run leaves on disk, and what a resume reads back."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.rl.checkpoint import Checkpoints
from grpo_kernels.rl.run_dir import (
    METRICS_FILE,
    SAMPLES_FILE,
    RunDir,
    check_resumable,
    diff_keys,
    read_metrics,
)


def test_a_resumed_run_cuts_its_jsonl_back_to_the_checkpoint(tmp_path):
    config = {"train": {"steps": 3}}
    run = RunDir(str(tmp_path), config)
    run.prepare()
    run.open(0)
    for step in (1, 2, 3):
        run.write({"step": step, "loss": float(step)}, {"completion": "x"})
    run.close()
    again = RunDir(str(tmp_path), {"train": {"steps": 5}})  # steps may grow
    again.prepare()
    again.open(2)
    assert [r["step"] for r in again.records] == [1, 2]
    again.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    with open(tmp_path / SAMPLES_FILE) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_resume_check_names_the_changed_keys(tmp_path):
    RunDir(str(tmp_path), {"optim": {"lr": 1}, "train": {"steps": 1}}).prepare()
    check_resumable(str(tmp_path), {"optim": {"lr": 1}, "train": {"steps": 9}})
    with pytest.raises(ValueError, match=r"changed: \['optim.lr'\]"):
        check_resumable(str(tmp_path), {"optim": {"lr": 2}, "train": {"steps": 1}})
    assert diff_keys({"a": {"b": 1, "c": 2}}, {"a": {"b": 1}}) == ["a.c"]


def test_metrics_of_a_run_never_started(tmp_path):
    with pytest.raises(ValueError, match=f"{METRICS_FILE}: no metrics"):
        read_metrics(str(tmp_path))


def test_checkpoints_keep_only_the_latest_and_restore_it(tmp_path):
    state = {"w": jnp.arange(4.0)}
    opt = (jnp.zeros(4), jnp.int32(0))
    ckpt = Checkpoints(str(tmp_path), keep=1)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": state["w"] + step}, (opt[0] - step, jnp.int32(step)))
    assert ckpt.steps() == [3]
    step, got, got_opt = ckpt.restore(state, opt)
    ckpt.close()
    assert step == 3
    np.testing.assert_array_equal(got["w"], np.arange(4.0) + 3)
    assert int(got_opt[1]) == 3 and os.path.isdir(tmp_path / "checkpoints" / "3")


def test_checkpoint_retention_must_keep_one(tmp_path):
    with pytest.raises(ValueError, match="train.keep_checkpoints must be an int >= 1"):
        Checkpoints(str(tmp_path), keep=0)
