"""Measured device memory bandwidth: bytes read + written by one pass over an ``[N, V]`` array.

The roofline fraction of the loss kernels divides the bytes they must move by a measured
figure, not by a data-sheet number. Each way below reads ``N V b`` bytes and writes as many;
the median over ``--iters`` calls (after warm-up) gives bytes / time, and ``pipelined_ms`` the
time per call of ``--iters`` calls back to back (``grpo_kernels.cli.bench.pipelined_ms``):

- ``jax x+1`` and ``jax x*2``: XLA's own elementwise kernel;
- ``torch copy_``: the device copy, where torch with CUDA is installed (the highest figure on
  an H100, so the one docs/benchmarks.md divides by).

    python3 -m grpo_kernels.proof.copy_bandwidth --rows 4096 --vocab 151643 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from grpo_kernels.cli.bench import pipelined_ms
from grpo_kernels.ops.core.dtypes import parse_dtype
from grpo_kernels.proof.timing import median_ms


def measure(rows: int, vocab: int, dtype: Any, iters: int, warmup: int) -> Iterator[dict]:
    """One record per way of moving an ``[rows, vocab]`` array of ``dtype`` (a jnp dtype)."""
    # Two arrays alternated, so consecutive calls never reuse a cached result.
    xs = [jax.random.normal(jax.random.PRNGKey(i), (rows, vocab), jnp.float32).astype(dtype)
          for i in range(2)]
    nbytes = 2 * xs[0].nbytes
    base = {"rows": rows, "vocab": vocab, "dtype": str(jnp.dtype(dtype)), "bytes_moved": nbytes,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for name, fn in (("x+1", lambda x: x + jnp.asarray(1, x.dtype)),
                     ("x*2", lambda x: x * jnp.asarray(2, x.dtype))):
        f = jax.jit(fn)
        calls = iter(range(10 ** 9))
        ms = median_ms(lambda: f(xs[next(calls) % 2]), iters, warmup)
        back = pipelined_ms(lambda: f(xs[next(calls) % 2]), iters)
        yield {**base, "how": f"jax {name}", "median_ms": ms,
               "bandwidth_bytes_per_s": nbytes / (ms * 1e-3), "pipelined_ms": back,
               "pipelined_bytes_per_s": nbytes / (back * 1e-3)}
    del xs
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    x = torch.randn(rows, vocab, device="cuda").to(
        {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float32): torch.float32}[
            jnp.dtype(dtype)])
    y = torch.empty_like(x)

    def copy():
        y.copy_(x)
        torch.cuda.synchronize()

    ms = median_ms(copy, iters, warmup)
    back = pipelined_ms(lambda: y.copy_(x), iters, wait=lambda _: torch.cuda.synchronize())
    yield {**base, "how": "torch copy_", "median_ms": ms,
           "bandwidth_bytes_per_s": nbytes / (ms * 1e-3), "pipelined_ms": back,
           "pipelined_bytes_per_s": nbytes / (back * 1e-3)}
    del x, y
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151643)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    for record in measure(args.rows, args.vocab, parse_dtype(args.dtype), args.iters,
                          args.warmup):
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
