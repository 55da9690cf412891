"""The timer the proof's programs and the benchmark scripts share: median wall time of a call,
after warm-up calls."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def median_ms(fn: Callable[[], Any], iters: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, after ``warmup`` untimed ones.

    Each call's result goes through ``jax.block_until_ready``, so asynchronously dispatched
    JAX work is inside the timing; anything else (a float, a torch tensor) passes through.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)
