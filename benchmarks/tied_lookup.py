"""A tied head's input lookup: ``tied_lookup`` against autodiff of ``table[ids]``, in one process.

    python benchmarks/tied_lookup.py                  # both rows below
    python benchmarks/tied_lookup.py --iters 5 --skip-trainer

``op``: ``jit(grad)`` of ``sum(rows * G) + sum(table * D)`` w.r.t. a bf16 table
(V=151,936, H=2048, N=8,192 ids; D stands for the tied head's gradient): planned temporaries
and the median time of ``--iters`` calls, both lookups timed in turn. ``trainer``: the planned
temporaries of the trainer's fused-head gradient program (``rl.policy.make_programs``) for a
one-layer Qwen2.5-0.5B-shaped tied model (V=151,936, H=896, bf16 parameters and compute), 8
rows of a 128-token prompt and 1,024 completion tokens, with ``tied_lookup`` and with the plain
lookup put in its place. Compile-only for the trainer; nothing of model size is allocated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from grpo_kernels.ops.lm_head_loss import lookup


def plain(table, ids):
    return table[ids], table


def op_rows(iters: int, vocab: int = 151_936, hidden: int = 2048, n: int = 8192) -> None:
    k = jax.random.split(jax.random.key(0), 4)
    table = jax.random.normal(k[0], (vocab, hidden), jnp.bfloat16)
    d = jax.random.normal(k[1], (vocab, hidden), jnp.bfloat16)
    ids = jax.random.randint(k[2], (n,), 0, vocab)
    g = jax.random.normal(k[3], (n, hidden), jnp.bfloat16)
    f32 = jnp.float32
    steps, temps, times = {}, {}, {"tied_lookup": [], "table[ids]": []}
    for name, fn in (("tied_lookup", lookup.tied_lookup), ("table[ids]", plain)):
        def loss(t, fn=fn):
            rows, same = fn(t, ids)
            return jnp.sum(rows.astype(f32) * g) + jnp.sum(same.astype(f32) * d)
        compiled = jax.jit(jax.grad(loss)).lower(table).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
        steps[name] = compiled
        jax.block_until_ready(compiled(table))
    for _ in range(iters):
        for name, compiled in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(table))
            times[name].append(time.perf_counter() - start)
    print(f"op: V={vocab:,} H={hidden} N={n:,} bf16 (median of {iters})")
    for name in steps:
        print(f"  {name:12s} {temps[name] / 2**30:7.3f} GiB planned  "
              f"{statistics.median(times[name]):7.3f} s")


def trainer_rows() -> None:
    from flax import nnx

    from grpo_kernels.config import GRPOLossConfig
    from grpo_kernels.models.config import ModelConfig
    from grpo_kernels.models.decoder import Decoder
    from grpo_kernels.rl import policy

    prompt, completion, rows = 128, 1024, 8
    cfg = ModelConfig(family="qwen2", vocab_size=151_936, hidden_size=896,
                      intermediate_size=4864, num_layers=1, num_heads=14, num_kv_heads=2,
                      head_dim=64, attention_bias=True, param_dtype=jnp.bfloat16,
                      compute_dtype=jnp.bfloat16, tie_word_embeddings=True)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    s = jax.ShapeDtypeStruct
    mb = {"ids": s((rows, prompt + completion), jnp.int32),
          "attention": s((rows, prompt + completion), jnp.int32),
          "mask": s((rows, completion), jnp.int32), "advantages": s((rows,), jnp.float32),
          "old_logps": s((rows, completion), jnp.float32),
          "ref_logps": s((rows, completion), jnp.float32)}
    print(f"trainer: fused head, tied V=151,936 H=896 bf16, {rows} x ({prompt} + {completion})")
    saved = policy.tied_lookup
    try:
        for name, fn in (("tied_lookup", saved), ("table[ids]", plain)):
            policy.tied_lookup = fn
            grad_fn, _ = policy.make_programs(graphdef, head="fused", impl="xla",
                                              config=GRPOLossConfig(beta=0.04),
                                              prompt_width=prompt)
            temp = jax.jit(grad_fn).lower(state, mb, s((), jnp.float32),
                                          s((), jnp.float32)).compile()
            print(f"  {name:12s} {temp.memory_analysis().temp_size_in_bytes / 2**30:7.3f} "
                  "GiB planned")
    finally:
        policy.tied_lookup = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=3, help="timed calls of each lookup")
    p.add_argument("--skip-trainer", action="store_true", help="only the op rows")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be at least 1, got {args.iters}")
    op_rows(args.iters)
    if not args.skip_trainer:
        trainer_rows()
    return 0


if __name__ == "__main__":
    sys.exit(main())
