"""Where tunix runs a model on a mesh: its own axes read into our sharded ops' layout."""

from __future__ import annotations

import math
from typing import Any

import jax

from grpo_kernels.integrations.tunix.models import Head
from grpo_kernels.sharding import ShardingSpec


def context_mesh() -> Any:
    """The mesh tunix runs under: the one its ``RLCluster`` enters (``with mesh:``), which its
    models' own ``shard`` reads too, else one set by ``jax.set_mesh`` (under ``jit``, its
    abstract mesh); None without one."""
    from jax.interpreters import pxla

    mesh = pxla.thread_resources.env.physical_mesh
    if not mesh.empty:
        return mesh
    try:  # outside jit: the concrete mesh of jax.set_mesh
        mesh = jax.sharding.get_mesh()
    except (AttributeError, ValueError):  # under jit: its abstract mesh (shard_map takes it)
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


def _mesh_axes(entry: Any, mesh: Any) -> tuple[str, ...]:
    """The axes of ``mesh`` (of size > 1) that one entry of a tunix sharding names."""
    names = entry if isinstance(entry, (tuple, list)) else (entry,)
    return tuple(n for n in names if isinstance(n, str) and n in mesh.shape
                 and mesh.shape[n] > 1)


def placement(model: Any, batch: int, vocab: int, head: Head | None = None,
              whole_rows: bool = False) -> tuple[Any, ShardingSpec] | None:
    """``(mesh, ShardingSpec)`` for our sharded ops when ``model`` runs on a mesh, else None.

    The axes are the model's own (``model.config.shd_config``, tunix's ``ShardingConfig``):
    the batch over the axes of ``act_btd``'s first entry (tunix's default: ``fsdp``), the
    vocabulary over ``emb_vd``'s first (``tp``), on the mesh in context
    (:func:`context_mesh`). An axis whose size does not divide ``batch`` or ``vocab`` is left
    out (that dimension whole on each device); with neither left, None: the one-device op,
    partitioned by XLA. Given the ``head``, the batch axes that also split its ``H`` where
    tunix places it (``emb_vd``'s second entry for a tied table, ``emb_dv``'s first for an
    ``lm_head``; ``fsdp``) become ``head_axes``: the xla head then gathers its weights block by
    block instead of whole.

    ``whole_rows``: each device must hold whole vocabulary rows (a sampler's truncation, whose
    floor is a statistic of the row: :mod:`grpo_kernels.sharding.truncation`); then nothing
    splits the vocabulary or the head (no vocab axis, no ``head_axes``: the head is gathered
    whole on each device, and the devices of the tensor-parallel axis compute the same rows).
    """
    mesh = context_mesh()
    shd = getattr(getattr(model, "config", None), "shd_config", None)
    if mesh is None or mesh.size == 1 or shd is None:
        return None
    batch_axes = _mesh_axes(shd.act_btd[0], mesh)
    vocab_axes = _mesh_axes(shd.emb_vd[0], mesh)
    if batch % math.prod(mesh.shape[a] for a in batch_axes):
        batch_axes = ()
    vocab_axis = vocab_axes[0] if len(vocab_axes) == 1 and vocab_axes[0] not in batch_axes \
        and vocab % mesh.shape[vocab_axes[0]] == 0 and not whole_rows else None
    if not batch_axes and vocab_axis is None:
        return None
    head_axes = () if whole_rows else _head_axes(shd, head, mesh, batch_axes)
    return mesh, ShardingSpec(batch_axes, vocab_axis, head_axes)


def _head_axes(shd: Any, head: Head | None, mesh: Any,
               batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The batch axes over which tunix splits the head's ``H`` (see :func:`placement`), when
    they divide it; else ``()``."""
    if head is None:
        return ()
    entry = shd.emb_vd[1] if head.layout == "vh" else getattr(shd, "emb_dv", (None,))[0]
    axes = tuple(a for a in _mesh_axes(entry, mesh) if a in batch_axes)
    hidden = head.weights.shape[1 if head.layout == "vh" else 0]
    return axes if axes and hidden % math.prod(mesh.shape[a] for a in axes) == 0 else ()
