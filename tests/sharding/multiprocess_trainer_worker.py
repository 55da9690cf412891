"""One process of test_multiprocess.py's trainer test (run as a script, never collected).

    python tests/sharding/multiprocess_trainer_worker.py PORT NUM_PROCESSES PROCESS_ID OUT HEADS

Joins ``jax.distributed`` on 127.0.0.1 (gloo collectives, 4 CPU devices per process), builds
the trainer of :func:`tests.sharding.multiprocess_cases.trainer_values` on a ``(tp=2, dp=4)``
mesh whose vocabulary axis spans the processes, and runs one update (:meth:`Trainer.update`)
on the fixed batch of :func:`~tests.sharding.multiprocess_cases.trainer_batch`, for each head
of the comma-separated ``HEADS`` in turn (one process start for all). Process 0 writes the
parameters after each step and the update's metrics into ``OUT.<head>.npz``.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

port, num_processes, process_id, out, heads = (sys.argv[1], int(sys.argv[2]),
                                              int(sys.argv[3]), sys.argv[4], sys.argv[5])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                           initialization_timeout=60, heartbeat_timeout_seconds=10)

from grpo_kernels.rl.config import TrainConfig  # noqa: E402
from grpo_kernels.rl.processes import to_host  # noqa: E402
from grpo_kernels.rl.trainer import Trainer  # noqa: E402
from tests.sharding.multiprocess_cases import trainer_batch, trainer_values  # noqa: E402

for head in heads.split(","):
    values = trainer_values(f"{out}.{head}.run{process_id}", head)
    # (tp=2, dp=4) over the global device list: tp's two rows are the two processes' devices.
    values["mesh"] = {"shape": {"tp": 2, "dp": 4}, "batch_axes": ["dp"], "vocab_axis": "tp"}
    trainer = Trainer(TrainConfig.from_dict(values), progress=False)
    assert {d.process_index for d in trainer.mesh.devices[:, 0]} == set(range(num_processes))
    metrics = trainer.update(trainer_batch(trainer))
    leaves = {f"param_{i}": to_host(x) for i, x in enumerate(jax.tree.leaves(trainer.state))}
    if process_id == 0:
        np.savez(f"{out}.{head}.npz", **leaves,
                 **{f"metric_{k}": np.float64(v) for k, v in metrics.items()})
    print(f"process {process_id}: {head} update done, loss {metrics['loss']:.6g}", flush=True)
jax.distributed.shutdown()
