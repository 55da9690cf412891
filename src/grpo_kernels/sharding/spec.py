"""``ShardingSpec``: which mesh axes split the batch and which one splits the vocabulary."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

Array = jax.Array


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """How the GRPO losses are split over a device mesh.

    Attributes:
      batch_axes: Mesh axes that split the batch dimension ``B`` (data parallel and FSDP axes,
        e.g. ``("dp", "fsdp")``); a single name or an empty tuple is allowed.
      vocab_axis: Mesh axis that splits the vocabulary ``V`` (the tensor-parallel axis of the
        LM head), or ``None`` to keep every row whole on each device.
      head_axes: Batch axes that also split the LM head's hidden dimension ``H``: weights
        sharded FSDP-style, as tunix places them (``[H, V]`` as ``P("fsdp", "tp")``). The xla
        head then takes its weights as they are and gathers them one block of vocabulary
        columns at a time, reduce-scattering each block's gradient back, so no device holds
        its whole ``[H, V / k]`` shard or that shard's float32 gradient
        (:func:`grpo_kernels.ops.lm_head_loss.xla.gathered_pieces`). The reference and pallas
        implementations, and the logits ops, ignore it (the head is gathered before them).

    Mesh axes named in none are replicated over: every device along them computes the same
    thing.
    """

    batch_axes: tuple[str, ...] = ()
    vocab_axis: str | None = None
    head_axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        axes = _names(self.batch_axes)
        if not all(isinstance(a, str) and a for a in axes):
            raise ValueError(f"ShardingSpec.batch_axes must be mesh axis names (str), "
                             f"got {self.batch_axes!r}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ShardingSpec.batch_axes has a repeated axis: {axes}")
        object.__setattr__(self, "batch_axes", axes)
        if self.vocab_axis is not None:
            if not isinstance(self.vocab_axis, str) or not self.vocab_axis:
                raise ValueError(f"ShardingSpec.vocab_axis must be None or a mesh axis name, "
                                 f"got {self.vocab_axis!r}")
            if self.vocab_axis in axes:
                raise ValueError(f"ShardingSpec.vocab_axis {self.vocab_axis!r} is also one of "
                                 f"batch_axes {axes}; an axis splits one dimension")
        head = _names(self.head_axes)
        if len(set(head)) != len(head) or not set(head) <= set(axes):
            raise ValueError(f"ShardingSpec.head_axes must be distinct batch axes {axes} (the "
                             f"FSDP axes that split the head's H), got {self.head_axes!r}")
        object.__setattr__(self, "head_axes", head)

    # --- checks against a mesh and shapes -------------------------------------------------

    def validate(self, mesh: Any) -> None:
        """Raises ValueError unless ``mesh`` is a Mesh that has every named axis."""
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        have = tuple(mesh.axis_names)
        for name in (*self.batch_axes, *([self.vocab_axis] if self.vocab_axis else [])):
            if name not in have:
                raise ValueError(f"ShardingSpec names mesh axis {name!r}, but the mesh has "
                                 f"axes {have}")

    def on(self, mesh: Mesh) -> "ShardingSpec":
        """This spec without the axes of size 1 in ``mesh``: splitting into one piece is no
        split, and leaving them out spares collectives (and their buffers) over one device."""
        return ShardingSpec(tuple(a for a in self.batch_axes if mesh.shape[a] > 1),
                            self.vocab_axis if self.vocab_shards(mesh) > 1 else None,
                            tuple(a for a in self.head_axes if mesh.shape[a] > 1))

    def whole_head(self) -> "ShardingSpec":
        """This spec with the head's ``H`` whole on every device (no ``head_axes``)."""
        return dataclasses.replace(self, head_axes=())

    def check_head(self, mesh: Mesh, hidden: int, what: str) -> None:
        """Raises ValueError when the head's ``H`` does not split evenly over ``head_axes``."""
        k = math.prod(mesh.shape[a] for a in self.head_axes)
        if hidden % k:
            sizes = {a: mesh.shape[a] for a in self.head_axes}
            raise ValueError(f"hidden size H={hidden} of {what} is not divisible by the head "
                             f"axes {sizes} (product {k}); leave ShardingSpec.head_axes empty "
                             f"to gather the head whole")

    def batch_shards(self, mesh: Mesh) -> int:
        """Number of pieces ``B`` is cut into (product of the batch axes' sizes)."""
        return math.prod(mesh.shape[a] for a in self.batch_axes)

    def vocab_shards(self, mesh: Mesh) -> int:
        """Number of pieces ``V`` is cut into (1 without a vocab axis)."""
        return mesh.shape[self.vocab_axis] if self.vocab_axis else 1

    def check_divisible(self, mesh: Mesh, batch: int, vocab: int, what: str) -> None:
        """Raises ValueError when ``B`` or ``V`` does not split evenly over its axes.

        Nothing is padded: padding ``B`` would change the ``grpo``/``dr_grpo`` normalisers
        unless masked specially, and padding ``V`` means a copy of the logits or the head.
        """
        k = self.batch_shards(mesh)
        if batch % k:
            sizes = {a: mesh.shape[a] for a in self.batch_axes}
            raise ValueError(
                f"batch size B={batch} of {what} is not divisible by the batch axes {sizes} "
                f"(product {k}); use a batch that is a multiple of {k}")
        k = self.vocab_shards(mesh)
        if vocab % k:
            raise ValueError(
                f"vocabulary size V={vocab} of {what} is not divisible by the vocab axis "
                f"{self.vocab_axis!r} of size {k}; pad the LM head to a multiple of {k} "
                f"(padded logits columns must be -inf, e.g. a bias of -1e9; Qwen2.5's padded "
                f"V=151936 divides by 2..128)")

    # --- partition specs --------------------------------------------------------------------

    def _batch(self) -> Any:
        if not self.batch_axes:
            return None
        return self.batch_axes if len(self.batch_axes) > 1 else self.batch_axes[0]

    def rows(self, ndim: int) -> PartitionSpec:
        """``[B, ...]`` arrays: the leading axis over the batch axes, the rest whole."""
        return PartitionSpec(self._batch(), *([None] * (ndim - 1)))

    def steps(self) -> PartitionSpec:
        """``[B, T, H]`` hidden states of a sequence-parallel head: ``B`` over the batch axes,
        ``T`` over the vocab axis."""
        return PartitionSpec(self._batch(), self.vocab_axis, None)

    def logits(self) -> PartitionSpec:
        """``[B, T, V]`` logits: ``B`` over the batch axes, ``V`` over the vocab axis."""
        return PartitionSpec(self._batch(), None, self.vocab_axis)

    def head(self, layout: str) -> PartitionSpec:
        """LM-head weights ``[H, V]`` (``"hv"``) or ``[V, H]`` (``"vh"``): ``V`` over the vocab
        axis, ``H`` over the head axes (replicated over the other batch axes)."""
        h = None if not self.head_axes else (
            self.head_axes if len(self.head_axes) > 1 else self.head_axes[0])
        if layout == "hv":
            return PartitionSpec(h, self.vocab_axis)
        return PartitionSpec(self.vocab_axis, h)

    def vector(self) -> PartitionSpec:
        """``[V]`` bias."""
        return PartitionSpec(self.vocab_axis)

    # --- collectives, for use inside shard_map ----------------------------------------------

    def batch_sum(self, x: Array) -> Array:
        """Sum over the batch axes (the identity without them)."""
        if not self.batch_axes:
            return x
        return jax.lax.psum(x, self.batch_axes)

    def batch_gather(self, x: Array) -> Array:
        """This device's rows (axis 0) -> the whole batch's, in device order (the identity
        without batch axes)."""
        if not self.batch_axes:
            return x
        return jax.lax.all_gather(x, self.batch_axes, axis=0, tiled=True)

    def vocab_sum(self, x: Array) -> Array:
        return x if self.vocab_axis is None else jax.lax.psum(x, self.vocab_axis)

    def vocab_max(self, x: Array) -> Array:
        return x if self.vocab_axis is None else jax.lax.pmax(x, self.vocab_axis)

    def vocab_offset(self, vocab_local: int) -> Array | int:
        """First global vocabulary id of this device's shard."""
        if self.vocab_axis is None:
            return 0
        return jax.lax.axis_index(self.vocab_axis).astype(jnp.int32) * vocab_local


def resolve(sharding: Any, mesh: Any, batch: int, vocab: int, what: str) -> ShardingSpec:
    """The checks every sharded op makes, then ``sharding.on(mesh)``.

    Raises ValueError unless ``sharding`` is a ShardingSpec whose axes ``mesh`` has and ``B``
    and ``V`` (of ``what``) divide by them.
    """
    if not isinstance(sharding, ShardingSpec):
        raise ValueError(f"sharding must be a ShardingSpec, got {type(sharding).__name__}")
    sharding.validate(mesh)
    sharding.check_divisible(mesh, batch, vocab, what)
    return sharding.on(mesh)


def mesh_from_shape(shape: Sequence[int], axis_names: Sequence[str],
                    devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh of ``shape`` over the first ``prod(shape)`` devices, with a clear error."""
    shape, axis_names = tuple(int(s) for s in shape), tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} and axis names {axis_names} differ in length")
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh shape must be positive, got {shape}")
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(shape)
    if need > len(devices):
        raise ValueError(
            f"mesh {dict(zip(axis_names, shape))} needs {need} devices, only {len(devices)} "
            f"present (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} "
            f"before JAX starts)")
    return Mesh(np.asarray(devices[:need], dtype=object).reshape(shape), axis_names)
