"""Choices made for the platform a program is lowered for, not for the host that traces it.

A backend's tuning (the XLA:CPU workarounds, chunk budgets per backend) must follow the
program to where it runs. ``jax.default_backend()`` names the tracing host's backend, which is
the CPU when a TPU or GPU program is traced on a CPU host: ``jax.export``, a compile for a TPU
topology with no TPU attached (benchmarks/tpu_compile.py), or a trainer's ahead-of-time compile
on a CPU host. :func:`by_platform` stages every platform's branch out and lowering keeps the
one of the platform it lowers for (``jax.lax.platform_dependent``): the compiler never sees a
conditional.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import jax

# The kinds a plan is made for, and the jax platform names of each.
PLATFORMS = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


def by_platform(fn: Callable[..., Any], plan: Callable[[str], Hashable], *args: Any) -> Any:
    """``fn(plan(kind), *args)``, ``kind`` that of the platform the program is lowered for.

    Args:
      fn: ``fn(p, *args)``: the computation under plan ``p``; each distinct plan is traced
        once (kinds with equal plans share a branch). A platform of none of the kinds takes
        the ``"gpu"`` plan.
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

    per_platform = {name: branch(kind) for kind, names in PLATFORMS.items() for name in names}
    return jax.lax.platform_dependent(*args, **per_platform, default=branch("gpu"))
