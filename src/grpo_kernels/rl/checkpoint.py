"""Orbax checkpoints of a run: parameters and optimizer state, the last ``keep`` of them.

Resuming needs exactly one checkpoint, the latest: ``keep=1`` (the demo's setting) holds one
copy of the weights and the Adam moments on disk; older ones are deleted as new ones land.
"""

from __future__ import annotations

import os
from typing import Any

import jax


class Checkpoints:
    """The checkpoints under ``run_dir/checkpoints``."""

    def __init__(self, run_dir: str, keep: int):
        import orbax.checkpoint as ocp

        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"train.keep_checkpoints must be an int >= 1 (resuming needs the "
                             f"latest), got {keep!r}")
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True))

    @staticmethod
    def _tree(state: Any, opt_state: Any) -> dict[str, Any]:
        return {"params": jax.tree.leaves(state), "opt": jax.tree.leaves(opt_state)}

    def save(self, step: int, state: Any, opt_state: Any) -> None:
        """Saves and waits until the checkpoint is on disk (a crash after this loses nothing
        up to ``step``)."""
        import orbax.checkpoint as ocp

        self.manager.save(step, args=ocp.args.StandardSave(self._tree(state, opt_state)),
                          force=True)
        self.manager.wait_until_finished()

    def restore(self, state: Any, opt_state: Any) -> tuple[int, Any, Any]:
        """``(step, state, opt_state)`` of the latest checkpoint, or ``(0, state, opt_state)``
        unchanged when there is none; ``state``/``opt_state`` give the structure."""
        import orbax.checkpoint as ocp

        step = self.manager.latest_step()
        if step is None:
            return 0, state, opt_state
        tree = self.manager.restore(step, args=ocp.args.StandardRestore(
            self._tree(state, opt_state)))
        return (int(step), jax.tree.unflatten(jax.tree.structure(state), tree["params"]),
                jax.tree.unflatten(jax.tree.structure(opt_state), tree["opt"]))

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def close(self) -> None:
        self.manager.close()
