"""A run over several processes (one per host): joining them, and what crosses between them.

Every process runs the same :class:`~grpo_kernels.rl.trainer.Trainer` on one global mesh. A
step's rollouts are split by process: process ``p`` of ``P`` samples and scores its own
``1/P`` of the step's problems (whole groups of ``num_generations``) with a copy of the
weights on one of its devices, then :func:`gather_rows` hands every process the whole batch in
process order, so that the update (on the global mesh) and the metrics see the same rows
everywhere. Metrics, samples and the run directory are written by process 0 only; Orbax
checkpoints are written by all processes together (each its own shards).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable

import jax
import numpy as np

# The environment variables jax.distributed.initialize reads when it is given nothing.
ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def join(coordinator: str | None = None, num_processes: int | None = None,
         process_id: int | None = None, *, heartbeat_s: int = 20) -> bool:
    """Joins ``jax.distributed`` when a coordinator is given (or in ``JAX_COORDINATOR_ADDRESS``).

    Each argument left ``None`` comes from its environment variable (:data:`ENV`). On CPU the
    collectives are gloo's. Returns whether a multi-process run was joined.

    Raises:
      ValueError: a coordinator without a process count or id (or the reverse), a count below
        1, or an id outside ``[0, count)``; each names the flag and its variable.
    """
    values = {"coordinator": coordinator, "num_processes": num_processes,
              "process_id": process_id}
    for key, var in ENV.items():
        if values[key] is None and os.environ.get(var):
            raw = os.environ[var]
            try:
                values[key] = raw if key == "coordinator" else int(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} must be an integer") from None
    given = [k for k, v in values.items() if v is not None]
    if not given:
        return False
    if len(given) < 3:
        missing = [f"--{k.replace('_', '-')} ({ENV[k]})" for k in ENV if values[k] is None]
        raise ValueError(f"a multi-process run needs a coordinator, a process count and a "
                         f"process id; missing {', '.join(missing)}")
    count, pid = values["num_processes"], values["process_id"]
    if count < 1:
        raise ValueError(f"--num-processes must be >= 1, got {count}")
    if not 0 <= pid < count:
        raise ValueError(f"--process-id must be in [0, {count}), got {pid}")
    if jax.config.jax_platforms in (None, "", "cpu"):  # JAX_PLATFORMS, or the default
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(values["coordinator"], count, pid,
                               heartbeat_timeout_seconds=heartbeat_s)
    return True


def or_die(fn: Callable[[], Any]) -> Any:
    """``fn()``; if it raises, the traceback and an exit without JAX's shutdown.

    A clean shutdown waits at a barrier for every process, and a peer blocked in a collective
    (or in Orbax's save) never reaches it, so both would hang until the barrier's timeout.
    Exiting at once lets the peers' heartbeat checks stop them with "another task died"
    within ``heartbeat_s``.
    """
    try:
        return fn()
    except BaseException:  # noqa: BLE001  (KeyboardInterrupt too: the peers must stop)
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def my_slice(n: int, what: str) -> slice:
    """This process's contiguous share of ``n`` items (``n`` must split evenly)."""
    count = jax.process_count()
    if n % count:
        raise ValueError(f"{what} = {n} must divide evenly over {count} processes")
    share = n // count
    return slice(jax.process_index() * share, (jax.process_index() + 1) * share)


def gather_rows(parts: dict[str, np.ndarray], left_pad: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every process's rows of ``parts`` (arrays with rows first), concatenated in process
    order, on every process.

    ``left_pad`` names the arrays whose second axis may differ between processes (left-padded
    prompts) and the value to pad them with on the left to the widest.
    """
    if jax.process_count() == 1:
        return parts
    from jax.experimental import multihost_utils

    widths = {k: np.array([parts[k].shape[1]]) for k in left_pad}
    widest = {k: int(np.max(multihost_utils.process_allgather(w))) for k, w in widths.items()}
    padded = {}
    for k, x in parts.items():
        if k in left_pad and x.shape[1] < widest[k]:
            pad = np.full((x.shape[0], widest[k] - x.shape[1]) + x.shape[2:], left_pad[k],
                          x.dtype)
            x = np.concatenate([pad, x], axis=1)
        padded[k] = x
    out = multihost_utils.process_allgather(padded, tiled=True)
    return {k: np.asarray(v) for k, v in out.items()}


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of ``x`` on this host: a mesh that spans processes leaves each process
    only its own shards, so the rest comes over the processes' collectives."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_copy(tree: Any) -> Any:
    """A copy of a replicated global ``tree`` on this process's first device, for work that
    stays in the process (sampling its own prompts)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x.addressable_data(0)
        return x

    return jax.tree.map(one, tree)
