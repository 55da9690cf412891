"""``grpo-kernels bench``: time and memory of value_and_grad for each implementation, one process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax

from grpo_kernels.cli import common
from grpo_kernels.cli import mesh as mesh_flags
from grpo_kernels.ops.logits_loss import IMPLEMENTATIONS, grpo_loss
from grpo_kernels.ops.core.dtypes import parse_dtype
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from grpo_kernels.sharding import sharded_grpo_loss

_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                  "alias_size_in_bytes", "generated_code_size_in_bytes")


def impl_list(text: str, implementations=IMPLEMENTATIONS) -> list[str]:
    """``--impl`` as a list of names from ``implementations``, with ``reference`` first."""
    impls = [s.strip() for s in text.split(",") if s.strip()]
    bad = [i for i in impls if i not in implementations]
    if not impls or bad:
        raise ValueError(f"--impl must be a comma list of {sorted(implementations)}, got {text!r}")
    if "reference" not in impls:
        impls.insert(0, "reference")  # ratios are always to the reference of the same run
    return list(dict.fromkeys(impls))


def proc_status_bytes(field: str) -> int | None:
    """``VmRSS``/``VmHWM`` of this process in bytes (Linux), else None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Resets the process's peak-RSS mark (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def machine_description() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": dev.device_kind,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}


def loss_fn(impl: str, inp, config, sharded=None):
    """``logits -> (loss, metrics)`` on one device, or under ``sharded = (mesh, spec)``."""
    if sharded is None:
        return lambda z: grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=config,
                                   impl=impl, **inp.kwargs())
    mesh, spec = sharded
    return lambda z: sharded_grpo_loss(z, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                                       sharding=spec, config=config, impl=impl, **inp.kwargs())


def place(inp, sharded):
    """The inputs laid out as :func:`grpo_kernels.sharding.sharded_grpo_loss` wants them."""
    mesh, spec = sharded
    rows = spec.rows(2)
    return dataclasses.replace(
        inp, logits=mesh_flags.put(mesh, inp.logits, spec.logits()),
        ids=mesh_flags.put(mesh, inp.ids, rows), mask=mesh_flags.put(mesh, inp.mask, rows),
        advantages=mesh_flags.put(mesh, inp.advantages, spec.rows(1)),
        old_logps=mesh_flags.put(mesh, inp.old_logps, rows),
        ref_logps=mesh_flags.put(mesh, inp.ref_logps, rows),
        sampler_logps=None if inp.sampler_logps is None
        else mesh_flags.put(mesh, inp.sampler_logps, rows))


def temp_bytes(step, *args) -> int | None:
    """Planned temporary bytes of ``jit(step)`` on ``args`` (compiled, not run)."""
    analysis = jax.jit(step).lower(*args).compile().memory_analysis()
    return getattr(analysis, "temp_size_in_bytes", None) if analysis else None


def pipelined_ms(fn: Callable[[], Any], calls: int, rounds: int = 3,
                 wait: Callable[[Any], Any] = jax.block_until_ready) -> float:
    """Median over ``rounds`` of the milliseconds per call of ``calls`` back-to-back calls of
    ``fn``, waiting (``wait``) for the last result only.

    A call timed alone (host clock around one call and its wait) also holds the host's
    per-call cost: JAX's dispatch and the wake-up after the device finishes (a large share of
    a millisecond step on an H100: docs/benchmarks.md, "The logits loss on an H100"). Back to
    back, the device runs the calls without waiting on the host whenever a call's device work
    outlasts its dispatch, so this is the device's throughput, as inside a training step. Call
    ``fn`` once untimed first (compile).
    """
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()  # the previous result is freed once its work is done
        wait(out)
        per_call.append((time.perf_counter() - t0) / calls)
        del out
    return 1e3 * statistics.median(per_call)


def measure(impl: str, inp, config, iters: int, warmup: int, show_progress: bool,
            donate: bool = False, sharded=None) -> dict[str, Any]:
    """Compiles and times ``jit(value_and_grad(loss))`` of one implementation.

    With ``donate`` the logits are donated to the step (dlogits may take their buffer); every
    call then gets a fresh copy of the logits, made outside the timed region. With
    ``sharded = (mesh, spec)`` the step is :func:`grpo_kernels.sharding.sharded_grpo_loss` on
    inputs already laid out (:func:`place`); memory figures are then per device, and the
    collectives' bytes per device are added.
    """
    fn = loss_fn(impl, inp, config, sharded)
    step = jax.jit(jax.value_and_grad(fn, has_aux=True), donate_argnums=(0,) if donate else ())

    def logits():
        return jax.block_until_ready(inp.logits + 0) if donate else inp.logits

    # One compilation serves the first-call time and the memory analysis.
    z0 = logits()
    t0 = time.perf_counter()
    compiled = step.lower(inp.logits).compile()
    jax.block_until_ready(compiled(z0))
    first_call_s = time.perf_counter() - t0
    del z0
    analysis = compiled.memory_analysis()
    memory = {f: getattr(analysis, f, None) for f in _MEMORY_FIELDS} if analysis else {}

    def timed_call() -> float:
        z = logits()
        t0 = time.perf_counter()
        out = compiled(z)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - t0
        del out, z
        return elapsed

    for _ in range(warmup):
        timed_call()
    rss_before = proc_status_bytes("VmRSS") if reset_peak_rss() else None
    times = [timed_call() for _ in common.progress(range(iters), iters, f"bench {impl}",
                                                     show_progress)]
    stats = jax.devices()[0].memory_stats() or {}
    peak = proc_status_bytes("VmHWM") if rss_before is not None else None
    # Donated logits need a fresh copy per call, which back-to-back calls would time too.
    pipelined = None if donate else pipelined_ms(lambda: compiled(inp.logits), iters)
    return {
        "impl": impl,
        **(mesh_flags.collective_fields(compiled) if sharded else {}),
        "avg_step_ms": 1e3 * statistics.fmean(times),
        "median_step_ms": 1e3 * statistics.median(times),
        "min_step_ms": 1e3 * min(times),
        "pipelined_step_ms": pipelined,
        "first_call_s": first_call_s,
        **memory,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        # Host memory around the timed steps (Linux): RSS before and the peak during them.
        # Process-wide, so memory kept from earlier work (warm-up, other implementations)
        # counts too; benchmarks/host_memory.py measures each implementation in a fresh process.
        "host_rss_before_bytes": rss_before,
        "host_peak_rss_bytes": peak,
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time and memory of value_and_grad per implementation, ratios to reference",
        description="Runs jit(value_and_grad(loss)) for every implementation in one process on "
        "the same random inputs and prints one JSON object per implementation (time, first call, "
        "compiled memory_analysis, device memory_stats peak when available, ratios to reference), "
        "then a table.",
    )
    p.add_argument("--impl", default="reference,xla", help="comma list (reference always runs)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--time", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16", type=common.dtype_arg,
                   help="logits dtype: bf16 | bfloat16 | f32 | float32 (default bfloat16)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--donate", action="store_true",
                   help="donate the logits to every implementation's step (jit donate_argnums)")
    p.add_argument("--max-time-ratio", type=float,
                   help="exit 1 unless every non-reference median time <= this x reference")
    p.add_argument("--max-temp-ratio", type=float,
                   help="exit 1 unless every non-reference temp bytes <= this x reference")
    p.add_argument("--format", choices=["both", "json", "table"], default="both",
                   help="JSON line per implementation, the table, or both (default)")
    p.add_argument("--max-temp-scaling", type=float,
                   help="with --mesh: exit 1 unless every implementation's per-device temp "
                   "bytes x k <= this x its one-device temp bytes (k = vocab shards)")
    common.add_loss_flags(p)
    mesh_flags.add_mesh_flags(p)
    common.add_wandb_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    impls = impl_list(args.impl)
    common.check_sizes(args, ("batch", "time", "vocab", "iters"))
    if "pallas" in impls and jax.default_backend() == "cpu":
        print("bench: note: on CPU the pallas kernels run in interpret mode (a test tool, orders "
              "of magnitude slower); its times say nothing about TPU/GPU", file=sys.stderr)
    sharded = mesh_flags.setup(args)
    if args.max_temp_scaling is not None and sharded is None:
        raise ValueError("--max-temp-scaling needs --mesh")
    config = common.loss_config_from({}, args)
    inp = random_inputs(args.seed, args.batch, args.time, args.vocab, parse_dtype(args.dtype),
                        config)
    shape = {"batch": args.batch, "time": args.time, "vocab": args.vocab, "dtype": args.dtype,
             "iters": args.iters, "warmup": args.warmup, "donate": args.donate}
    if sharded:
        shape.update(mesh_flags.describe(*sharded))
    machine = machine_description()
    if sharded:
        sharded[1].check_divisible(sharded[0], args.batch, args.vocab, "--batch/--vocab")
    placed = place(inp, sharded) if sharded else inp
    results = [measure(i, placed, config, args.iters, args.warmup, args.format != "json",
                       donate=args.donate, sharded=sharded) for i in impls]
    ok = True
    if sharded:
        ok = mesh_flags.add_scaling(results, shape["vocab_shards"], args.max_temp_scaling,
                                    lambda impl: temp_bytes(jax.value_and_grad(
                                        loss_fn(impl, inp, config), has_aux=True), inp.logits))
    ref = results[0]
    for r in results:
        for key in ("avg_step_ms", "median_step_ms", "first_call_s", "temp_size_in_bytes",
                    "peak_bytes_in_use"):
            a, b = r.get(key), ref.get(key)
            r[f"{key}_ratio_to_reference"] = a / b if a is not None and b else None
        r.update(shape, loss=config.to_dict(), machine=machine)
        if r["impl"] != "reference":
            if args.max_time_ratio is not None:
                r["gate_time"] = r["median_step_ms_ratio_to_reference"] <= args.max_time_ratio
                ok &= r["gate_time"]
            if args.max_temp_ratio is not None and r["temp_size_in_bytes_ratio_to_reference"] is not None:
                r["gate_temp"] = r["temp_size_in_bytes_ratio_to_reference"] <= args.max_temp_ratio
                ok &= r["gate_temp"]
        if args.format != "table":
            print(json.dumps(r))
    if args.format != "json":
        print(f"\nbench B={args.batch} T={args.time} V={args.vocab} {args.dtype}"
              f"{', logits donated' if args.donate else ''}, "
              f"{args.iters} iters after {args.warmup} warm-up, {machine['backend']} "
              f"({machine['device']}), jax {machine['jax']}"
              f"{mesh_flags.title(shape) if sharded else ''}")
        cols = ["impl", "median_step_ms", "avg_step_ms", "first_call_s", "temp_size_in_bytes",
                "peak_bytes_in_use", "median_step_ms_ratio_to_reference",
                "temp_size_in_bytes_ratio_to_reference"]
        if sharded:
            cols += mesh_flags.COLUMNS
        print(common.fmt_table(results, cols))
    common.log_wandb(args, "bench", {**shape, **config.to_dict()},
                     [{f"{r['impl']}/{k}": v for k, v in r.items()} for r in results])
    return 0 if ok else 1
