"""One process of tests/sharding/test_multiprocess.py (run as a script, never collected).

    python tests/sharding/multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID OUT.npz [FLAG]

Joins ``jax.distributed`` on 127.0.0.1 with gloo CPU collectives, builds a global
``(dp=2, tp=4)`` mesh whose vocabulary axis spans the processes, and runs both sharded ops
(xla) on every loss type at token and sequence level, every other case on a mesh with Explicit
axes (as ``jax.make_mesh`` makes it) with the inputs split over the batch only, and every other
pair with the head's ``H`` split over ``dp`` (``head_axes``). Process 0 writes every loss and
gradient, gathered to the host, into ``OUT.npz``. Each process makes the same inputs from the
same seed and puts only its own shards on its devices. ``--trainer``: then one trainer update
for each head (:func:`~tests.sharding.multiprocess_cases.trainer_updates`), into
``OUT.npz.<head>.npz``; ``--die``: the last process exits right after joining.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

port, num_processes, process_id, out = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                        sys.argv[4])
# --die: the last process exits after joining; --trainer: one trainer update after the ops
die, trainer = (len(sys.argv) > 5 and sys.argv[5] == flag for flag in ("--die", "--trainer"))
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                           initialization_timeout=60,
                           # a dead process is noticed after this many seconds without its
                           # heartbeat: short where the test waits for it, else loose
                           heartbeat_timeout_seconds=3 if die else 10)
if die and process_id == num_processes - 1:
    os._exit(17)  # no shutdown: as a crash looks to the others

from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from grpo_kernels import GRPOLossConfig  # noqa: E402
from grpo_kernels.sharding import (  # noqa: E402
    ShardingSpec,
    sharded_grpo_loss,
    sharded_grpo_loss_from_hidden,
)
from tests.sharding.multiprocess_cases import (  # noqa: E402
    CASES,
    factors,
    head_inputs,
    logits_inputs,
    trainer_updates,
)

# (dp=2, tp=4): each tp row holds devices of both processes, so the vocabulary's psums and
# pmaxes cross the process boundary.
devices = np.array(jax.devices()).reshape(4, 2).T
assert all(len({d.process_index for d in row}) == num_processes for row in devices), devices
MESHES = (Mesh(devices, ("dp", "tp")),
          Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2))
spec = ShardingSpec(("dp",), "tp")
# The head's H split over dp too (FSDP weights) in half the cases (factors): its blocks are
# gathered, and its gradient reduce-scattered, across the processes.
fsdp_spec = ShardingSpec(("dp",), "tp", ("dp",))


def put(x, *axes):
    """A global array of the host value ``x`` (the same on every process), sharded by axes."""
    if x is None:
        return None
    x = np.asarray(x)
    sharding = NamedSharding(mesh, P(*axes))
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def gather(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def scalar(x):
    return np.asarray(x.addressable_data(0))  # replicated on every device


results = {}
for i, cfg_kwargs in enumerate(CASES):
    f = factors(i)
    mesh = MESHES[f["explicit"]]
    cfg = GRPOLossConfig(**cfg_kwargs)
    inp = logits_inputs(i, cfg)
    batch = dict(ids=put(inp.ids, "dp"), mask=put(inp.mask, "dp"),
                 advantages=put(inp.advantages, "dp"))
    kwargs = {k: put(v, "dp") for k, v in inp.kwargs().items()}

    def logits_loss(z, batch=batch, kwargs=kwargs, cfg=cfg):
        return sharded_grpo_loss(z, batch["ids"], batch["mask"], batch["advantages"],
                                 mesh=mesh, sharding=spec, config=cfg, impl="xla", **kwargs)[0]

    # on the Explicit mesh, the logits split over the batch only: the op moves them itself
    loss, grad = jax.jit(jax.value_and_grad(logits_loss))(
        put(inp.logits, "dp", None, None if f["explicit"] else "tp"))
    results[f"logits_{i}_loss"], results[f"logits_{i}_grad"] = scalar(loss), gather(grad)

    hin = head_inputs(i, cfg)
    hbatch = dict(ids=put(hin.ids, "dp"), mask=put(hin.mask, "dp"),
                  advantages=put(hin.advantages, "dp"))
    hkwargs = {k: put(v, "dp") for k, v in hin.kwargs().items()}

    hspec = fsdp_spec if f["fsdp"] else spec

    def head_loss(h, w, batch=hbatch, kwargs=hkwargs, cfg=cfg, hspec=hspec):
        return sharded_grpo_loss_from_hidden(
            h, w, batch["ids"], batch["mask"], batch["advantages"], mesh=mesh, sharding=hspec,
            config=cfg, impl="xla", **kwargs)[0]

    loss, (dh, dw) = jax.jit(jax.value_and_grad(head_loss, argnums=(0, 1)))(
        put(hin.hidden, "dp"), put(hin.lm_head, "dp" if hspec.head_axes else None, "tp"))
    results[f"head_{i}_loss"] = scalar(loss)
    results[f"head_{i}_dhidden"], results[f"head_{i}_dw"] = gather(dh), gather(dw)

if process_id == 0:
    np.savez(out, **results)
print(f"process {process_id}: {len(CASES)} cases done", flush=True)
if trainer:  # then the trainer's update, in the same pair of processes
    trainer_updates(out, process_id, num_processes)
jax.distributed.shutdown()
