"""rl.processes in one process: the flags' errors, and the helpers' one-process behaviour (the
runs over two processes are in tests/sharding/test_multiprocess.py)."""

import numpy as np
import pytest

from grpo_kernels.rl import processes


@pytest.mark.parametrize("kwargs,env,match", [
    (dict(coordinator="127.0.0.1:1"), {}, r"missing --num-processes \(JAX_NUM_PROCESSES\), "
                                          r"--process-id \(JAX_PROCESS_ID\)"),
    (dict(num_processes=2, process_id=0), {}, r"missing --coordinator"),
    (dict(coordinator="h:1", num_processes=0, process_id=0), {}, "--num-processes must be >= 1"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), {}, r"--process-id must be in \[0, 2\)"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES='two' must be an integer"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "missing --num-processes"),
])
def test_join_errors_name_the_flag(monkeypatch, kwargs, env, match):
    for var in processes.ENV.values():
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        processes.join(**kwargs)


def test_no_coordinator_is_one_process(monkeypatch):
    for var in processes.ENV.values():
        monkeypatch.delenv(var, raising=False)
    assert processes.join() is False
    assert processes.is_primary()


def test_one_process_helpers_change_nothing():
    rng = np.random.default_rng(0)
    parts = {"prompt_ids": rng.integers(0, 9, (4, 3)), "reward": rng.normal(size=4)}
    assert processes.gather_rows(parts, {"prompt_ids": 0}) is parts
    assert processes.my_slice(6, "rows") == slice(0, 6)
    tree = {"a": np.ones(3)}
    assert processes.local_copy(tree)["a"] is tree["a"]
