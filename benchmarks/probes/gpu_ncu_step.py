"""One ``value_and_grad`` step of the logits loss, for Nsight Compute to profile kernel by kernel.

The step is compiled and run ``--warmup`` times, then run once more between
``cudaProfilerStart`` and ``cudaProfilerStop``, so that ``ncu --profile-from-start off`` sees
exactly one step's kernels (no compile-time autotuning, no input generation)::

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        python3 benchmarks/probes/gpu_ncu_step.py --impl pallas --batch 1 --time 2048 --vocab 151643

Without ncu it prints the step's median time, so it also runs (and is smoke-tested) on a CPU,
where the profiler calls are skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib
import json
import sys

import jax
import jax.numpy as jnp

from grpo_kernels import GRPOLossConfig
from grpo_kernels.cli.bench import loss_fn
from grpo_kernels.ops.core.dtypes import parse_dtype
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from grpo_kernels.ops.logits_loss.api import IMPLEMENTATIONS
from grpo_kernels.proof.timing import median_ms


def cudart():
    """The CUDA runtime library (for the profiler window), or None where there is none."""
    path = ctypes.util.find_library("cudart")
    if path:
        return ctypes.CDLL(path)
    try:  # the wheels' runtime, which importing torch loads into the process
        importlib.import_module("torch")
        return ctypes.CDLL("libcudart.so.13")
    except (ImportError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", default="pallas", choices=list(IMPLEMENTATIONS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--time", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151643)
    p.add_argument("--dtype", type=parse_dtype, default=jnp.bfloat16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed calls before the profiled one")
    args = p.parse_args(argv)
    if min(args.batch, args.time, args.vocab, args.warmup, args.iters) < 1:
        p.error("--batch, --time, --vocab, --warmup and --iters must be >= 1")
    config = GRPOLossConfig()
    inp = random_inputs(0, args.batch, args.time, args.vocab, args.dtype, config)
    step = jax.jit(jax.value_and_grad(loss_fn(args.impl, inp, config), has_aux=True))
    ms = median_ms(lambda: step(inp.logits), args.iters, args.warmup)
    lib = cudart() if jax.default_backend() == "gpu" else None
    if lib is not None:
        lib.cudaProfilerStart()
    jax.block_until_ready(step(inp.logits))
    if lib is not None:
        lib.cudaProfilerStop()
    print(json.dumps({"impl": args.impl, "batch": args.batch, "time": args.time,
                      "vocab": args.vocab, "dtype": jnp.dtype(args.dtype).name,
                      "median_ms": ms, "profiler_window": lib is not None,
                      "backend": jax.default_backend()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
