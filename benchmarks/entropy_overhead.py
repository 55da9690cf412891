"""What the entropy terms cost: one process, default options against entropy_coef and
top_entropy_quantile, for the logits op and the fused LM head.

    python benchmarks/entropy_overhead.py                  # the default shapes
    python benchmarks/entropy_overhead.py --iters 3 --json out.json

Logits op: `jit(value_and_grad)` at B=4, T=1024, V=32,768 bf16 (the bench shape), reference
and xla with default options, then xla with `entropy_coef=0.01, top_entropy_quantile=0.2`.
Fused head: the xla op at bench-lm-head's shape (B=2, T=1024, H=512, V=32,768 bf16) with
default options, with the entropy bonus alone (token-separable: one pass), and with both
options (the quantile makes the gradient wait for the whole batch's entropies: two passes).
Every row is timed in this one process, the rows of a table in turn round after round (median
of `--iters` rounds after `--warmup`), with XLA's planned temporaries; the ratios are what
docs/loss.md quotes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp

from grpo_kernels import GRPOLossConfig, LmHeadBlockSizes, grpo_loss_from_hidden
from grpo_kernels.cli.bench import loss_fn, machine_description
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.ops.logits_loss.inputs import random_inputs

ENTROPY = dict(entropy_coef=0.01, top_entropy_quantile=0.2)


def logits_steps() -> list[tuple[str, Callable, tuple]]:
    steps = []
    for label, impl, options in (("reference", "reference", {}), ("xla", "xla", {}),
                                 ("xla +entropy +quantile", "xla", ENTROPY)):
        cfg = GRPOLossConfig(beta=0.04, **options)
        inp = random_inputs(0, 4, 1024, 32768, jnp.bfloat16, cfg)
        steps.append((label, jax.value_and_grad(loss_fn(impl, inp, cfg), has_aux=True),
                      (inp.logits,)))
    return steps


def head_steps() -> list[tuple[str, Callable, tuple]]:
    steps = []
    for label, options in (("fused xla", {}), ("fused xla +entropy", {"entropy_coef": 0.01}),
                           ("fused xla +entropy +quantile", ENTROPY)):
        cfg = GRPOLossConfig(beta=0.04, **options)
        inp = random_head_inputs(0, 2, 1024, 512, 32768, jnp.bfloat16, cfg)

        def loss(h, w, cfg=cfg, inp=inp):
            return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                         impl="xla", options=LmHeadBlockSizes(),
                                         **inp.kwargs())

        steps.append((label, jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
                      (inp.hidden, inp.lm_head)))
    return steps


def interleaved(steps, iters: int, warmup: int) -> list[dict]:
    """Compiles every step, then times them in turn, ``iters`` rounds, each starting one row
    later: a slow spell of the machine, or a row slowed by the one before it, then falls on
    every row alike."""
    compiled = [jax.jit(fn).lower(*args).compile() for _, fn, args in steps]
    for _ in range(warmup):
        for c, (_, _, args) in zip(compiled, steps):
            jax.block_until_ready(c(*args))
    times = [[] for _ in steps]
    n = len(steps)
    for i in range(iters):
        for k in ((i + j) % n for j in range(n)):  # each round starts one row later
            t = time.perf_counter()
            jax.block_until_ready(compiled[k](*steps[k][2]))
            times[k].append(time.perf_counter() - t)
    return [{"row": label, "median_step_ms": 1e3 * statistics.median(ts),
             "min_step_ms": 1e3 * min(ts),
             "temp_size_in_bytes": c.memory_analysis().temp_size_in_bytes}
            for (label, _, _), c, ts in zip(steps, compiled, times)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="also write the rows and the machine here")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    steps = logits_steps()
    # The reference alone: timed in the rounds, its 2 GiB of temporaries slowed whichever row
    # came after it (the cyclic order stays the same whatever row a round starts with).
    logits = (interleaved(steps[:1], max(3, args.iters // 3), 1)
              + interleaved(steps[1:], args.iters, args.warmup))
    head = interleaved(head_steps(), args.iters, args.warmup)
    print(f"{'row':32s} {'median ms':>10s} {'ratio':>7s} {'temp MiB':>9s}")
    for rows, base in ((logits, 1), (head, 0)):
        for r in rows:
            ratio = r["median_step_ms"] / rows[base]["median_step_ms"]
            temp = (r.get("temp_size_in_bytes") or 0) / 2**20
            print(f"{r['row']:32s} {r['median_step_ms']:10.1f} {ratio:7.3f} {temp:9.1f}")
    ref, xla = logits[0], logits[1]
    print(f"xla / reference: time {xla['median_step_ms'] / ref['median_step_ms']:.3f}, "
          f"temp {xla['temp_size_in_bytes'] / ref['temp_size_in_bytes']:.4f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine_description(), "logits": logits, "head": head}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
