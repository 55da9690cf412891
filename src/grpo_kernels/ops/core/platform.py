"""Choices made for the platform a program is lowered for, not for the host that traces it.

A backend's tuning (the XLA:CPU workarounds, chunk budgets per backend) must follow the
program to where it runs. ``jax.default_backend()`` names the tracing host's backend, which is
the CPU when a TPU or GPU program is traced on a CPU host: ``jax.export``, a compile for a TPU
topology with no TPU attached (benchmarks/tpu_compile.py), or a trainer's ahead-of-time compile
on a CPU host. :func:`by_platform` stages every platform's branch out and lowering keeps the
one of the platform it lowers for (``jax.lax.platform_dependent``): the compiler never sees a
conditional.

Tracing every branch costs trace time in every program that holds one, on whatever platform it
is lowered for. A process that lowers for some kinds only (a CPU test suite, a GPU-only
trainer) names them in :data:`ENV` (``GRPO_KERNELS_PLATFORMS=cpu``, or ``gpu,tpu``): the other
kinds' branches are not traced, and a lowering for one of them fails, naming its platform.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Hashable

import jax

# The kinds a plan is made for, and the jax platform names of each.
PLATFORMS = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}
# The environment variable naming the kinds whose branches are traced (all where unset).
ENV = "GRPO_KERNELS_PLATFORMS"


def staged_kinds() -> tuple[str, ...]:
    """The kinds of :data:`PLATFORMS` whose branches :func:`by_platform` traces: those named
    in ``$GRPO_KERNELS_PLATFORMS`` (comma-separated), every kind where it is unset or empty.

    Raises:
      ValueError: the variable names a kind not in :data:`PLATFORMS`.
    """
    text = os.environ.get(ENV, "").strip()
    if not text:
        return tuple(PLATFORMS)
    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in kinds if k not in PLATFORMS]
    if unknown or not kinds:
        raise ValueError(f"{ENV}={text!r}: {unknown} not among {list(PLATFORMS)}")
    return kinds


def by_platform(fn: Callable[..., Any], plan: Callable[[str], Hashable], *args: Any) -> Any:
    """``fn(plan(kind), *args)``, ``kind`` that of the platform the program is lowered for.

    Args:
      fn: ``fn(p, *args)``: the computation under plan ``p``; each distinct plan of the
        kinds :func:`staged_kinds` names is traced once (kinds with equal plans share a
        branch). A platform of none of the kinds takes the ``"gpu"`` plan where ``gpu`` is
        staged.
      plan: ``plan(kind) -> p`` for ``kind`` in ``"cpu"``, ``"gpu"``, ``"tpu"``; hashable.
      *args: The branches' operands (arrays or pytrees of them).

    Returns:
      ``fn``'s result; outside ``jit`` only the current platform's branch runs.
    """
    made: dict[Hashable, Callable[..., Any]] = {}

    def branch(kind: str) -> Callable[..., Any]:
        p = plan(kind)
        if p not in made:
            made[p] = lambda *a, _p=p: fn(_p, *a)
        return made[p]

    kinds = staged_kinds()
    per_platform = {name: branch(kind) for kind in kinds for name in PLATFORMS[kind]}
    default = {"default": branch("gpu")} if "gpu" in kinds else {}
    return jax.lax.platform_dependent(*args, **per_platform, **default)
