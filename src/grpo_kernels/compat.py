"""Small shims over JAX APIs that changed between the releases we support (0.10 and 0.11).

:func:`to_layout` puts ``shard_map``'s arguments in its ``in_specs`` layout on a mesh whose axes
are Explicit (``jax.make_mesh``'s default), where an array's sharding is part of its type.

Under ``shard_map(..., check_vma=True)`` every array carries the set of mesh axes it varies
over. A ``pallas_call`` output must declare it: :func:`out_struct` gives the output the union of
its inputs' sets (the kernel reads them all). JAX 0.10 spells the field ``manual_axis_type`` (a
``ManualAxisType``), earlier and later releases ``vma`` (a frozenset); outside ``shard_map``
both are empty and the struct is a plain one. :func:`vary` widens an array's set.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_PARAMS = frozenset(inspect.signature(jax.ShapeDtypeStruct).parameters)


def out_struct(shape: tuple[int, ...], dtype: Any, *like: Any) -> jax.ShapeDtypeStruct:
    """``jax.ShapeDtypeStruct(shape, dtype)`` varying over the mesh axes of ``like``."""
    avals = [jax.typeof(x) for x in like]
    if "manual_axis_type" in _PARAMS:
        mats = [getattr(a, "mat", None) for a in avals]
        mats = [m for m in mats if m is not None]
        if mats:
            varying = frozenset().union(*(m.varying for m in mats))
            mat = next((m for m in mats if m.varying == varying), None)
            if mat is None:
                mat = mats[0].update(varying=varying)
            return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    if "vma" in _PARAMS:
        vma = frozenset().union(*(getattr(a, "vma", frozenset()) for a in avals))
        return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
    return jax.ShapeDtypeStruct(shape, dtype)


def varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", frozenset()))


def vary(x: Any, axes: Sequence[str]) -> Any:
    """``x`` typed as varying over ``axes`` too (``pcast``/``pvary``; a no-op where it is).

    Inside a ``custom_vjp`` the cotangent must have its primal's type; marking a replicated
    input as varying first makes its per-device cotangent legal, and the transpose of this cast
    is the ``psum`` over ``axes`` that the replicated input's gradient needs.
    """
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def vary_like(tree: Any, *like: Any) -> Any:
    """Every array of ``tree`` made to vary over the mesh axes any of ``like`` varies over.

    A loop carry initialised with constants must be typed like what the loop body makes of the
    sharded data, or ``fori_loop`` rejects it inside ``shard_map``.
    """
    axes = tuple(sorted(frozenset().union(*(varying_axes(x) for x in like))))
    if not axes:
        return tree
    return jax.tree.map(lambda x: vary(x, axes), tree)


def explicit_axes(mesh: Mesh) -> bool:
    """Whether any axis of ``mesh`` is Explicit (``jax.make_mesh``'s default in this jax)."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()) or ())


def to_layout(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """Every array of ``tree`` in the layout its ``PartitionSpec`` in ``specs`` (the same
    structure; ``None`` where ``tree`` has none) names on ``mesh``.

    On Explicit axes an array's sharding is part of its type and ``shard_map`` rejects an
    argument whose layout is not its ``in_specs`` (e.g. hidden states split over the batch only,
    as a model hands them, against a sequence-parallel ``P("dp", "tp")``): ``jax.reshard`` moves
    it, under ``jit`` or not. On Auto axes ``shard_map`` moves its arguments itself, and
    ``tree`` is returned as it is.
    """
    if not explicit_axes(mesh):
        return tree
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
                                       or x is None)
    values = treedef.flatten_up_to(tree)
    moved = [x if x is None or p is None else jax.reshard(x, NamedSharding(mesh, p))
             for x, p in zip(values, leaves, strict=True)]
    return treedef.unflatten(moved)
