"""Measured device memory bandwidth: bytes read + written by ``x + 1`` on an ``[N, V]`` array.

The roofline fraction of the loss kernels divides the bytes they must move by this measured
figure, not by a data-sheet number. One elementwise kernel reads ``N V b`` bytes and writes as
many; the median over ``--iters`` calls (after warm-up) gives bytes / time.

    python benchmarks/copy_bandwidth.py --rows 4096 --vocab 151643 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from timing import median_ms

from grpo_kernels.ops.logits_loss.inputs import parse_dtype


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151643)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    dtype = parse_dtype(args.dtype)
    # Two arrays alternated, so consecutive calls never reuse a cached result.
    xs = [jax.random.normal(jax.random.PRNGKey(i), (args.rows, args.vocab), jnp.float32)
          .astype(dtype) for i in range(2)]
    add = jax.jit(lambda x: x + jnp.asarray(1, dtype))
    calls = iter(range(10 ** 9))
    ms = median_ms(lambda: add(xs[next(calls) % 2]), args.iters, args.warmup)
    nbytes = 2 * xs[0].nbytes
    print(json.dumps({"rows": args.rows, "vocab": args.vocab, "dtype": args.dtype,
                      "bytes_moved": nbytes, "median_ms": ms,
                      "bandwidth_bytes_per_s": nbytes / (ms * 1e-3),
                      "device": jax.devices()[0].device_kind, "jax": jax.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
