"""Device peak memory of one ``value_and_grad`` step of one implementation, in a fresh process.

``memory_stats()["peak_bytes_in_use"]`` is a process-wide high-water mark that cannot be reset,
so ``grpo-kernels bench`` (every implementation in one process) cannot attribute it. This script
runs one implementation of one op, with the inputs drawn on the host CPU backend and then
placed on the accelerator, so the device's mark holds only the inputs and the step itself.

    python3 -m grpo_kernels.proof.device_memory --op logits --impl pallas --batch 1 --time 2048 \\
        --vocab 151643 --dtype bfloat16
    python3 -m grpo_kernels.proof.device_memory --op lm_head --impl xla --batch 1 --time 8192 \\
        --hidden 4096 --vocab 151936 --dtype bfloat16 [--dweight vocab] [--chunk-tokens 1024]

Prints one JSON line: bytes in use before the step (the inputs), the peak, the step's output
bytes, and for the logits op the budget ``logits + dlogits`` (``2 N V b``).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp

from grpo_kernels import (GRPOLossConfig, LmHeadBlockSizes, PallasOptions, grpo_loss,
                          grpo_loss_from_hidden)
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.ops.core.dtypes import parse_dtype
from grpo_kernels.ops.logits_loss.inputs import random_inputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=["logits", "lm_head"], required=True)
    p.add_argument("--impl", required=True, help="reference, xla or pallas")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--time", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--hidden", type=int, help="--op lm_head only")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", choices=["hv", "vh"], default="hv",
                   help="--op lm_head: the head's layout, [H, V] or [V, H] (nn.Linear, tied "
                   "embeddings, Liger's) (default: hv)")
    p.add_argument("--dweight", choices=["tokens", "vocab"],
                   help="--op lm_head --impl xla: LmHeadBlockSizes.dweight (default: the op's)")
    p.add_argument("--chunk-tokens", type=int,
                   help="--op lm_head --impl xla: LmHeadBlockSizes.chunk_tokens (default: "
                   "planned from the chunk budget)")
    p.add_argument("--compile-cache", metavar="DIR",
                   help="JAX's persistent compilation cache: run twice with the same DIR and "
                   "the second run's peak holds no compile-time allocation (XLA:GPU's "
                   "autotuner's buffers)")
    p.add_argument("--buffer-report", metavar="FILE",
                   help="also write XLA's memory-usage report of the step's program (its "
                   "buffer assignment: what holds the peak) to FILE")
    p.add_argument("--donate", action="store_true",
                   help="donate the logits (--op logits; pallas then writes dlogits into them)")
    args = p.parse_args(argv)
    if args.op == "lm_head" and args.hidden is None:
        p.error("--op lm_head needs --hidden")
    head_flags = args.dweight is not None or args.chunk_tokens is not None
    if head_flags and (args.op, args.impl) != ("lm_head", "xla"):
        p.error("--dweight and --chunk-tokens are options of --op lm_head --impl xla")
    head_options = None
    if head_flags:
        try:
            head_options = LmHeadBlockSizes(chunk_tokens=args.chunk_tokens,
                                            dweight=args.dweight or "tokens")
        except ValueError as e:
            p.error(str(e))
    dump = None
    if args.buffer_report:  # before the backend starts, which reads XLA_FLAGS once
        dump = tempfile.mkdtemp(prefix="device_memory_")
        atexit.register(shutil.rmtree, dump, True)  # also where the run skips or fails
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                                   "--xla_dump_hlo_module_re=jit_loss").strip()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    dev = jax.devices()[0]
    if dev.memory_stats() is None:
        # 3 = skipped, with its reason (the proof's convention for phases a backend lacks)
        print(f"device_memory: skipped: {dev.platform} reports no memory_stats()",
              file=sys.stderr)
        return 3
    dtype = parse_dtype(args.dtype)
    config = GRPOLossConfig(max_completion_length=args.time)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):  # the inputs' own temporaries stay off the accelerator
        if args.op == "logits":
            inp = random_inputs(0, args.batch, args.time, args.vocab, dtype, config)
        else:
            inp = random_head_inputs(0, args.batch, args.time, args.hidden, args.vocab, dtype,
                                     config, layout=args.layout)
    inp = dataclasses.replace(inp, **{
        f.name: None if getattr(inp, f.name) is None else jax.device_put(getattr(inp, f.name), dev)
        for f in dataclasses.fields(inp)})
    jax.block_until_ready([getattr(inp, f.name) for f in dataclasses.fields(inp)])

    if args.op == "logits":
        # Donated logits can take dlogits only where the kernel writes into its input.
        extra = ({"options": PallasOptions(alias_logits=True)}
                 if args.donate and args.impl == "pallas" else {})

        def loss(z):
            return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=config,
                             impl=args.impl, **inp.kwargs(), **extra)
        step = jax.jit(jax.value_and_grad(loss, has_aux=True),
                       donate_argnums=(0,) if args.donate else ())
        operands = (inp.logits,)
    else:
        def loss(h, w):
            return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                         config=config, impl=args.impl, options=head_options,
                                         lm_head_layout=args.layout,
                                         old_logps=inp.old_logps, ref_logps=inp.ref_logps)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        operands = (inp.hidden, inp.lm_head)

    compiled = step.lower(*operands).compile()
    before = dev.memory_stats()["bytes_in_use"]
    compile_peak = dev.memory_stats()["peak_bytes_in_use"]
    out = compiled(*operands)
    jax.block_until_ready(out)
    stats = dev.memory_stats()
    (value, _), grads = out
    out_bytes = sum(x.nbytes for x in jax.tree.leaves(grads))
    analysis = compiled.memory_analysis()
    record = {
        "op": args.op, "impl": args.impl, "batch": args.batch, "time": args.time,
        "vocab": args.vocab, "hidden": args.hidden, "dtype": args.dtype, "donate": args.donate,
        "layout": args.layout if args.op == "lm_head" else None, "dweight": args.dweight,
        "chunk_tokens": args.chunk_tokens,
        "device": dev.device_kind, "jax": jax.__version__,
        "loss": float(value), "finite": bool(jnp.isfinite(value)),
        "bytes_in_use_before": before, "peak_after_compile": compile_peak,
        "peak_bytes_in_use": stats["peak_bytes_in_use"],
        "step_peak_over_inputs": stats["peak_bytes_in_use"] - before,
        "gradient_bytes": out_bytes,
        "temp_size_in_bytes": getattr(analysis, "temp_size_in_bytes", None),
    }
    if args.op == "logits":
        nvb = inp.logits.nbytes
        record["logits_plus_dlogits"] = 2 * nvb
        record["peak_over_logits_plus_dlogits"] = stats["peak_bytes_in_use"] / (2 * nvb)
    if dump is not None:
        record["buffer_report"] = keep_buffer_report(dump, args.buffer_report)
    print(json.dumps(record))
    return 0


def keep_buffer_report(dump: str, dest: str) -> str | None:
    """Copies the largest memory-usage report XLA dumped into ``dump`` (the step's program,
    ``jit_loss``, after optimisations) to ``dest`` and removes ``dump``; ``dest``, or None if
    none was written."""
    reports = [os.path.join(dump, f) for f in os.listdir(dump)
               if f.endswith("memory-usage-report.txt")]
    if reports:
        shutil.copyfile(max(reports, key=os.path.getsize), dest)
    shutil.rmtree(dump, ignore_errors=True)
    return dest if reports else None


if __name__ == "__main__":
    sys.exit(main())
