"""Static facts of the GPU kernels as ptxas compiles them, with no GPU: registers, instructions.

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.6.0   # once: the GPU image's
    python3 benchmarks/probes/triton_static.py --triton-python /tmp/tv/bin/python
    python3 benchmarks/probes/triton_static.py --triton-python /tmp/tv/bin/python --layouts aligned \
        --block-vocab 4096,8192 --num-warps 4,8      # other tilings
    python3 benchmarks/probes/triton_static.py --triton-python /tmp/tv/bin/python --layouts one_pass \
        --block-vocab 8192,16384,32768 --num-warps 8,16,32 --stages 1,2   # the one-pass kernel
    python3 benchmarks/probes/triton_static.py --triton-python /tmp/tv/bin/python --layouts one_pass \
        --l2-hints 0,1                      # without and with its L2 eviction hints

The CPU jaxlib lowers the Pallas GPU kernels to Triton IR; ``pallas_call(debug=True)`` prints
it. This script lowers each layout's ``value_and_grad`` pieces (statistics and gradient, at the
default tiling or each of the given ones) at ``N x V``, strips the printed debug locations, and
hands each module to the given Triton, which compiles it for sm_90 (ptxas and cuobjdump ship
with it). It prints one JSON line per kernel (with its layout, shape and tiling): registers per
thread, stack bytes (spills), SASS instructions, global loads and stores by width and cache
hint, the L2 eviction policies created, ``ex2`` count and barriers. A kernel's occupancy follows
from its registers (65,536 per multiprocessor). Times still need the GPU (``make gpu-proof``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from grpo_kernels import GRPOLossConfig
from grpo_kernels.objective import token_row_grad
from grpo_kernels.ops.logits_loss import pallas_gpu, pallas_gpu_aligned, pallas_gpu_one_pass

KINDS = (*pallas_gpu.LAYOUTS, "one_pass")

_COMPILE = r"""
import collections, json, os, re, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for path, warps, meta in json.loads(sys.argv[1]):
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 2})
    cubin = path + ".cubin"
    open(cubin, "wb").write(k.asm["cubin"])
    res = subprocess.run([bin_dir + "/cuobjdump", "-res-usage", cubin], capture_output=True,
                         text=True).stdout
    sass = subprocess.run([bin_dir + "/cuobjdump", "-sass", cubin], capture_output=True,
                          text=True).stdout
    ins = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
    ptx = k.asm["ptx"]
    print(json.dumps({
        "kernel": os.path.basename(path)[:-5], **meta, "num_warps": warps,
        "registers": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", res).group(1)),
        "sass_instructions": len(ins),
        "loads": dict(collections.Counter(re.findall(r"ld\.global[.\w:]*", ptx))),
        "stores": dict(collections.Counter(re.findall(r"st\.global[.\w:]*", ptx))),
        "ex2": ptx.count("ex2.approx"), "cp_async": ptx.count("cp.async."),
        "l2_policies": dict(collections.Counter(re.findall(r"createpolicy[.\w:]*", ptx))),
        "barriers": sum("BAR" in l for l in ins)}), flush=True)
"""


def _one_pass(z, ids, lse, coef, blocks):
    """The one-pass kernel on the default loss with old and reference log-probs (``lse`` and
    ``coef`` stand in for its float32 columns)."""
    cfg = GRPOLossConfig(beta=0.04)
    cols = {"weights": coef, "advantages": coef, "old_logp": lse, "ref_logp": lse,
            "mask": coef}
    return pallas_gpu_one_pass.one_pass(z, ids, cols,
                                        lambda lp, c: token_row_grad(lp, c, cfg), 1.0, blocks)


def triton_modules(n: int, vocab: int, dtype, blocks) -> list[tuple[str, str]]:
    """``(kernel name, Triton IR text without locations)`` of one tiling's kernels
    (``blocks``: a ``GpuBlocks``, or a ``OnePassBlocks`` for the one-pass kernel)."""
    real = pl.pallas_call

    def debug_call(*args, **kw):
        return real(*args, **{**kw, "debug": True})

    spec = jax.ShapeDtypeStruct
    z, ids, row = spec((n, vocab), dtype), spec((n,), jnp.int32), spec((n,), jnp.float32)
    out = io.StringIO()
    mods = (pallas_gpu.pl, pallas_gpu_aligned.pl, pallas_gpu_one_pass.pl)
    one_pass = isinstance(blocks, pallas_gpu_one_pass.OnePassBlocks)
    try:
        for m in mods:
            m.pallas_call = debug_call
        with contextlib.redirect_stdout(out):
            if not one_pass:
                jax.jit(lambda z, i: pallas_gpu.row_statistics(z, i, 1.0, blocks)).trace(
                    z, ids).lower(lowering_platforms=("cuda",))
            grad = (functools.partial(_one_pass, blocks=blocks) if one_pass else
                    lambda z, i, lse, c: pallas_gpu.logits_gradient(z, i, lse, c, 1.0, blocks))
            jax.jit(grad).trace(z, ids, row, row).lower(lowering_platforms=("cuda",))
    finally:
        for m in mods:
            m.pallas_call = real
    found = re.findall(r"The Triton module for pallas_call (\S+) .*?\n(module @.*?\n}[^\n]*\n)",
                       out.getvalue(), re.S)
    cleaned = []
    for name, body in found:
        body = re.sub(r' "[^"\n]*"\(#loc\d*\)', "", body)
        body = re.sub(r" \[unknown\]", "", body)
        cleaned.append((name, re.sub(r" loc\(#loc\d*\)", "", body)))
    return cleaned


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triton-python", required=True,
                   help="a Python with triton installed (3.6.0: the GPU image's)")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151643)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--layouts", default=",".join(pallas_gpu.LAYOUTS),
                   help=f"comma list of {KINDS} (one_pass: the one-pass kernel)")
    p.add_argument("--block-vocab", default="",
                   help="comma list of vocabulary tiles (default: plan_blocks's)")
    p.add_argument("--num-warps", default="", help="comma list (default: plan_blocks's)")
    p.add_argument("--stages", default="",
                   help="comma list of the one-pass kernel's load stages (default: "
                   "plan_blocks's)")
    p.add_argument("--l2-hints", default="",
                   help="comma list of 0/1: the one-pass kernel without and with its L2 "
                   "eviction hints (default: plan_blocks's)")
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(KINDS):
        p.error(f"--layouts must be a comma list of {KINDS}, got {args.layouts!r}")
    try:
        tiles = [int(x) for x in args.block_vocab.split(",") if x] or [None]
        warps = [int(x) for x in args.num_warps.split(",") if x] or [None]
        stages = [int(x) for x in args.stages.split(",") if x] or [None]
        hints = [bool(int(x)) for x in args.l2_hints.split(",") if x] or [None]
    except ValueError:
        p.error(f"--block-vocab, --num-warps, --stages and --l2-hints want comma lists of "
                f"integers, got {args.block_vocab!r}, {args.num_warps!r}, {args.stages!r} "
                f"and {args.l2_hints!r}")
    if (stages != [None] or hints != [None]) and layouts != ["one_pass"]:
        p.error("--stages and --l2-hints are the one-pass kernel's: give them with "
                "--layouts one_pass")
    with tempfile.TemporaryDirectory() as tmp:
        todo = []
        for layout, tile, warp, stage, hint in itertools.product(layouts, tiles, warps, stages,
                                                                 hints):
            if layout == "one_pass":
                blocks = pallas_gpu_one_pass.plan_blocks(args.rows, args.vocab, tile,
                                                         stages=stage)
                if hint is not None:
                    blocks = dataclasses.replace(blocks, l2_hints=hint)
            else:
                blocks = pallas_gpu.plan_blocks(args.vocab, tile, layout)
            blocks = dataclasses.replace(blocks, num_warps=warp or blocks.num_warps)
            for i, (name, text) in enumerate(triton_modules(args.rows, args.vocab,
                                                            jnp.dtype(args.dtype), blocks)):
                extra = ({"stages": blocks.stages, "l2_hints": blocks.l2_hints}
                         if layout == "one_pass" else {})
                tag = "".join(f"_{v:d}" for v in extra.values())  # one file per variant
                path = Path(tmp) / (f"{layout}_bv{blocks.block_vocab}_w{blocks.num_warps}{tag}_"
                                    f"{i}_{name}.ttir")
                path.write_text(text)
                todo.append((str(path), blocks.num_warps, {
                    "layout": layout, "rows": args.rows, "vocab": args.vocab,
                    "dtype": args.dtype, "block_vocab": blocks.block_vocab, **extra}))
        r = subprocess.run([args.triton_python, "-c", _COMPILE, json.dumps(todo)],
                           capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode:
            sys.stderr.write(r.stderr[-3000:])
        return r.returncode


if __name__ == "__main__":
    sys.exit(main())
