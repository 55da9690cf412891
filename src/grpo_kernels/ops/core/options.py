"""Checks the option dataclasses of both ops run in ``__post_init__``, whatever the kernel."""

from __future__ import annotations

from typing import Any

# Pallas ``interpret=``: None (exactly on CPU), True/False, or "hlo" (JAX's generic HLO
# interpreter, which a CPU mesh needs: see grpo_kernels.sharding).
INTERPRET_CHOICES = (None, True, False, "hlo")


def check_int(owner: str, name: str, value: Any, *, multiple: int = 1,
              power_of_two: bool = False, maximum: int | None = None, why: str = "") -> None:
    """ValueError unless ``value`` is ``None`` or an int ``>= 1`` (a multiple of ``multiple``,
    a power of two when asked, at most ``maximum`` when given); the message names
    ``owner.name`` and ``why``."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be None or an int >= 1, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}.{name} must be at most {maximum}{why}, got {value}")
    if value % multiple:
        raise ValueError(f"{owner}.{name} must be a multiple of {multiple}{why}, got {value}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{owner}.{name} must be a power of two{why}, got {value}")


def check_interpret(owner: str, value: Any) -> None:
    if value not in INTERPRET_CHOICES:
        raise ValueError(f"{owner}.interpret must be None, True, False or 'hlo', got {value!r}")


def resolved_interpret(interpret: Any, backend: str) -> Any:
    """``interpret`` with ``None`` resolved: interpret exactly on CPU."""
    return (backend == "cpu") if interpret is None else interpret
