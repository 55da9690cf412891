"""Programs compiled for a TPU by the TPU compiler itself, with no TPU: a deviceless compile.

    make .venv/.installed-dev       # puts libtpu (the one jax pins) in .venv/libtpu
    python3 benchmarks/tpu_compile.py                  # the logits loss, every generation
    python3 benchmarks/tpu_compile.py --op lm_head --generations v4,v6e
    python3 benchmarks/tpu_compile.py --impl reference,xla,pallas --mesh dp=2,tp=4 --batch 8
    python3 benchmarks/tpu_compile.py --op layout-rule  # ops.core.tpu.row_major_by_default
    python3 benchmarks/tpu_compile.py --op train-step   # the trainer's update, each loss arm
    python3 benchmarks/tpu_compile.py --op train-step --model qwen2.5-7b --arms fused-pallas
    python3 benchmarks/tpu_compile.py --op tunix-step --model gemma3-1b  # one tunix update

libtpu carries XLA:TPU and Mosaic. jax's compile-only client (``jax.experimental.topologies``)
loads it on a CPU host and compiles a program for a named TPU topology: XLA's layout
assignment and buffer plan, and Mosaic's passes that ``jax.export`` never reaches (VMEM
allocation among them; a kernel whose blocks exceed the chip's VMEM fails here as it would on
the chip). Each case prints one JSON line: whether the program compiled, the error's first
line if not, its planned memory per device (``memory_analysis()``'s arguments, outputs,
temporaries and aliased bytes, and ``buffer_total_bytes``, the total of the memory-usage
report XLA dumps: the figure to read where a Pallas call writes over an intermediate, which
``memory_analysis()`` counts twice), its relayout copies of logits-sized and head-sized
arrays, its Mosaic kernels, the bytes its collectives carry and the compile time. Nothing
runs: no times of a TPU come from here.

The ops (``--op``), in two families with their own arguments:

- ``logits``, ``lm_head``: ``value_and_grad`` of the logits-level loss or of the fused LM-head
  loss, as a trainer takes it, at each ``--impl``, ``--batch``, ``--time``, ``--dtype`` and
  ``--level``. ``--mesh`` compiles the ``grpo_kernels.sharding`` entry points over the first
  devices of the smallest topology of the generation that has enough (``v5e:2x4``, 8 chips,
  is a two-host slice, so its program is the one each host compiles); ``tp`` splits the
  vocabulary, the other axes the batch. xla, with its default options, plans its chunks for
  the TPU it is lowered for (not for this host's CPU). The logits arrive as a jit argument,
  and a TPU gives an argument its own default layout, which for a vocabulary that is not a
  multiple of 128 keeps the vocabulary off the minor dimension: ``--logits-layout
  row-major`` (the default) asks for the layout a head matmul inside the same jit produces,
  ``default`` shows the other. The head weights of ``lm_head`` arrive in their default
  layout, as a trainer's parameters do (``--lm-head-layout`` picks ``[H, V]`` or ``[V, H]``).
  ``--option IMPL.FIELD=VALUE`` sets one field of an implementation's options on top of
  those (``xla.dweight=vocab``, ``xla.chunk_tokens=1024``).
- ``layout-rule``: ``w * 2`` for rank-2 arguments of many shapes, the layout XLA gives each
  checked against ``grpo_kernels.ops.core.tpu.row_major_by_default``, the rule the Pallas
  head uses to read its weights without a copy. Combines with the two above.
- ``train-step``: ``rl.policy.make_programs``'s gradient of one micro-batch, as ``grpo-kernels
  train`` compiles it: the decoder's forward and backward over ``--rows`` rows of ``--prompt``
  prompt and ``--completion`` completion tokens, then the loss of each arm (``<head>-<impl>``,
  as ``loss.head`` and ``loss.impl`` name it) with the options a TPU run's ``loss.kernel``
  would hand it (``rl.kernel.resolve``, the trainer's defaults included): compiled kernels
  sized for the generation for pallas, xla's defaults for xla. The model is abstract
  (``models.decoder.empty_decoder``): the first ``--layers`` layers of a Qwen2.5 shape with
  its whole vocabulary and head, so the loss's share of the plan is the real one.
- ``tunix-step``: ``jit(value_and_grad)`` of a tunix policy loss with respect to a tunix
  model's parameters (a Qwen2 of a Qwen2.5 shape, or tunix's own Gemma3 preset, its first
  ``--layers`` layers, bf16, abstract) on a ``TrainExample`` of that shape (beta 0.04,
  token-mean, low_var_kl). Arms: ``tunix`` (tunix's ``grpo_loss_fn``); ``xla`` and ``pallas``
  (``integrations.tunix.logits_policy_loss``, its logits formed from the hidden states and
  head, bf16, the completion's positions only, with the options the adapter picks when given
  none: ``alias_logits=True`` for pallas); ``pallas-unaliased`` (``alias_logits=False``);
  ``pallas-model`` (the model's own float32 logits of every position); ``fused-xla`` and
  ``fused-pallas`` (``grpo_kernels_fused`` with the adapter's defaults).

``train-step`` and ``tunix-step`` run alone, one per invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.core.dtypes import DTYPE_CHOICES, dtype_name, parse_dtype
from grpo_kernels.ops.core.platform import ENV as STAGED_PLATFORMS
from grpo_kernels.ops.core.tpu import GENERATIONS, row_major_by_default
from grpo_kernels.proof.shapes import (GEMMA3, MODELS, check_at_least_one, model_config,
                                       tunix_config)

# Topologies per generation as libtpu 0.0.42 spells them, smallest first (the first of each
# is one host; v5e:2x4, v5p:2x2x2 and larger span several).
TOPOLOGIES = {"v4": ("v4:2x2x1", "v4:2x2x2"), "v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4"),
              "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4"),
              "v6e": ("v6e:2x2", "v6e:2x4", "v6e:4x4"), "v7x": ("tpu7x:2x2x1", "tpu7x:2x2x2")}
DEFAULT_LIBTPU = Path(__file__).resolve().parents[1] / ".venv/libtpu/libtpu/libtpu.so"
IMPLS = ("reference", "xla", "pallas")
KERNEL_OPS = ("logits", "lm_head", "layout-rule")
STEP_OPS = ("train-step", "tunix-step")
OPS = KERNEL_OPS + STEP_OPS
TRAIN_ARMS = tuple(f"{h}-{i}" for h in ("logits", "fused") for i in IMPLS)
TUNIX_ARMS = ("tunix", "xla", "pallas", "pallas-unaliased", "pallas-model", "fused-xla",
              "fused-pallas")
PAD, EOS = 0, 1  # the tunix example's token ids
F32 = jnp.float32


def libtpu_path(given: str | None = None) -> Path | None:
    """``given``, else ``$TPU_LIBRARY_PATH``, else the Makefile's ``.venv/libtpu``; None when
    the file is not there."""
    path = Path(given or os.environ.get("TPU_LIBRARY_PATH") or DEFAULT_LIBTPU)
    return path if path.is_file() else None


def use_libtpu(libtpu: str | None, name: str) -> bool:
    """Points this process at libtpu for TPU compiles on a CPU host; False, with the reason
    printed, where no libtpu.so is found. Call before any backend starts."""
    lib = libtpu_path(libtpu)
    if lib is None:
        print(f"{name}: no libtpu.so (give --libtpu or TPU_LIBRARY_PATH, or run "
              "`make .venv/.installed-dev`, which puts it in .venv/libtpu)", file=sys.stderr)
        return False
    os.environ["TPU_LIBRARY_PATH"] = str(lib)
    # Programs here are lowered for a TPU: every platform's branch is traced
    # (grpo_kernels.ops.core.platform; a test suite that lowers for its CPU names only that).
    os.environ.pop(STAGED_PLATFORMS, None)
    # The host's own backend is the CPU (libtpu only compiles here), and libtpu's
    # /tmp/libtpu_lockfile, which keeps a second process off a chip, would stop parallel test
    # workers that each run this script, though no chip is touched.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return True


def dump_reports(name: str) -> Path:
    """Has XLA dump each compile's memory-usage report into a fresh directory, which it
    returns (read by :func:`buffer_total`; the caller removes it). Call before any backend
    starts."""
    path = Path(tempfile.mkdtemp(prefix=f"{name}_"))
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={path}".strip()
    return path


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


def buffer_total(dump: Path) -> int | None:
    """``Total bytes`` of the default memory space in the memory-usage report XLA dumped for
    the last compile (the buffer assignment's own sum), and the dump cleared. Where a Pallas
    call writes over an intermediate (``alias_logits``), ``memory_analysis()`` still counts
    both buffers and this does not."""
    reports = sorted(dump.glob("*memory-usage-report.txt"), key=lambda f: f.stat().st_mtime)
    match = re.search(r"Total bytes: (\d+)", reports[-1].read_text()) if reports else None
    for f in dump.iterdir():
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    return int(match.group(1)) if match else None


def relayout_copies(hlo: str, shapes: list[tuple[int, ...]]) -> int:
    """``copy`` ops in the compiled HLO whose result has one of ``shapes`` (a relayout)."""
    dims = {",".join(map(str, s)) for s in shapes}
    return sum(m in dims for m in re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", hlo))


def compile_case(step, args, big: dict[str, list[tuple[int, ...]]],
                 dump: Path | None = None) -> dict:
    """Compile ``step`` at ``args``; the row's outcome and planned memory per device, with
    the relayout copies of each group of ``big`` shapes (``{name: [shape, ...]}``) and, with
    the ``dump`` directory of :func:`dump_reports`, the buffer assignment's total."""
    from grpo_kernels.sharding.hlo import summary
    t0 = time.perf_counter()
    try:
        compiled = step.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a compile error is this row's result
        text = str(e)
        vmem = re.search(r"Used ([\d.]+\w) of ([\d.]+\w) vmem", text)
        if dump is not None:
            buffer_total(dump)
        return {"ok": False, "error": text.strip().splitlines()[0][:300],
                "vmem_used_of": list(vmem.groups()) if vmem else None}
    seconds = round(time.perf_counter() - t0, 2)
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    collectives = summary(hlo)
    return {"ok": True, "compile_s": seconds,
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "buffer_total_bytes": None if dump is None else buffer_total(dump),
            **{f"{name}_copies": relayout_copies(hlo, shapes) for name, shapes in big.items()},
            "tpu_custom_calls": hlo.count('custom_call_target="tpu_custom_call"'),
            "kernels": sorted(set(re.findall(r"(grpo_[a-z_]+)\)*/pallas_call", hlo))),
            "collective_bytes": collectives["total"],
            "largest_collective_elements": collectives["largest_elements"]}


def _spec(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# --- logits, lm_head, layout-rule: the losses alone ------------------------------------------

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


def _options(op: str, impl: str, generation: str, match_tpu_layout: bool = True,
             extra: dict | None = None):
    """Per-implementation options for a TPU compile traced on this CPU host, with the fields
    of ``extra`` (``--option``) on top."""
    fields = {**(option_fields(op, impl, generation, match_tpu_layout) or {}), **(extra or {})}
    if not fields:
        return None
    from grpo_kernels.ops.lm_head_loss.api import OPTION_TYPES as HEAD_TYPES
    from grpo_kernels.ops.logits_loss.api import OPTION_TYPES as LOGITS_TYPES
    return (LOGITS_TYPES if op == "logits" else HEAD_TYPES)[impl](**fields)


def _batch_args(place: Placement, specs: dict, b: int, t: int) -> tuple:
    rows, adv = place(specs["rows"]), place(specs["adv"])
    return (_spec((b, t), jnp.int32, rows), _spec((b, t), F32, rows), _spec((b,), F32, adv),
            _spec((b, t), F32, rows), _spec((b, t), F32, rows))


def logits_step(impl, generation, place, b, t, v, dtype, level, layout, extra=None):
    """``(step, args)`` of the logits-level loss (``extra``: :func:`_options`'s)."""
    from jax.experimental.layout import Format, Layout

    from grpo_kernels.ops.logits_loss.api import grpo_loss
    from grpo_kernels.sharding import sharded_grpo_loss
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level)
    opts = _options("logits", impl, generation, extra=extra)
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


def head_step(impl, generation, place, b, t, h, v, dtype, level, head_layout, match=True,
              extra=None):
    """``(step, args)`` of the fused LM-head loss (weights in their default layout;
    ``match``: ``LmHeadPallasOptions.match_tpu_layout``; ``extra``: :func:`_options`'s)."""
    from grpo_kernels.ops.lm_head_loss.api import grpo_loss_from_hidden
    from grpo_kernels.sharding import sharded_grpo_loss_from_hidden
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level)
    opts = _options("lm_head", impl, generation, match, extra)
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


def kernel_rows(args: argparse.Namespace, dump: Path | None):
    """Every case of ``logits``, ``lm_head`` and ``layout-rule``, compiled in turn."""
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
            v, h, extra = args.vocab, args.hidden, args.extra_options.get(impl)
            if op == "logits":
                step, a = logits_step(impl, gen, place, b, t, v, dtype, level,
                                      args.logits_layout, extra)
            else:
                step, a = head_step(impl, gen, place, b, t, h, v, dtype, level,
                                    args.lm_head_layout, not args.head_as_given, extra)
            row = {"op": op, "impl": impl, "generation": gen, "topology": topo,
                   "device_kind": devices[0].device_kind,
                   "mesh": dict(zip(*args.mesh)) if args.mesh else None, "batch": b,
                   "time": t, "vocab": v, "dtype": jnp.dtype(dtype).name, "level": level,
                   "logits_layout": args.logits_layout if op == "logits" else None,
                   "hidden": h if op == "lm_head" else None,
                   "lm_head_layout": args.lm_head_layout if op == "lm_head" else None,
                   "head_as_given": args.head_as_given if op == "lm_head" else None,
                   "options": extra or None,
                   "logits_bytes": b * t * v * jnp.dtype(dtype).itemsize // count}
            row.update(compile_case(step, a, local_shapes(op, place, b, t, v, h), dump))
            yield row


# --- train-step: the trainer's update --------------------------------------------------------

def kernel_entry(arm: str, generation: str, overrides: dict[str, dict]) -> dict | None:
    """The ``loss.kernel`` entry a TPU run traced on this CPU host names for ``arm``
    (:func:`option_fields`), with ``--kernel``'s fields of ``arm`` on top."""
    head, impl = arm.split("-", 1)
    fields = option_fields("logits" if head == "logits" else "lm_head", impl, generation)
    return {**(fields or {}), **overrides.get(arm, {})} or None


def train_step(arm: str, entry: dict | None, device, cfg, rows: int, prompt: int,
               completion: int, logits_dtype=F32, remat: bool = False):
    """``(jitted grad_fn, abstract args)`` of one micro-batch on ``device``, the loss with
    the options of the ``loss.kernel`` entry ``entry`` on logits rounded to
    ``logits_dtype``."""
    from flax import nnx

    from grpo_kernels.models.decoder import empty_decoder
    from grpo_kernels.rl.kernel import resolve
    from grpo_kernels.rl.policy import make_programs
    sh = SingleDeviceSharding(device)
    graphdef, state = nnx.split(empty_decoder(cfg, remat))
    state = jax.tree.map(lambda x: _spec(x.shape, x.dtype, sh), state)
    head, impl = arm.split("-", 1)
    _, options = resolve(head, impl, {} if entry is None else {arm: entry})  # as the trainer
    grad_fn, _ = make_programs(graphdef, head=head, impl=impl, config=GRPOLossConfig(beta=0.04),
                               prompt_width=prompt, options=options,
                               logits_dtype=logits_dtype)
    width = prompt + completion
    mb = {"ids": _spec((rows, width), jnp.int32, sh),
          "attention": _spec((rows, width), jnp.int32, sh),
          "mask": _spec((rows, completion), jnp.int32, sh), "advantages": _spec((rows,), F32, sh),
          "old_logps": _spec((rows, completion), F32, sh),
          "ref_logps": _spec((rows, completion), F32, sh), "sampler_logps": None}
    return jax.jit(grad_fn), (state, mb, _spec((), F32, sh), _spec((), F32, sh))


def train_rows(args: argparse.Namespace, dump: Path):
    """One row per generation and arm of ``train-step``."""
    from grpo_kernels.rl.kernel import merged_entry
    cfg = model_config(args.model, args.layers)
    n = args.rows * args.completion
    for gen, arm in itertools.product(args.generations, args.arms):
        topo, devices = topology(gen)
        entry = kernel_entry(arm, gen, args.overrides)
        fn, a = train_step(arm, entry, devices[0], cfg, args.rows, args.prompt,
                           args.completion, parse_dtype(args.logits_dtype), args.remat)
        row = {"op": "train-step", "arm": arm, "generation": gen, "topology": topo,
               "device_kind": devices[0].device_kind, "model": args.model,
               "layers": args.layers, "rows": args.rows, "prompt": args.prompt,
               "completion": args.completion, "vocab": cfg.vocab_size, "remat": args.remat,
               "hidden": cfg.hidden_size, "logits_f32_bytes": n * cfg.vocab_size * 4,
               "logits_dtype": dtype_name(args.logits_dtype),
               "kernel": merged_entry(arm, {arm: entry} if entry else {}) or None}
        big = {"logits": [(args.rows, args.completion, cfg.vocab_size), (n, cfg.vocab_size)]}
        row.update(compile_case(fn, a, big, dump))
        yield row


# --- tunix-step: one tunix update ------------------------------------------------------------

def tunix_loss_fn(arm: str, generation: str):
    """The tunix policy loss of ``arm`` (its signature: model, example, config, pad, eos)."""
    import functools

    from tunix.rl import algo_core

    from grpo_kernels.integrations import tunix as ours
    if arm == "tunix":
        return algo_core.grpo_loss_fn
    fused = arm.startswith("fused-")
    op, impl = ("head" if fused else "logits"), ("xla" if arm.endswith("xla") else "pallas")
    given = (ours.fused_options if fused else ours.logits_options)(impl, None)
    if given is None:
        options = _options(op, impl, generation)
    else:  # the adapter's own default, made a TPU compile's
        options = dataclasses.replace(given, **(option_fields(op, impl, generation) or {}))
    if arm == "pallas-unaliased":
        options = dataclasses.replace(options, alias_logits=False)
    if fused:
        return functools.partial(ours.fused_policy_loss, impl=impl, options=options)
    return functools.partial(ours.logits_policy_loss, impl=impl, options=options,
                             logits_from="model" if arm == "pallas-model" else "auto")


def tunix_step(arm: str, generation: str, device, model, rows: int, prompt: int,
               completion: int):
    """``(jitted value_and_grad, abstract args)`` of one tunix update on ``device`` with the
    policy loss of ``arm``."""
    return tunix_update(tunix_loss_fn(arm, generation), device, model, rows, prompt,
                        completion)


def tunix_update(fn, device, model, rows: int, prompt: int, completion: int):
    """``(jitted value_and_grad, abstract args)`` of one tunix update on ``device``: the tunix
    policy loss ``fn`` (model, example, config, pad, eos) differentiated with respect to
    ``model``'s parameters, as tunix's trainer does, on an abstract ``TrainExample`` of ``rows``
    x (``prompt`` + ``completion``) tokens."""
    from flax import nnx
    from tunix.rl import common

    from grpo_kernels.integrations import tunix as ours
    from grpo_kernels.proof.shapes import algo_config
    sh = SingleDeviceSharding(device)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = (jax.tree.map(lambda x: _spec(x.shape, x.dtype, sh), part)
                    for part in (params, rest))

    def s(shape, dtype):
        return _spec(shape, dtype, sh)
    example = common.TrainExample(
        prompt_ids=s((rows, prompt), jnp.int32), prompt_mask=s((rows, prompt), jnp.int32),
        completion_ids=s((rows, completion), jnp.int32),
        completion_mask=s((rows, completion), jnp.int32), advantages=s((rows,), F32),
        ref_per_token_logps=s((rows, completion), F32),
        old_per_token_logps=s((rows, completion), F32))
    config = algo_config()

    def loss(p, ex):
        return ours.differentiated(fn(nnx.merge(graphdef, p, rest), ex, config, PAD, EOS))
    return jax.jit(jax.value_and_grad(loss)), (params, example)


def tunix_rows(args: argparse.Namespace, dump: Path):
    """One row per generation and arm of ``tunix-step``."""
    from grpo_kernels.proof.shapes import tunix_model
    model, vocab = tunix_model(args.model, args.layers)
    n = args.rows * args.completion
    for gen, arm in itertools.product(args.generations, args.arms):
        topo, devices = topology(gen)
        fn, a = tunix_step(arm, gen, devices[0], model, args.rows, args.prompt,
                           args.completion)
        row = {"op": "tunix-step", "arm": arm, "generation": gen, "topology": topo,
               "model": args.model, "layers": args.layers, "rows": args.rows,
               "prompt": args.prompt, "completion": args.completion,
               "vocab": vocab, "logits_bf16_bytes": n * vocab * 2}
        big = {"logits": [(args.rows, args.completion, vocab), (n, vocab)]}
        row.update(compile_case(fn, a, big, dump))
        yield row


# --- the command line ------------------------------------------------------------------------

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


# Each family's arguments and their defaults; an argument of the other family is an error.
KERNEL_DEFAULTS = {"impl": ["pallas"], "mesh": None, "batch": [1], "time": [2048],
                   "vocab": 151_643, "hidden": 4096, "dtype": ["bfloat16", "float32"],
                   "level": ["token", "sequence"], "logits_layout": "row-major",
                   "lm_head_layout": "hv", "head_as_given": False, "shapes": 60, "option": []}
STEP_DEFAULTS = {"model": "qwen2.5-1.5b", "layers": 1, "arms": None, "rows": 8, "prompt": 256,
                 "completion": 1024}
TRAIN_DEFAULTS = {"logits_dtype": "float32", "remat": False, "kernel": []}


def parser() -> argparse.ArgumentParser:
    """Every op's arguments, in groups; defaults are filled in by :func:`parse_args`."""
    doc = __doc__
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 2)[2], argument_default=argparse.SUPPRESS)
    p.add_argument("--op", type=_list(OPS), default=["logits"],
                   help=f"comma-separated, of {','.join(KERNEL_OPS)}, or one of "
                   f"{', '.join(STEP_OPS)} (default: logits)")
    p.add_argument("--generations", type=_list(GENERATIONS),
                   help=f"comma-separated, of {','.join(GENERATIONS)} (default: all for the "
                   "losses alone, v6e for a step)")
    p.add_argument("--libtpu", default=None, help="libtpu.so (default: $TPU_LIBRARY_PATH, "
                   "then .venv/libtpu/libtpu/libtpu.so)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    k = p.add_argument_group("logits, lm_head, layout-rule")
    k.add_argument("--impl", type=_list(IMPLS),
                   help="comma-separated, of reference,xla,pallas (default: pallas)")
    k.add_argument("--mesh", type=_mesh, help="e.g. dp=2,tp=4: compile the sharded entry "
                   "points over that mesh (tp splits V; default: one device)")
    k.add_argument("--batch", type=_list(kind=int), help="comma-separated B (default: 1)")
    k.add_argument("--time", type=_list(kind=int), help="comma-separated T (default: 2048)")
    k.add_argument("--vocab", type=int, help="V (default: Qwen2.5's 151,643)")
    k.add_argument("--hidden", type=int, help="H of the fused head (default: 4096)")
    k.add_argument("--dtype", type=_list(DTYPE_CHOICES),
                   help="comma-separated logits dtypes (default: bfloat16,float32)")
    k.add_argument("--level", type=_list(("token", "sequence")),
                   help="importance-sampling levels (default: token,sequence)")
    k.add_argument("--logits-layout", choices=("row-major", "default"),
                   help="the logits argument's layout (default: row-major; see below)")
    k.add_argument("--lm-head-layout", choices=("hv", "vh"),
                   help="the head weights as [H, V] (hv, the default) or [V, H] (vh)")
    k.add_argument("--head-as-given", action="store_true",
                   help="pallas head: LmHeadPallasOptions(match_tpu_layout=False), the "
                   "kernels on W as given (a relayout copy of W in and of dW out when the TPU "
                   "keeps W in the other orientation)")
    k.add_argument("--option", action="append", metavar="IMPL.FIELD=VALUE",
                   help="a field of IMPL's options on top of the TPU compile's, value as YAML "
                   "(xla.dweight=vocab); repeatable")
    k.add_argument("--shapes", type=int,
                   help="random shapes of layout-rule, besides its named ones (default: 60)")
    s = p.add_argument_group("train-step, tunix-step")
    s.add_argument("--model", choices=sorted({*MODELS, *GEMMA3}),
                   help="the model's shape (default: qwen2.5-1.5b; gemma3-* for tunix-step)")
    s.add_argument("--layers", type=int, help="decoder layers kept, the first N (default: 1)")
    s.add_argument("--arms", type=_list(),
                   help=f"comma-separated; train-step: of {','.join(TRAIN_ARMS)}; "
                   f"tunix-step: of {','.join(TUNIX_ARMS)} (default: all)")
    s.add_argument("--rows", type=int, help="rows of the batch (default: 8)")
    s.add_argument("--prompt", type=int, help="prompt width P (default: 256)")
    s.add_argument("--completion", type=int, help="completion tokens C (default: 1024)")
    t = p.add_argument_group("train-step only")
    t.add_argument("--logits-dtype", choices=DTYPE_CHOICES,
                   help="loss.logits_dtype: the dtype the loss's logits are rounded to "
                   "(default: float32)")
    t.add_argument("--remat", action="store_true",
                   help="model.remat: recompute each layer in the backward pass")
    t.add_argument("--kernel", action="append", metavar="ARM.FIELD=VALUE",
                   help="a loss.kernel field on top of the arm's entry, value as YAML "
                   "(logits-pallas.alias_logits=true); repeatable")
    return p


def _fill(args: argparse.Namespace, defaults: dict) -> None:
    for name, value in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)


def _refuse(p, args, names, ops: str) -> None:
    given = [n for n in names if hasattr(args, n)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        p.error(f"{flag} does not apply to --op {','.join(args.op)} (it is for {ops})")


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked before any backend starts: each argument against its op's
    family, the model's layers, the arms and the ``--kernel`` entries."""
    p = parser()
    args = p.parse_args(argv)
    steps = [o for o in args.op if o in STEP_OPS]
    if steps and len(args.op) > 1:
        p.error(f"--op {','.join(args.op)}: {steps[0]} runs alone")
    if not steps:
        _refuse(p, args, [*STEP_DEFAULTS, *TRAIN_DEFAULTS], "train-step, tunix-step")
        _fill(args, {**KERNEL_DEFAULTS, "generations": list(GENERATIONS)})
        args.extra_options = _option_fields(p, args)
        return args
    op = steps[0]
    _refuse(p, args, KERNEL_DEFAULTS, "logits, lm_head, layout-rule")
    if op == "tunix-step":
        _refuse(p, args, TRAIN_DEFAULTS, "train-step")
    arms = TRAIN_ARMS if op == "train-step" else TUNIX_ARMS
    _fill(args, {**STEP_DEFAULTS, **TRAIN_DEFAULTS, "generations": ["v6e"]})
    args.arms = args.arms or list(arms)
    bad = [a for a in args.arms if a not in arms]
    if bad:
        p.error(f"--arms: {bad} not among {op}'s {list(arms)}")
    try:
        check_at_least_one(args, ("rows", "prompt", "completion"))
        if op == "train-step" and args.model in GEMMA3:
            raise ValueError(f"--model {args.model} is a tunix preset: use it with --op "
                             "tunix-step")
        (model_config if op == "train-step" else tunix_config)(args.model, args.layers)
    except ValueError as e:
        p.error(str(e))
    args.overrides = _overrides(p, args) if op == "train-step" else {}
    return args


def _dotted_fields(p, flag: str, items: list[str], names, what: str) -> dict[str, dict]:
    """``NAME.FIELD=VALUE`` items (``--kernel``, ``--option``) as ``{NAME: {FIELD: value}}``,
    each value read as YAML; a malformed item or a NAME not in ``names`` is a usage error."""
    import yaml
    fields: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        name, dot, field = key.partition(".")
        if not sep or not dot or name not in names or not field:
            p.error(f"{flag} {item!r}: expected {what}.FIELD=VALUE with {what} one of "
                    f"{list(names)}")
        fields.setdefault(name, {})[field] = yaml.safe_load(value)
    return fields


def _option_fields(p, args) -> dict[str, dict]:
    """``--option``'s fields per implementation, each op's options built with them (so a bad
    field fails here, before any compile)."""
    fields = _dotted_fields(p, "--option", args.option, IMPLS, "IMPL")
    if "reference" in fields:
        p.error("--option reference: the reference takes no options")
    ops = [o for o in args.op if o != "layout-rule"]
    for op, gen, impl in itertools.product(ops, args.generations, fields):
        try:
            _options(op, impl, gen, extra=fields[impl])
        except (TypeError, ValueError) as e:
            p.error(f"--option {impl}.{', '.join(fields[impl])} ({op}): {e}")
    return fields


def _overrides(p, args) -> dict[str, dict]:
    """``--kernel``'s fields per arm, each arm's entry built as the trainer builds it (so a
    bad field fails here, before any compile)."""
    from grpo_kernels.rl.kernel import build_options
    overrides = _dotted_fields(p, "--kernel", args.kernel, TRAIN_ARMS, "ARM")
    for gen, arm in itertools.product(args.generations, [*args.arms, *overrides]):
        entry = kernel_entry(arm, gen, overrides)
        if entry is not None:
            try:
                build_options("--kernel", arm, entry)
            except ValueError as e:
                p.error(str(e))
    return overrides


def emit(rows, out_path: str | None) -> int:
    """Prints each row of ``rows`` as a JSON line (appended to ``out_path`` too, when given);
    1 if any row failed to compile, else 0."""
    failed = 0
    with open(out_path, "a") if out_path else open(os.devnull, "w") as out:
        for row in rows:
            failed += not row["ok"]
            line = json.dumps(row)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()  # a later compile that crashes the process loses no row
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if not use_libtpu(args.libtpu, "tpu_compile"):
        return 2
    # layout-rule alone reads no buffer plan: its hundreds of compiles dump nothing.
    dump = None if args.op == ["layout-rule"] else dump_reports("tpu_compile")
    rows = {"train-step": train_rows, "tunix-step": tunix_rows}.get(args.op[0], kernel_rows)
    try:
        return emit(rows(args, dump), args.out)
    except ValueError as e:  # a mesh no topology has, or a B/V the mesh does not divide
        print(f"tpu_compile: {e}", file=sys.stderr)
        return 2
    finally:
        if dump is not None:
            shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
