"""The TPU kernels compiled by the TPU compiler itself, with no TPU: a deviceless compile.

    make .venv/.installed-dev            # puts libtpu (the one jax pins) in .venv/libtpu
    python3 benchmarks/tpu_aot.py        # every generation, the issue's logits shapes
    python3 benchmarks/tpu_aot.py --op lm_head --generations v4,v6e
    python3 benchmarks/tpu_aot.py --batch 4 --time 1024 --logits-layout default
    python3 benchmarks/tpu_aot.py --impl reference,xla,pallas --mesh dp=2,tp=4 --batch 8
    python3 benchmarks/tpu_aot.py --op layout-rule     # ops.core.tpu.row_major_by_default

libtpu carries XLA:TPU and Mosaic. jax's compile-only client (``jax.experimental.topologies``)
loads it on a CPU host and compiles a program for a named TPU topology: XLA's layout
assignment and buffer plan, and Mosaic's passes that ``jax.export`` never reaches (VMEM
allocation among them; a kernel whose blocks exceed the chip's VMEM fails here as it would on
the chip). For each case this prints one JSON line: whether the step (``value_and_grad`` of
the loss, as a trainer runs it) compiled, the error's first line if not, and the compiled
program's planned memory per device (arguments, outputs, temporaries, aliased bytes), its
relayout copies of logits-sized and head-sized arrays, its custom calls and, on a mesh, the
bytes its collectives carry. Nothing runs: no times come from here.

``--mesh`` compiles the ``grpo_kernels.sharding`` entry points over the first devices of the
smallest topology of the generation that has enough (``v5e:2x4``, 8 chips, is a two-host
slice, so its program is the one each of the two hosts compiles); ``tp`` splits the
vocabulary, the other axes the batch. ``--impl`` compiles several implementations of the
same step to compare their plans; xla, with its default options, plans its chunks for the TPU
it is lowered for (not for this host's CPU).

``--logits-layout``: the logits of the logits-level step arrive as a jit argument, and a TPU
gives an argument its own default layout, which for a vocabulary that is not a multiple of 128
keeps the vocabulary off the minor dimension. ``row-major`` (the default) asks for the layout a
head matmul inside the same jit produces for the kernel, ``default`` shows the other. The head
weights of ``--op lm_head`` always arrive in their default layout, as a trainer's parameters
do (``--lm-head-layout`` picks ``[H, V]`` or ``[V, H]``).

``--op layout-rule`` compiles ``w * 2`` for rank-2 arguments of many shapes and checks the
layout XLA gives each against ``grpo_kernels.ops.core.tpu.row_major_by_default``, the rule
the Pallas head uses to read its weights without a copy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.core.dtypes import DTYPE_CHOICES, parse_dtype
from grpo_kernels.ops.core.tpu import GENERATIONS, row_major_by_default

# Topologies per generation as libtpu 0.0.42 spells them, smallest first (the first of each
# is one host; v5e:2x4, v5p:2x2x2 and larger span several).
TOPOLOGIES = {"v4": ("v4:2x2x1", "v4:2x2x2"), "v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4"),
              "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4"),
              "v6e": ("v6e:2x2", "v6e:2x4", "v6e:4x4"), "v7x": ("tpu7x:2x2x1", "tpu7x:2x2x2")}
DEFAULT_LIBTPU = Path(__file__).resolve().parents[1] / ".venv/libtpu/libtpu/libtpu.so"
IMPLS = ("reference", "xla", "pallas")
OPS = ("logits", "lm_head", "layout-rule")
F32 = jnp.float32


def libtpu_path(given: str | None = None) -> Path | None:
    """``given``, else ``$TPU_LIBRARY_PATH``, else the Makefile's ``.venv/libtpu``; None when
    the file is not there."""
    path = Path(given or os.environ.get("TPU_LIBRARY_PATH") or DEFAULT_LIBTPU)
    return path if path.is_file() else None


def topology(generation: str, count: int = 1) -> tuple[str, list]:
    """The smallest of ``generation``'s topologies with ``count`` devices: its name and its
    compile-only devices."""
    from jax.experimental import topologies
    for name in TOPOLOGIES[generation]:
        devices = topologies.get_topology_desc(name, "tpu").devices
        if len(devices) >= count:
            return name, list(devices)
    raise ValueError(f"no {generation} topology here has {count} devices "
                     f"(largest: {TOPOLOGIES[generation][-1]})")


class Placement:
    """Where a step's arguments live: one device, or a mesh with a ``ShardingSpec``."""

    def __init__(self, devices: list, mesh_shape: tuple[tuple[str, ...], tuple[int, ...]] | None):
        self.mesh = self.spec = None
        self.device = devices[0]
        if mesh_shape is not None:
            from grpo_kernels.sharding import ShardingSpec, mesh_from_shape
            names, sizes = mesh_shape
            self.mesh = mesh_from_shape(sizes, names, devices)
            vocab_axis = "tp" if "tp" in names else None
            self.spec = ShardingSpec(tuple(n for n in names if n != vocab_axis), vocab_axis)

    def __call__(self, pspec: PartitionSpec):
        if self.mesh is None:
            return SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh, pspec)

    def layout(self, head_layout: str) -> dict[str, PartitionSpec]:
        """The partition specs ``grpo_kernels.sharding`` uses (all replicated on one device)."""
        if self.mesh is None:
            return dict.fromkeys(("logits", "rows", "adv", "hidden", "head"), PartitionSpec())
        spec = self.spec.on(self.mesh)
        return {"logits": spec.logits(), "rows": spec.rows(2), "adv": spec.rows(1),
                "hidden": spec.rows(3), "head": spec.head(head_layout)}


def _spec(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def option_fields(op: str, impl: str, generation: str, match_tpu_layout: bool = True
                  ) -> dict | None:
    """The option fields (a ``loss.kernel`` entry) of an implementation in a TPU compile
    traced on this CPU host, whose own backend would pick interpreted kernels: compiled
    kernels sized for ``generation``. None for xla, which plans its chunks for the platform
    it is lowered for by itself (``ops.core.platform.by_platform``): its defaults are a TPU
    run's."""
    if impl == "pallas":
        if op == "logits":
            return {"interpret": False, "tpu_generation": generation, "kernel": "tpu"}
        return {"interpret": False, "tpu_generation": generation,
                **({} if match_tpu_layout else {"match_tpu_layout": False})}
    return None


def _options(op: str, impl: str, generation: str, match_tpu_layout: bool = True):
    """Per-implementation options for a TPU compile traced on this CPU host."""
    fields = option_fields(op, impl, generation, match_tpu_layout)
    if fields is None:
        return None
    from grpo_kernels.ops.lm_head_loss.api import OPTION_TYPES as HEAD_TYPES
    from grpo_kernels.ops.logits_loss.api import OPTION_TYPES as LOGITS_TYPES
    return (LOGITS_TYPES if op == "logits" else HEAD_TYPES)[impl](**fields)


def _batch_args(place: Placement, specs: dict, b: int, t: int) -> tuple:
    rows, adv = place(specs["rows"]), place(specs["adv"])
    return (_spec((b, t), jnp.int32, rows), _spec((b, t), F32, rows), _spec((b,), F32, adv),
            _spec((b, t), F32, rows), _spec((b, t), F32, rows))


def logits_step(impl, generation, place, b, t, v, dtype, level, layout):
    """``(step, args)`` of the logits-level loss."""
    from jax.experimental.layout import Format, Layout

    from grpo_kernels.ops.logits_loss.api import grpo_loss
    from grpo_kernels.sharding import sharded_grpo_loss
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level)
    opts = _options("logits", impl, generation)
    kw = {} if place.mesh is None else dict(mesh=place.mesh, sharding=place.spec)
    fn = grpo_loss if place.mesh is None else sharded_grpo_loss

    def loss(z, ids, mask, adv, old, ref):
        return fn(z, ids, mask, adv, config=cfg, impl=impl, old_logps=old, ref_logps=ref,
                  options=opts, **kw)

    specs = place.layout("hv")
    z_sh = place(specs["logits"])
    if layout == "row-major":
        z_sh = Format(Layout(major_to_minor=(0, 1, 2)), z_sh)
    args = (_spec((b, t, v), dtype, z_sh), *_batch_args(place, specs, b, t))
    step = jax.value_and_grad(loss, has_aux=True)
    if layout == "default":
        return jax.jit(step), args
    # The gradient leaves in the layout the logits came in, as a head's backward takes it.
    return jax.jit(step, out_shardings=((None, None), z_sh)), args


def head_step(impl, generation, place, b, t, h, v, dtype, level, head_layout, match=True):
    """``(step, args)`` of the fused LM-head loss (weights in their default layout;
    ``match``: ``LmHeadPallasOptions.match_tpu_layout``)."""
    from grpo_kernels.ops.lm_head_loss.api import grpo_loss_from_hidden
    from grpo_kernels.sharding import sharded_grpo_loss_from_hidden
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level)
    opts = _options("lm_head", impl, generation, match)
    kw = {} if place.mesh is None else dict(mesh=place.mesh, sharding=place.spec)
    fn = grpo_loss_from_hidden if place.mesh is None else sharded_grpo_loss_from_hidden

    def loss(x, w, ids, mask, adv, old, ref):
        return fn(x, w, ids, mask, adv, config=cfg, old_logps=old, ref_logps=ref, impl=impl,
                  options=opts, lm_head_layout=head_layout, **kw)

    specs = place.layout(head_layout)
    w_shape = (h, v) if head_layout == "hv" else (v, h)
    args = (_spec((b, t, h), dtype, place(specs["hidden"])),
            _spec(w_shape, dtype, place(specs["head"])), *_batch_args(place, specs, b, t))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), args


def relayout_copies(hlo: str, shapes: list[tuple[int, ...]]) -> int:
    """``copy`` ops in the compiled HLO whose result has one of ``shapes`` (a relayout)."""
    dims = {",".join(map(str, s)) for s in shapes}
    return sum(m in dims for m in re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", hlo))


def compile_case(step, args, big: dict[str, list[tuple[int, ...]]]) -> dict:
    """Compile ``step`` at ``args``; the row's outcome and planned memory per device, with
    the relayout copies of each group of ``big`` shapes (``{name: [shape, ...]}``)."""
    from grpo_kernels.sharding.hlo import summary
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
    collectives = summary(hlo)
    return {"ok": True, "compile_s": round(time.perf_counter() - t0, 2),
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            **{f"{name}_copies": relayout_copies(hlo, shapes) for name, shapes in big.items()},
            "tpu_custom_calls": hlo.count('custom_call_target="tpu_custom_call"'),
            "kernels": sorted(set(re.findall(r"(grpo_[a-z_]+)\)*/pallas_call", hlo))),
            "collective_bytes": collectives["total"],
            "largest_collective_elements": collectives["largest_elements"]}


def local_shapes(op, place, b, t, v, h) -> dict[str, list[tuple[int, ...]]]:
    """Each device's logits-sized (and, for the head, head-sized) array shapes."""
    if place.mesh is None:
        nb = nv = 1
    else:
        spec = place.spec
        nb = math.prod(place.mesh.shape[a] for a in spec.batch_axes)
        nv = place.mesh.shape[spec.vocab_axis] if spec.vocab_axis else 1
    bl, vl = b // nb, v // nv
    out = {"logits": [(bl, t, vl), (bl * t, vl)]}
    if op == "lm_head":
        out["head"] = [(h, vl), (vl, h)]  # either orientation: a relayout or a transpose
    return out


def layout_rule_rows(generation: str, device, count: int, seed: int = 0):
    """``w * 2`` compiled for rank-2 arguments: the layout XLA gives each against the rule."""
    rng = random.Random(seed)
    named = [(4096, 151_936), (4096, 151_643), (4096, 151_936 // 4), (3584, 151_936 // 8),
             (896, 151_643), (4096, 151_668), (4096, 151_675), (100, 151_643), (37_984, 100),
             (4096, 64), (64, 4096), (151_643, 4096), (130, 300)]
    shapes = named + [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(count)]
    sh = SingleDeviceSharding(device)
    for dtype, shape in itertools.product((jnp.bfloat16, F32), shapes):
        fmt = jax.jit(lambda w: w * 2).lower(_spec(shape, dtype, sh)).compile().input_formats
        xla_rm = fmt[0][0].layout.major_to_minor == (0, 1)
        yield {"op": "layout-rule", "generation": generation, "shape": list(shape),
               "dtype": jnp.dtype(dtype).name, "xla_row_major": xla_rm,
               "rule_row_major": row_major_by_default(shape),
               "ok": xla_rm == row_major_by_default(shape)}


def _list(allowed=None, kind=str):
    def parse(text: str) -> list:
        try:
            items = [kind(x) for x in text.split(",")]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        bad = [x for x in items if allowed is not None and x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not among {list(allowed)}")
        return items
    return parse


def _mesh(text: str):
    from grpo_kernels.cli.mesh import parse_mesh
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--op", type=_list(OPS), default=["logits"],
                   help="logits (the logits-level loss), lm_head (the fused head) and/or "
                   "layout-rule (see below)")
    p.add_argument("--impl", type=_list(IMPLS), default=["pallas"],
                   help="comma-separated, of reference,xla,pallas (default: pallas)")
    p.add_argument("--generations", type=_list(GENERATIONS), default=list(GENERATIONS),
                   help=f"comma-separated, of {','.join(GENERATIONS)} (default: all)")
    p.add_argument("--mesh", type=_mesh, help="e.g. dp=2,tp=4: compile the sharded entry "
                   "points over that mesh (tp splits V; default: one device)")
    p.add_argument("--batch", type=_list(kind=int), default=[1], help="comma-separated B")
    p.add_argument("--time", type=_list(kind=int), default=[2048], help="comma-separated T")
    p.add_argument("--vocab", type=int, default=151_643, help="V (default: Qwen2.5's 151,643)")
    p.add_argument("--hidden", type=int, default=4096, help="H of the fused head")
    p.add_argument("--dtype", type=_list(DTYPE_CHOICES),
                   default=["bfloat16", "float32"], help="comma-separated logits dtypes")
    p.add_argument("--level", type=_list(("token", "sequence")),
                   default=["token", "sequence"], help="importance-sampling level")
    p.add_argument("--logits-layout", choices=("row-major", "default"), default="row-major",
                   help="the logits argument's layout (see below)")
    p.add_argument("--lm-head-layout", choices=("hv", "vh"), default="hv",
                   help="the head weights as [H, V] (hv) or [V, H] (vh)")
    p.add_argument("--head-as-given", action="store_true",
                   help="pallas head: LmHeadPallasOptions(match_tpu_layout=False), the "
                   "kernels on W as given (a relayout copy of W in and of dW out when the TPU "
                   "keeps W in the other orientation)")
    p.add_argument("--shapes", type=int, default=60,
                   help="random shapes of --op layout-rule, besides its named ones")
    p.add_argument("--libtpu", help="libtpu.so (default: $TPU_LIBRARY_PATH, then "
                   ".venv/libtpu/libtpu/libtpu.so)")
    p.add_argument("--out", help="also append the JSON lines to this file")
    return p.parse_args(argv)


def rows(args: argparse.Namespace):
    """Every case's JSON row, compiled in turn."""
    count = math.prod(args.mesh[1]) if args.mesh else 1
    for gen in args.generations:
        topo, devices = topology(gen, count)
        place = Placement(devices, args.mesh)
        if "layout-rule" in args.op:
            yield from layout_rule_rows(gen, devices[0], args.shapes)
        cases = itertools.product([o for o in args.op if o != "layout-rule"], args.impl,
                                  args.batch, args.time, args.dtype, args.level)
        for op, impl, b, t, dname, level in cases:
            dtype = parse_dtype(dname)
            v, h = args.vocab, args.hidden
            if op == "logits":
                step, a = logits_step(impl, gen, place, b, t, v, dtype, level,
                                      args.logits_layout)
            else:
                step, a = head_step(impl, gen, place, b, t, h, v, dtype, level,
                                    args.lm_head_layout, not args.head_as_given)
            row = {"op": op, "impl": impl, "generation": gen, "topology": topo,
                   "device_kind": devices[0].device_kind,
                   "mesh": dict(zip(*args.mesh)) if args.mesh else None, "batch": b,
                   "time": t, "vocab": v, "dtype": jnp.dtype(dtype).name, "level": level,
                   "logits_layout": args.logits_layout if op == "logits" else None,
                   "hidden": h if op == "lm_head" else None,
                   "lm_head_layout": args.lm_head_layout if op == "lm_head" else None,
                   "head_as_given": args.head_as_given if op == "lm_head" else None,
                   "logits_bytes": b * t * v * jnp.dtype(dtype).itemsize // count}
            row.update(compile_case(step, a, local_shapes(op, place, b, t, v, h)))
            yield row


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
    try:
        for row in rows(args):
            failed += not row["ok"]
            line = json.dumps(row)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
    except ValueError as e:  # a mesh no topology has, or a B/V the mesh does not divide
        print(f"tpu_aot: {e}", file=sys.stderr)
        return 2
    finally:
        if out:
            out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
