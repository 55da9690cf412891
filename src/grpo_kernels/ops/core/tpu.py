"""TPU facts the Pallas TPU code plans by: the generations and their VMEM, which both ops'
planners size their blocks by, and the layout a TPU gives a rank-2 argument, which the fused
head reads its weights in."""

from __future__ import annotations

from typing import Any

import jax

MiB = 1 << 20

# VMEM of one TensorCore, as libtpu 0.0.42's compiler states it when a kernel's blocks exceed
# it (a deviceless compile on a CPU host: benchmarks/tpu_compile.py, docs/kernels.md). The
# planners must fit inside: a plan that does not is a compile error on that chip.
VMEM_BYTES: dict[str, int] = {"v4": 16 * MiB, "v5e": 128 * MiB, "v5p": 64 * MiB,
                              "v6e": 128 * MiB, "v7x": 64 * MiB}
GENERATIONS: tuple[str, ...] = tuple(VMEM_BYTES)
DEFAULT_GENERATION = "v6e"

# device_kind substrings, in the order they are tried ("TPU v5 lite" is v5e, "TPU v5" v5p).
_KINDS = (("v4", "v4"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v5", "v5p"),
          ("v6", "v6e"), ("7", "v7x"))


def generation_of_kind(kind: str) -> str | None:
    """The generation of a TPU ``device_kind`` (``"TPU v5 lite"`` -> ``"v5e"``), else None."""
    kind = kind.lower()
    if "tpu" not in kind:
        return None
    return next((gen for key, gen in _KINDS if key in kind), DEFAULT_GENERATION)


def check_generation(name: str, value: Any) -> None:
    """ValueError, naming the argument ``name``, unless ``value`` is ``None`` or one of
    :data:`GENERATIONS`."""
    if value is not None and value not in GENERATIONS:
        raise ValueError(f"{name} must be None or one of {GENERATIONS}, got {value!r}")


def tpu_generation(generation: str | None = None) -> str:
    """``generation`` if given, else the first device's, else :data:`DEFAULT_GENERATION`.

    A program traced on one host for another (``jax.export``, or a compile for a TPU topology
    from a CPU host) names its target here: the host's own devices say nothing about it.
    """
    if generation is not None:
        check_generation("tpu_generation", generation)
        return generation
    devices = jax.devices()
    found = generation_of_kind(devices[0].device_kind) if devices else None
    return found or DEFAULT_GENERATION


def scoped_vmem_limit(generation: str, wanted: int) -> int:
    """``wanted`` bytes of scoped VMEM, capped at the generation's VMEM."""
    return min(wanted, VMEM_BYTES[generation])


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_major_by_default(shape: tuple[int, int]) -> bool:
    """Whether XLA:TPU lays out a rank-2 jit argument of ``shape`` row-major.

    A TPU stores the two minor dimensions in ``(8, 128)`` tiles, and an argument gets the
    order that pads less: with ``shape = (a, b)``, row-major (``b`` minor) unless
    ``ceil_8(b) ceil_128(a) < ceil_8(a) ceil_128(b)``. So ``[4096, 151936]`` is row-major but
    ``[4096, 151643]``, and every vocabulary shard ``[4096, 151936 / k]`` (``151936 = 128 x
    1187``), keeps ``H`` minor. The rule is what libtpu 0.0.42's compiler does: it agreed on 73
    shapes in bf16 and f32 on v4, v5e and v7x (``benchmarks/tpu_compile.py --op layout-rule``,
    which a test runs).
    """
    a, b = shape
    return _padded(b, 8) * _padded(a, 128) >= _padded(a, 8) * _padded(b, 128)
