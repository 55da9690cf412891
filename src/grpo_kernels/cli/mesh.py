"""``--mesh`` for the bench commands: parse ``dp=2,tp=4``, make the devices, build the mesh."""

from __future__ import annotations

import argparse
import math
from typing import Any

import jax
from jax.sharding import NamedSharding

from grpo_kernels.sharding import ShardingSpec, mesh_from_shape
from grpo_kernels.sharding.hlo import summary


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-device (grpo_kernels.sharding)")
    g.add_argument("--mesh", help="mesh as axis=size pairs, e.g. dp=2,tp=4 (on CPU the devices "
                   "are simulated: XLA's host platform device count is set to the mesh size)")
    g.add_argument("--vocab-axis", help="mesh axis that splits V (default: 'tp' when the mesh "
                   "has it, else none); every other axis splits B")


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"dp=2,tp=4"`` -> ``(("dp", "tp"), (2, 4))``; ValueError naming the bad part."""
    names, sizes = [], []
    for part in (p.strip() for p in text.split(",")):
        name, eq, size = part.partition("=")
        if not eq or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh must be axis=size pairs like dp=2,tp=4; bad part {part!r} "
                             f"in {text!r}")
        names.append(name.strip())
        sizes.append(int(size))
    if len(set(names)) != len(names):
        raise ValueError(f"--mesh names an axis twice: {text!r}")
    return tuple(names), tuple(sizes)


def ensure_devices(count: int) -> None:
    """Asks for ``count`` simulated CPU devices (possible only before JAX starts; the
    accelerator backends ignore it)."""
    try:
        jax.config.update("jax_num_cpu_devices", max(count, 1))
    except (RuntimeError, ValueError):
        pass  # JAX already started; mesh_from_shape says what is missing


def setup(args: argparse.Namespace) -> tuple[Any, ShardingSpec] | None:
    """``(mesh, spec)`` from ``--mesh``/``--vocab-axis``, or None without ``--mesh``."""
    if not args.mesh:
        if args.vocab_axis:
            raise ValueError("--vocab-axis needs --mesh")
        return None
    names, sizes = parse_mesh(args.mesh)
    vocab_axis = args.vocab_axis or ("tp" if "tp" in names else None)
    if vocab_axis is not None and vocab_axis not in names:
        raise ValueError(f"--vocab-axis {vocab_axis!r} is not an axis of --mesh {args.mesh!r}")
    ensure_devices(math.prod(sizes))
    mesh = mesh_from_shape(sizes, names)
    spec = ShardingSpec(tuple(n for n in names if n != vocab_axis), vocab_axis)
    return mesh, spec


def put(mesh: Any, x: Any, pspec: Any) -> Any:
    """``x`` laid out on ``mesh`` as ``pspec`` (``None`` stays ``None``)."""
    return None if x is None else jax.device_put(x, NamedSharding(mesh, pspec))


def describe(mesh: Any, spec: ShardingSpec) -> dict[str, Any]:
    return {"mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))),
            "batch_axes": list(spec.batch_axes), "vocab_axis": spec.vocab_axis,
            "vocab_shards": spec.vocab_shards(mesh)}


def collective_fields(compiled: Any) -> dict[str, Any]:
    """Collective payload bytes of one device's compiled program, from its HLO text.

    Summed over the collective instructions: one inside a loop (the fused op's per-chunk
    ``dhidden`` sum) counts once, so this is a lower bound on the bytes per step;
    docs/sharding.md gives the per-step volumes.
    """
    try:
        text = compiled.as_text()
    except Exception:
        return {}
    s = summary(text)
    return {"collective_bytes_in_program": s["total"],
            "largest_collective_elements": s["largest_elements"]}


COLUMNS = ["one_device_temp_bytes", "temp_scaling", "collective_bytes_in_program"]


def add_scaling(results: list[dict[str, Any]], k: int, limit: float | None,
                one_device_temp) -> bool:
    """Adds ``one_device_temp_bytes`` and ``temp_scaling`` to each row; applies the gate.

    ``temp_scaling = k x per-device temp / one-device temp``: 1 when the temporaries split
    perfectly over the ``k`` vocabulary shards, ``k`` when every device keeps the one-device
    amount. The gate (``--max-temp-scaling``) passes when it is ``<= limit`` for every row.
    """
    ok = True
    for r in results:
        one = one_device_temp(r["impl"])
        per_device = r.get("temp_size_in_bytes")
        r["one_device_temp_bytes"] = one
        r["temp_scaling"] = k * per_device / one if one and per_device is not None else None
        if limit is not None and r["temp_scaling"] is not None:
            r["gate_temp_scaling"] = r["temp_scaling"] <= limit
            ok &= r["gate_temp_scaling"]
    return ok


def title(shape: dict[str, Any]) -> str:
    return (f", mesh {shape['mesh']} (batch axes {shape['batch_axes']}, vocab axis "
            f"{shape['vocab_axis']}); memory per device")
