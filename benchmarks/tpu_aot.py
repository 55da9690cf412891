"""The TPU kernels compiled by the TPU compiler itself, with no TPU: a deviceless compile.

    make .venv/.installed-dev            # puts libtpu (the one jax pins) in .venv/libtpu
    python3 benchmarks/tpu_aot.py        # every generation, the issue's logits shapes
    python3 benchmarks/tpu_aot.py --op lm_head --generations v4,v6e
    python3 benchmarks/tpu_aot.py --batch 4 --time 1024 --logits-layout default

libtpu carries XLA:TPU and Mosaic. jax's compile-only client (``jax.experimental.topologies``)
loads it on a CPU host and compiles a program for a named TPU topology: XLA's layout
assignment and buffer plan, and Mosaic's passes that ``jax.export`` never reaches (VMEM
allocation among them; a kernel whose blocks exceed the chip's VMEM fails here as it would on
the chip). For each case this prints one JSON line: whether the step (``value_and_grad`` of
the loss, as a trainer runs it) compiled, the error's first line if not, and the compiled
program's planned memory (arguments, outputs, temporaries, aliased bytes), its copies of
logits-sized arrays and its custom calls. Nothing runs: no times come from here.

``--logits-layout``: the logits of the logits-level step arrive as a jit argument, and a TPU
gives an argument its own default layout, which for a vocabulary that is not a multiple of 128
keeps the vocabulary off the minor dimension. ``row-major`` (the default) asks for the layout a
head matmul inside the same jit produces for the kernel, ``default`` shows the other.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.core.dtypes import DTYPE_CHOICES, parse_dtype
from grpo_kernels.ops.core.tpu import GENERATIONS

# A topology name per generation as libtpu 0.0.42 spells them (one host of each).
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2",
              "v7x": "tpu7x:2x2x1"}
DEFAULT_LIBTPU = Path(__file__).resolve().parents[1] / ".venv/libtpu/libtpu/libtpu.so"


def libtpu_path(given: str | None = None) -> Path | None:
    """``given``, else ``$TPU_LIBRARY_PATH``, else the Makefile's ``.venv/libtpu``; None when
    the file is not there."""
    path = Path(given or os.environ.get("TPU_LIBRARY_PATH") or DEFAULT_LIBTPU)
    return path if path.is_file() else None


def device(generation: str):
    """The first compile-only device of ``generation``'s topology."""
    from jax.experimental import topologies
    return topologies.get_topology_desc(TOPOLOGIES[generation], "tpu").devices[0]


def _spec(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def logits_step(generation, dev, b, t, v, dtype, level, layout):
    """``(step, args, logits bytes)`` of the logits-level loss on the TPU kernels."""
    from jax.experimental.layout import Format, Layout

    from grpo_kernels.ops.logits_loss.api import grpo_loss
    from grpo_kernels.ops.logits_loss.pallas import PallasOptions
    sh = jax.sharding.SingleDeviceSharding(dev)
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level)
    opts = PallasOptions(kernel="tpu", interpret=False, tpu_generation=generation)

    def loss(z, ids, mask, adv, old, ref):
        return grpo_loss(z, ids, mask, adv, config=cfg, impl="pallas", old_logps=old,
                         ref_logps=ref, options=opts)

    z_sh = sh if layout == "default" else Format(Layout(major_to_minor=(0, 1, 2)), sh)
    f32 = jnp.float32
    args = (_spec((b, t, v), dtype, z_sh), _spec((b, t), jnp.int32, sh), _spec((b, t), f32, sh),
            _spec((b,), f32, sh), _spec((b, t), f32, sh), _spec((b, t), f32, sh))
    step = jax.value_and_grad(loss, has_aux=True)
    nbytes = b * t * v * jnp.dtype(dtype).itemsize
    if layout == "default":
        return jax.jit(step), args, nbytes
    # The gradient leaves in the layout the logits came in, as a head's backward takes it.
    return jax.jit(step, out_shardings=((None, None), z_sh)), args, nbytes


def head_step(generation, dev, b, t, h, v, dtype, level):
    """``(step, args, logits bytes)`` of the fused LM-head loss on its TPU kernels."""
    from grpo_kernels.ops.lm_head_loss.api import grpo_loss_from_hidden
    from grpo_kernels.ops.lm_head_loss.pallas_options import LmHeadPallasOptions
    sh = jax.sharding.SingleDeviceSharding(dev)
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level)
    opts = LmHeadPallasOptions(interpret=False, tpu_generation=generation)

    def loss(x, w, ids, mask, adv, old, ref):
        return grpo_loss_from_hidden(x, w, ids, mask, adv, config=cfg, old_logps=old,
                                     ref_logps=ref, impl="pallas", options=opts)

    f32 = jnp.float32
    args = (_spec((b, t, h), dtype, sh), _spec((h, v), dtype, sh),
            _spec((b, t), jnp.int32, sh), _spec((b, t), f32, sh), _spec((b,), f32, sh),
            _spec((b, t), f32, sh), _spec((b, t), f32, sh))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return step, args, b * t * v * jnp.dtype(dtype).itemsize


def logits_copies(hlo: str, b: int, t: int, v: int) -> int:
    """``copy`` ops in the compiled HLO whose result has the logits' elements (a relayout)."""
    shapes = (rf"\[{b},{t},{v}\]", rf"\[{b * t},{v}\]")
    return sum(len(re.findall(rf"= \w+{s}\{{[^}}]*\}} copy\(", hlo)) for s in shapes)


def compile_case(step, args, logits_bytes: int, shape: tuple[int, int, int]) -> dict:
    """Compile ``step`` at ``args``; the row's outcome and planned memory."""
    t0 = time.perf_counter()
    try:
        compiled = step.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a compile error is this row's result
        text = str(e)
        vmem = re.search(r"Used ([\d.]+\w) of ([\d.]+\w) vmem", text)
        return {"ok": False, "error": text.strip().splitlines()[0][:300],
                "vmem_used_of": list(vmem.groups()) if vmem else None}
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    return {"ok": True, "compile_s": round(time.perf_counter() - t0, 2),
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "logits_bytes": logits_bytes, "logits_copies": logits_copies(hlo, *shape),
            "tpu_custom_calls": hlo.count('custom_call_target="tpu_custom_call"'),
            "kernels": sorted(set(re.findall(r"(grpo_[a-z_]+)\)*/pallas_call", hlo)))}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = text.split(",")
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not among {list(allowed)}")
        return names
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--op", type=_names(("logits", "lm_head")), default=["logits"],
                   help="logits (the logits-level loss) and/or lm_head (the fused head)")
    p.add_argument("--generations", type=_names(GENERATIONS), default=list(GENERATIONS),
                   help=f"comma-separated, of {','.join(GENERATIONS)} (default: all)")
    p.add_argument("--batch", type=_ints, default=[1], help="comma-separated B values")
    p.add_argument("--time", type=_ints, default=[2048], help="comma-separated T values")
    p.add_argument("--vocab", type=int, default=151_643, help="V (default: Qwen2.5's 151,643)")
    p.add_argument("--hidden", type=int, default=4096, help="H of the fused head")
    p.add_argument("--dtype", type=_names(DTYPE_CHOICES),
                   default=["bfloat16", "float32"], help="comma-separated logits dtypes")
    p.add_argument("--level", type=_names(("token", "sequence")),
                   default=["token", "sequence"], help="importance-sampling level")
    p.add_argument("--logits-layout", choices=("row-major", "default"), default="row-major",
                   help="the logits argument's layout (see below)")
    p.add_argument("--libtpu", help="libtpu.so (default: $TPU_LIBRARY_PATH, then "
                   ".venv/libtpu/libtpu/libtpu.so)")
    p.add_argument("--out", help="also append the JSON lines to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    lib = libtpu_path(args.libtpu)
    if lib is None:
        print("tpu_aot: no libtpu.so (give --libtpu or TPU_LIBRARY_PATH, or run "
              "`make .venv/.installed-dev`, which puts it in .venv/libtpu)", file=sys.stderr)
        return 2
    os.environ["TPU_LIBRARY_PATH"] = str(lib)
    # Before JAX starts its backends: the host's own is the CPU (libtpu only compiles here),
    # and libtpu's /tmp/libtpu_lockfile, which keeps a second process off a chip, would stop
    # parallel test workers that each run this script, though no chip is touched.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    out = open(args.out, "a") if args.out else None
    failed = 0
    for gen in args.generations:
        dev = device(gen)
        for op, b, t, dname, level in itertools.product(args.op, args.batch, args.time,
                                                        args.dtype, args.level):
            dtype = parse_dtype(dname)
            if op == "logits":
                step, a, nbytes = logits_step(gen, dev, b, t, args.vocab, dtype, level,
                                              args.logits_layout)
            else:
                step, a, nbytes = head_step(gen, dev, b, t, args.hidden, args.vocab, dtype,
                                            level)
            row = {"op": op, "generation": gen, "device_kind": dev.device_kind, "batch": b,
                   "time": t, "vocab": args.vocab, "dtype": jnp.dtype(dtype).name,
                   "level": level,
                   "logits_layout": args.logits_layout if op == "logits" else None,
                   "hidden": args.hidden if op == "lm_head" else None}
            row.update(compile_case(step, a, nbytes, (b, t, args.vocab)))
            failed += not row["ok"]
            line = json.dumps(row)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
    if out:
        out.close()
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
