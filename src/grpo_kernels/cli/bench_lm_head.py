"""``grpo-kernels bench-lm-head``: the fused LM-head loss against materialised logits and the
matmul floor, every contender in one process on the same inputs."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.cli import common
from grpo_kernels.cli import mesh as mesh_flags
from grpo_kernels.cli.bench import _MEMORY_FIELDS, impl_list, machine_description, temp_bytes
from grpo_kernels.ops.lm_head_loss import (
    IMPLEMENTATIONS,
    LAYOUTS,
    LmHeadBlockSizes,
    grpo_loss_from_hidden,
)
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.ops.core.dtypes import parse_dtype
from grpo_kernels.sharding import sharded_grpo_loss_from_hidden


def time_compiled(name: str, fn: Callable[..., Any], args: tuple[Any, ...], iters: int,
                  warmup: int, show_progress: bool, collectives: bool = False) -> dict[str, Any]:
    """Compiles ``jit(fn)`` once (first-call time, memory analysis), then times ``iters`` calls.

    With ``collectives``, the bytes each device receives from collectives are added.
    """
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    first_call_s = time.perf_counter() - t0
    analysis = compiled.memory_analysis()
    memory = {f: getattr(analysis, f, None) for f in _MEMORY_FIELDS} if analysis else {}
    if collectives:
        memory.update(mesh_flags.collective_fields(compiled))

    def call() -> float:
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return time.perf_counter() - t

    for _ in range(warmup):
        call()
    times = [call() for _ in common.progress(range(iters), iters, f"bench {name}",
                                             show_progress)]
    stats = jax.devices()[0].memory_stats() or {}
    return {"impl": name, "median_step_ms": 1e3 * statistics.median(times),
            "avg_step_ms": 1e3 * statistics.fmean(times), "min_step_ms": 1e3 * min(times),
            "first_call_s": first_call_s, **memory,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-lm-head",
        help="fused LM-head loss vs materialised logits, with the matmul floor",
        description="Times jit(value_and_grad) w.r.t. hidden and lm_head of each implementation "
        "of grpo_loss_from_hidden, and one [N,H]x[H,V] matmul (the floor: a gradient of h W "
        "costs at least three of them), all in one process on the same random inputs. Prints a "
        "JSON object per row and a table with time / reference, temp bytes / reference and "
        "time / (3 x matmul).",
    )
    p.add_argument("--impl", default="reference,xla", help="comma list (reference always runs)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--time", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="float32", type=common.dtype_arg,
                   help="operand dtype: bf16 | bfloat16 | f32 | float32 (default float32)")
    p.add_argument("--layout", default="hv", choices=LAYOUTS, help="lm_head layout")
    p.add_argument("--chunk-tokens", type=int, help="xla chunk rows (default: planned)")
    p.add_argument("--dweight", default="tokens", choices=["tokens", "vocab", "both"],
                   help="how xla forms the weight gradient (LmHeadBlockSizes.dweight); both: "
                   "two xla rows, the second labelled xla/dweight=vocab (default tokens)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-floor-ratio", type=float,
                   help="exit 1 unless every fused median time <= this x (3 x matmul)")
    p.add_argument("--max-time-ratio", type=float,
                   help="exit 1 unless every fused median time <= this x reference")
    p.add_argument("--max-temp-ratio", type=float,
                   help="exit 1 unless every fused temp bytes <= this x reference")
    p.add_argument("--max-temp-scaling", type=float,
                   help="with --mesh: exit 1 unless every fused implementation's per-device "
                   "temp bytes x k <= this x its one-device temp bytes (k = vocab shards)")
    p.add_argument("--format", choices=["both", "json", "table"], default="both")
    common.add_loss_flags(p)
    mesh_flags.add_mesh_flags(p)
    common.add_wandb_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    impls = impl_list(args.impl, IMPLEMENTATIONS)
    common.check_sizes(args, ("batch", "time", "hidden", "vocab", "iters"))
    if args.chunk_tokens is not None and args.chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}")
    if "pallas" in impls and jax.default_backend() == "cpu":
        print("bench-lm-head: note: on CPU the pallas kernels run in interpret mode; their "
              "times say nothing about TPU", file=sys.stderr)
    sharded = mesh_flags.setup(args)
    if args.max_temp_scaling is not None and sharded is None:
        raise ValueError("--max-temp-scaling needs --mesh")
    config = common.loss_config_from({}, args)
    dtype = parse_dtype(args.dtype)
    inp = random_head_inputs(args.seed, args.batch, args.time, args.hidden, args.vocab, dtype,
                             config, layout=args.layout)
    show = args.format != "json"

    # (row label, impl, dweight): with --dweight both, xla runs once per mode.
    modes = ("tokens", "vocab") if args.dweight == "both" else (args.dweight,)
    rows = [(i if (i != "xla" or d == "tokens") else f"xla/dweight={d}", i, d)
            for i in impls for d in (modes if i == "xla" else ("tokens",))]
    variant = {label: (impl, dweight) for label, impl, dweight in rows}

    def step_for(label: str, on_mesh: bool = True):
        impl, dweight = variant[label]
        kw: dict[str, Any] = {}
        if impl == "xla":  # chunk_tokens None: planned
            kw["options"] = LmHeadBlockSizes(chunk_tokens=args.chunk_tokens, dweight=dweight)
        if sharded and on_mesh:
            kw.update(mesh=sharded[0], sharding=sharded[1])
            op = sharded_grpo_loss_from_hidden
        else:
            op = grpo_loss_from_hidden

        def loss(h, w):
            return op(h, w, inp.ids, inp.mask, inp.advantages, config=config, impl=impl,
                      lm_head_layout=args.layout, **inp.kwargs(), **kw)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

    args_ = (inp.hidden, inp.lm_head)
    if sharded:
        mesh, spec = sharded
        spec.check_divisible(mesh, args.batch, args.vocab, "--batch/--vocab")
        args_ = (mesh_flags.put(mesh, inp.hidden, spec.rows(3)),
                 mesh_flags.put(mesh, inp.lm_head, spec.head(args.layout)))
    results = [time_compiled(label, step_for(label), args_, args.iters, args.warmup, show,
                             collectives=bool(sharded)) for label, _, _ in rows]
    ok = True
    if sharded:
        ok = mesh_flags.add_scaling(
            results, spec.vocab_shards(mesh), None,
            lambda impl: temp_bytes(step_for(impl, on_mesh=False), inp.hidden, inp.lm_head))
    n = args.batch * args.time
    dims = (((1,), (0 if args.layout == "hv" else 1,)), ((), ()))
    floor = time_compiled(
        "matmul", lambda h, w: jax.lax.dot_general(h.reshape(n, args.hidden), w, dims,
                                                   preferred_element_type=jnp.float32),
        (inp.hidden, inp.lm_head), args.iters, args.warmup, show)
    shape = {"batch": args.batch, "time": args.time, "hidden": args.hidden,
             "vocab": args.vocab, "dtype": args.dtype, "layout": args.layout,
             "iters": args.iters, "warmup": args.warmup}
    if sharded:
        shape.update(mesh_flags.describe(*sharded))
    machine = machine_description()
    ref = results[0]
    for r in [*results, floor]:
        for key in ("median_step_ms", "first_call_s", "temp_size_in_bytes", "peak_bytes_in_use"):
            a, b = r.get(key), ref.get(key)
            r[f"{key}_ratio_to_reference"] = a / b if a is not None and b else None
        r["time_over_3_matmuls"] = r["median_step_ms"] / (3 * floor["median_step_ms"])
        r.update(shape, loss=config.to_dict(), machine=machine)
        if r["impl"] not in ("reference", "matmul"):
            gates = (("gate_floor", "time_over_3_matmuls", args.max_floor_ratio),
                     ("gate_time", "median_step_ms_ratio_to_reference", args.max_time_ratio),
                     ("gate_temp", "temp_size_in_bytes_ratio_to_reference", args.max_temp_ratio),
                    ("gate_temp_scaling", "temp_scaling", args.max_temp_scaling))
            for gate, key, limit in gates:
                if limit is not None and r[key] is not None:
                    r[gate] = r[key] <= limit
                    ok &= r[gate]
        if args.format != "table":
            print(json.dumps(r))
    if args.format != "json":
        print(f"\nbench-lm-head B={args.batch} T={args.time} H={args.hidden} V={args.vocab} "
              f"{args.dtype} layout={args.layout}, {args.iters} iters after {args.warmup} "
              f"warm-up, {machine['backend']} ({machine['device']}), jax {machine['jax']}"
              f"{mesh_flags.title(shape) if sharded else ''}")
        cols = ["impl", "median_step_ms", "first_call_s", "temp_size_in_bytes",
                "peak_bytes_in_use", "median_step_ms_ratio_to_reference",
                "temp_size_in_bytes_ratio_to_reference", "time_over_3_matmuls"]
        if sharded:
            cols += mesh_flags.COLUMNS
        print(common.fmt_table([*results, floor], cols))
    common.log_wandb(args, "bench-lm-head", {**shape, **config.to_dict()},
                     [{f"{r['impl']}/{k}": v for k, v in r.items()} for r in [*results, floor]])
    return 0 if ok else 1
