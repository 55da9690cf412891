"""Each Triton kernel of the logits op timed alone, next to an XLA elementwise pass.

    PYTHONPATH=src python3 benchmarks/probes/gpu_kernel_ab.py --tag new
    PYTHONPATH=old/src python3 benchmarks/probes/gpu_kernel_ab.py --tag old   # another tree, A/B

For each ``N x V`` (bf16 logits ~ N(0, 4)): the statistics kernels (full tiles and tail),
the gradient kernels, and ``z + 1`` in XLA (the same bytes as the gradient: one read, one
write). Each is jitted alone and timed as the median of ``--iters`` calls after two warm-ups.
This is how a slow order of the gradient kernel's loads was found (docs/kernels.md, "Benchmarks").
Prints one line per shape.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from grpo_kernels.ops.logits_loss import pallas_gpu
from grpo_kernels.proof.timing import median_ms

SHAPES = ((2048, 151643), (4096, 151643), (2048, 151936))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="", help="printed first on every line (which tree)")
    p.add_argument("--iters", type=int, default=40)
    args = p.parse_args(argv)
    for n, v in SHAPES:
        k = jax.random.split(jax.random.PRNGKey(0), 3)
        z = (2 * jax.random.normal(k[0], (n, v), jnp.float32)).astype(jnp.bfloat16)
        ids = jax.random.randint(k[1], (n,), 0, v, dtype=jnp.int32)
        coef = jax.random.normal(k[2], (n,), jnp.float32)
        blocks = pallas_gpu.plan_blocks(v)
        stats = jax.jit(lambda z, ids: pallas_gpu.row_statistics(z, ids, 1.0, blocks))
        lse = stats(z, ids)[1]
        grad = jax.jit(lambda z, ids, lse, coef: pallas_gpu.logits_gradient(
            z, ids, lse, coef, 1.0, blocks))
        copy = jax.jit(lambda z: z + jnp.bfloat16(1))
        times = [median_ms(lambda f=f, a=a: f(*a), args.iters, 2)
                 for f, a in ((stats, (z, ids)), (grad, (z, ids, lse, coef)), (copy, (z,)))]
        print(args.tag, n, v, "stats %.4f grad %.4f xla_copy %.4f" % tuple(times), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
