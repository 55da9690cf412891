"""Measurements behind the design notes in docs/xla.md, in one process.

    python benchmarks/probes/xla_cpu_probes.py [--rows 4096 --vocab 32768 --iters 7]

Times (median of --iters after one warm-up call) and compiled temp bytes of small programs over
one bf16 ``[rows, vocab]`` array, probing how XLA's CPU backend treats the building blocks of the
``xla`` implementation:

- writing a bf16 buffer chunk by chunk in a loop: carried bf16 buffer, ``lax.map`` outputs,
  a carried ``uint16`` view, against one elementwise pass with no loop;
- the statistics sweep with and without the loop-carried ``optimization_barrier``;
- the statistics sweep with the exact row max against the probed shift;
- the gradient kernel alone, with a fresh and with a donated output, against a bare scale, and
  XLA's float32 -> bfloat16 convert against the integer rounding of ``to_bfloat16``;
- the cost of the entropy metric (loss with metrics used vs unused).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from grpo_kernels import GRPOLossConfig, grpo_loss
from grpo_kernels.objective import RowGrad
from grpo_kernels.ops.logits_loss import xla as X
from grpo_kernels.ops.core.dtypes import to_bfloat16
from grpo_kernels.ops.core.online_softmax import block_stats, sweep


def timed(fn, make_args, iters):
    jax.block_until_ready(fn(*make_args()))
    ts = []
    for _ in range(iters):
        args = make_args()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def report(name, f, z, iters, donate=False):
    jf = jax.jit(f, donate_argnums=(0,) if donate else ())
    temp = jf.lower(z).compile().memory_analysis().temp_size_in_bytes
    make = (lambda: (z + 0,)) if donate else (lambda: (z,))
    ms = timed(jf, make, iters)
    print(f"{name:58s} {ms:8.1f} ms   temp {temp / 2**20:8.1f} MiB", flush=True)


def logits_gradient_astype(z, ids, lse, g):
    """The shipped gradient kernel but with XLA's own float32 -> bfloat16 convert."""
    p = jnp.exp(z.astype(jnp.float32) - lse[:, None])
    hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) == ids[:, None]
    return jnp.where(hit, g[:, None] * (1.0 - p), -g[:, None] * p).astype(z.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=64, help="rows per loop iteration")
    p.add_argument("--iters", type=int, default=7)
    a = p.parse_args()
    n, v, c, it = a.rows, a.vocab, a.chunk, a.iters
    key = jax.random.PRNGKey(0)
    z = (2 * jax.random.normal(key, (n, v), jnp.float32)).astype(jnp.bfloat16)
    ids = jax.random.randint(key, (n,), 0, v, jnp.int32)
    g = jax.random.normal(key, (n,), jnp.float32)
    lse = jnp.full((n,), 12.0, jnp.float32)
    print(f"backend {jax.default_backend()}, jax {jax.__version__}, bf16 [{n}, {v}], "
          f"{c} rows per loop iteration, median of {it}")

    def body(x):
        return (x.astype(jnp.float32) * 2 + 1).astype(jnp.bfloat16)

    def loop_bf16(x):
        def step(i, buf):
            blk = jax.lax.dynamic_slice_in_dim(buf, i * c, c, 0)
            return jax.lax.dynamic_update_slice_in_dim(buf, body(blk), i * c, 0)
        return jax.lax.fori_loop(0, n // c, step, x)

    def loop_map(x):
        return jax.lax.map(body, x.reshape(n // c, c, v)).reshape(n, v)

    def loop_u16(x):
        u16 = lambda y: jax.lax.bitcast_convert_type(y, jnp.uint16)  # noqa: E731
        bf = lambda y: jax.lax.bitcast_convert_type(y, jnp.bfloat16)  # noqa: E731

        def step(i, buf):
            blk = bf(jax.lax.dynamic_slice_in_dim(buf, i * c, c, 0))
            return jax.lax.dynamic_update_slice_in_dim(buf, u16(body(blk)), i * c, 0)
        return bf(jax.lax.fori_loop(0, n // c, step, u16(x)))

    print("-- writing bf16 output chunk by chunk")
    report("fori_loop, carried bf16 buffer, dynamic_update_slice", loop_bf16, z, it)
    report("lax.map over chunks (stacked bf16 outputs)", loop_map, z, it)
    report("fori_loop, carried uint16 view", loop_u16, z, it)
    report("no loop: one elementwise pass", body, z, it)

    print("-- statistics sweep (whole rows)")
    rows = max(1, (16 << 20) // (4 * v))

    def stats_hoistable(x):  # the uint16 view taken once, outside the loop
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)

        def chunk(start, size, out):
            blk = jax.lax.bitcast_convert_type(
                jax.lax.dynamic_slice(bits, (start, 0), (size, v)), jnp.bfloat16)
            m, s, q = block_stats(blk.astype(jnp.float32))
            return tuple(jax.lax.dynamic_update_slice_in_dim(o, r, start, 0)
                         for o, r in zip(out, (m, s, q), strict=True))
        return sweep(n, rows, chunk, tuple(jnp.zeros((n,), jnp.float32) for _ in range(3)))

    report("uint16 view taken outside the loop", stats_hoistable, z, it)
    report("loop-carried logits behind optimization_barrier, exact row max",
           lambda x: X.row_statistics(x, ids, 1.0, rows, v, probe_width=v), z, it)
    report("same, shift = max of the first V/16 columns (shipped)",
           lambda x: X.row_statistics(x, ids, 1.0, rows, v), z, it)

    print("-- gradient kernel")
    grad = lambda x: X.logits_gradient(x, ids, lse, RowGrad(g), 1.0)  # noqa: E731
    report("gradient kernel, fresh output", grad, z, it)
    report("gradient kernel, donated input (in place)", grad, z, it, donate=True)
    report("gradient kernel, output rounded with astype (XLA convert)",
           lambda x: logits_gradient_astype(x, ids, lse, g), z, it)
    report("bare bf16 scale, fresh output", lambda x: x * 2, z, it)
    report("bare bf16 scale, float32 math, astype to bf16",
           lambda x: (x.astype(jnp.float32) * 2).astype(jnp.bfloat16), z, it)
    report("bare bf16 scale, float32 math, integer rounding (shipped)",
           lambda x: to_bfloat16(x.astype(jnp.float32) * 2), z, it)
    report("fused exp + row sum (a floor for one statistics read)",
           lambda x: jnp.sum(jnp.exp(x.astype(jnp.float32)), axis=1), z, it)

    print("-- entropy metric (xla impl, value_and_grad, [B=4, T, V] from the same array)")
    logits = z.reshape(4, n // 4, v)
    bids, mask = ids.reshape(4, n // 4), jnp.ones((4, n // 4), jnp.float32)
    adv = jnp.asarray([1.0, -0.5, 0.3, -1.2], jnp.float32)
    cfg = GRPOLossConfig()

    def loss(x):
        return grpo_loss(x, bids, mask, adv, config=cfg, impl="xla")

    report("metrics unused (XLA drops the entropy reduction)",
           jax.value_and_grad(lambda x: loss(x)[0]), logits, it)
    report("metrics returned (has_aux)", jax.value_and_grad(loss, has_aux=True), logits, it)


if __name__ == "__main__":
    main()
