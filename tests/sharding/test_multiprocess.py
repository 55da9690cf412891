"""Across two processes (``jax.distributed`` on 127.0.0.1, gloo collectives, 4 CPU devices
each): both sharded ops on a ``(dp=2, tp=4)`` mesh whose vocabulary axis spans the processes,
every loss type at token and sequence level, equal to the one-process reference; and, in the
same pair of processes, one trainer update (both heads) on a ``(tp=2, dp=4)`` mesh, equal to
the one-process update.

The workers (multiprocess_worker.py) run in their own processes with their own XLA_FLAGS
(4 devices each, the suite's compiler flags); they compile 32 programs per process and two
trainers (about a minute).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from grpo_kernels import GRPOLossConfig, grpo_loss, grpo_loss_from_hidden
from tests.conftest import COMPILER_FLAGS, EMITTER_OPTION
from tests.helpers import rel_err
from tests.sharding.multiprocess_cases import (
    CASES,
    TRAINER_HEADS,
    head_inputs,
    logits_inputs,
    trainer_batch,
    trainer_values,
)

ROOT = Path(__file__).resolve().parents[2]
TOL = dict(loss=2e-6, grad=2e-5)  # the core float32 tolerances (test_impls.py)
LIMIT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv, limit_s: float = LIMIT_S):
    """Two processes of ``argv(process_id, port)`` (4 CPU devices each) to the end;
    ``[(returncode, stdout, stderr), ...]``, wall s."""
    port = _free_port()
    # 4 devices each, and the suite's compiler settings (tests/conftest.py) where it set them:
    # its compiler flags and the emitters of this test (the workers read no compile plan)
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.lstrip("-").split("=")[0] in (*COMPILER_FLAGS, EMITTER_OPTION)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=" ".join(["--xla_force_host_platform_device_count=4", *kept]))
    start = time.perf_counter()
    procs = [subprocess.Popen(argv(i, port), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=limit_s) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, *log) for p, log in zip(procs, logs)], time.perf_counter() - start


def _run_workers(out: Path, *extra: str, limit_s: float = LIMIT_S):
    """Both processes of multiprocess_worker.py (``PORT 2 ID OUT *extra``), as
    :func:`_launch`."""
    return _launch(lambda i, port: [
        sys.executable, str(ROOT / "tests/sharding/multiprocess_worker.py"), str(port), "2",
        str(i), str(out), *extra], limit_s)


def _results(out: Path) -> dict:
    """The ops' results, then each head's trainer update into ``OUT.<head>.npz``: one pair
    of processes for both."""
    runs, _ = _run_workers(out, "--trainer")
    for i, (rc, stdout, stderr) in enumerate(runs):
        assert rc == 0, f"process {i} failed:\n{stdout}\n{stderr[-3000:]}"
    return dict(np.load(out))


def test_a_dead_process_stops_the_others(tmp_path):
    """Process 1 exits right after joining, as a crash would. Process 0, at its first
    collective, is stopped by the coordination service's heartbeat check (3 s in this run)
    with an error that says another task died. The bound here is 90 s; it never hangs."""
    (rc0, _, err0), (rc1, _, _) = _run_workers(tmp_path / "none.npz", "--die", limit_s=90)[0]
    assert rc1 == 17
    assert rc0 != 0 and "another task died" in err0, err0[-2000:]
    assert not (tmp_path / "none.npz").exists()


def close(loss, want):
    """The loss check of the one-process sharded tests (test_sharding.py)."""
    np.testing.assert_allclose(float(loss), float(want), rtol=TOL["loss"], atol=TOL["loss"])


# One test for every case and the trainer's update: the two processes compute all of them at
# once (about 50 s), which a parametrized test would repeat on each xdist worker.
@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """Both ops on every case equal the one-process reference; then one ``Trainer.update``
    (reference log-probs, two micro-batches, AdamW) of the small random model with the
    vocabulary axis across the processes, for each head (the logits loss and the fused one):
    the same loss, grad norm and parameters after the step as one process without a mesh."""
    out = tmp_path / "results.npz"
    results = _results(out)
    failed = []
    for i, case in enumerate(CASES):
        name = f"{case['loss_type']}-{case['importance_sampling_level']}"
        try:
            _check_case(results, i)
        except AssertionError as e:
            failed.append(f"{name}: {e}")
    assert not failed, "\n".join(failed)
    for head in TRAINER_HEADS:
        _check_update(tmp_path, head, dict(np.load(f"{out}.{head}.npz")))


def _check_case(results: dict, i: int) -> None:
    cfg = GRPOLossConfig(**CASES[i])
    inp = logits_inputs(i, cfg)
    loss, grad = jax.value_and_grad(lambda z: grpo_loss(
        z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="reference",
        **inp.kwargs())[0])(inp.logits)
    close(results[f"logits_{i}_loss"], loss)
    assert rel_err(results[f"logits_{i}_grad"], grad) <= TOL["grad"]
    assert np.isfinite(results[f"logits_{i}_grad"]).all()

    hin = head_inputs(i, cfg)
    loss, (dh, dw) = jax.value_and_grad(lambda h, w: grpo_loss_from_hidden(
        h, w, hin.ids, hin.mask, hin.advantages, config=cfg, impl="reference",
        **hin.kwargs())[0], argnums=(0, 1))(hin.hidden, hin.lm_head)
    close(results[f"head_{i}_loss"], loss)
    assert rel_err(results[f"head_{i}_dhidden"], dh) <= TOL["grad"]
    assert rel_err(results[f"head_{i}_dw"], dw) <= TOL["grad"]


def _check_update(tmp_path: Path, head: str, got: dict) -> None:
    """The update across processes (``got``) against ``Trainer.update`` in one process."""
    from grpo_kernels.rl.config import TrainConfig
    from grpo_kernels.rl.trainer import Trainer

    one = Trainer(TrainConfig.from_dict(trainer_values(tmp_path / f"one-{head}", head)),
                  progress=False)
    before = [np.asarray(x) for x in jax.tree.leaves(one.state)]
    want = one.update(trainer_batch(one))
    after = [np.asarray(x) for x in jax.tree.leaves(one.state)]
    np.testing.assert_allclose(got["metric_loss"], want["loss"], rtol=1e-4, atol=1e-6,
                               err_msg=head)
    np.testing.assert_allclose(got["metric_grad_norm"], want["grad_norm"], rtol=1e-4,
                               err_msg=head)
    np.testing.assert_allclose(got["metric_kl"], want["kl"], rtol=1e-4, atol=1e-7,
                               err_msg=head)
    assert len(got) - len(want) == len(after), head
    moved = 0.0
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        p = got[f"param_{i}"]
        assert p.shape == a.shape and np.isfinite(p).all()
        assert rel_err(p - b, a - b) <= 1e-3, (head, i, rel_err(p - b, a - b))
        moved = max(moved, float(np.abs(a - b).max()))
    assert moved > 1e-4, (head, moved)  # the step did move the weights


def _train(config: Path, *extra: str, limit_s: float = LIMIT_S):
    """``grpo-kernels train`` as two processes, one command each (``--coordinator ...``)."""
    runs, _ = _launch(lambda i, port: [
        sys.executable, "-m", "grpo_kernels.cli.main", "train", "--config", str(config),
        "--no-progress", *extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
        "--process-id", str(i)], limit_s)
    for i, (rc, out, err) in enumerate(runs):
        assert rc == 0, f"process {i} failed:\n{out}\n{err[-3000:]}"
    return [out for _, out, _ in runs]


@pytest.mark.slow
def test_train_command_across_processes_writes_once_and_resumes(tmp_path):
    """One step of ``grpo-kernels train`` over two processes (a (tp=2, dp=4) mesh, each
    process sampling 2 of the step's 4 problems), then a second step resumed from the Orbax
    checkpoint the two wrote together. Process 0 alone writes metrics and samples, one line
    per step; the checkpoint restores in a one-process trainer."""
    import json

    import yaml

    from grpo_kernels.rl.checkpoint import Checkpoints
    from grpo_kernels.rl.config import TrainConfig
    from grpo_kernels.rl.trainer import Trainer

    run = tmp_path / "run"
    values = trainer_values(run, "fused")
    values["train"].update(steps=1, checkpoint_every=1)
    # brevity (characters written) varies within a group even for a random model: updates move
    values["rewards"] = {"functions": [{"name": "brevity"}]}
    values["mesh"] = {"shape": {"tp": 2, "dp": 4}, "batch_axes": ["dp"], "vocab_axis": "tp"}
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(values))

    out0, out1 = _train(config)
    assert "step 1:" in out0 and "step 1:" not in out1  # the summary is process 0's
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1]
    assert all(np.isfinite(r["loss"]) and r["tokens"] > 0 for r in metrics)
    samples = (run / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in samples] == [1]

    _train(config, "--steps", "2")
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2] and resumed[:1] == metrics
    assert all(np.isfinite(r["loss"]) and r["tokens"] > 0 for r in resumed)

    one = Trainer(TrainConfig.from_dict(trainer_values(tmp_path / "one", "fused")),
                  progress=False)
    ckpt = Checkpoints(str(run), keep=2)
    try:
        step, state, _ = ckpt.restore(one.state, one.opt_state)
    finally:
        ckpt.close()
    assert step == 2
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(one.state), strict=True)]
    assert all(np.isfinite(m) for m in moved) and max(moved) > 0
