"""The trainer's own update program compiled for a TPU, with no TPU: each loss arm's plan.

    python3 benchmarks/tpu_train_step.py                      # Qwen2.5-1.5B shapes, v6e
    python3 benchmarks/tpu_train_step.py --model qwen2.5-7b --layers 2 --generations v5p
    python3 benchmarks/tpu_train_step.py --arms fused-xla,fused-pallas --rows 16
    python3 benchmarks/tpu_train_step.py --logits-dtype bfloat16  # loss.logits_dtype

The program is ``rl.policy.make_programs``'s gradient of one micro-batch, as ``grpo-kernels
train`` compiles it: the decoder's forward and backward over ``--rows`` rows of ``--prompt``
prompt and ``--completion`` completion tokens, then the loss of each arm (``<head>-<impl>``,
as ``loss.head`` and ``loss.impl`` name it) with the options a TPU run's ``loss.kernel`` would
hand it (``rl.kernel.resolve``, the trainer's defaults included): compiled kernels sized for
the generation for pallas; xla's defaults, which plan for the TPU the program is lowered for.
The model is abstract (``models.decoder.empty_decoder``):
the first ``--layers`` layers of a Qwen2.5 shape with its whole vocabulary and head, so the
loss's share of the plan is the real one and the layers' share is ``--layers`` of the
model's.

Like ``benchmarks/tpu_aot.py`` (whose libtpu loading and compile report this reuses) it prints
one JSON line per arm: the planned bytes per device (arguments: parameters and the
micro-batch; outputs: the gradients; temporaries, as ``memory_analysis()`` gives them), the
buffer assignment's own total (``buffer_total_bytes``, from the memory-usage report XLA dumps:
the figure to read where a Pallas call writes over an intermediate, which
``memory_analysis()`` counts twice), the kernels in the program and the compile time.
Nothing runs: no times come from here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml
from jax.sharding import SingleDeviceSharding

import tpu_aot
from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.core.dtypes import DTYPE_CHOICES, dtype_name, parse_dtype
from grpo_kernels.ops.core.tpu import GENERATIONS
from grpo_kernels.proof.shapes import MODELS, model_config
from grpo_kernels.rl.kernel import merged_entry

ARMS = tuple(f"{h}-{i}" for h in ("logits", "fused") for i in tpu_aot.IMPLS)
F32 = jnp.float32


def kernel_entry(arm: str, generation: str, overrides: dict[str, dict]) -> dict | None:
    """The ``loss.kernel`` entry a TPU run traced on this CPU host names for ``arm``
    (:func:`tpu_aot.option_fields`), with ``--kernel``'s fields of ``arm`` on top."""
    head, impl = arm.split("-", 1)
    fields = tpu_aot.option_fields("logits" if head == "logits" else "lm_head", impl,
                                   generation)
    return {**(fields or {}), **overrides.get(arm, {})} or None


def step(arm: str, entry: dict | None, device, cfg, rows: int, prompt: int, completion: int,
         logits_dtype=F32, remat: bool = False):
    """``(jitted grad_fn, abstract args)`` of one micro-batch on ``device``, the loss with
    the options of the ``loss.kernel`` entry ``entry`` on logits rounded to
    ``logits_dtype``."""
    from flax import nnx

    from grpo_kernels.models.decoder import empty_decoder
    from grpo_kernels.rl.policy import make_programs
    sh = SingleDeviceSharding(device)
    graphdef, state = nnx.split(empty_decoder(cfg, remat))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)
    from grpo_kernels.rl.kernel import resolve
    head, impl = arm.split("-", 1)
    _, options = resolve(head, impl, {} if entry is None else {arm: entry})  # as the trainer
    grad_fn, _ = make_programs(graphdef, head=head, impl=impl, config=GRPOLossConfig(beta=0.04),
                               prompt_width=prompt, options=options,
                               logits_dtype=logits_dtype)

    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    width = prompt + completion
    mb = {"ids": s((rows, width), jnp.int32), "attention": s((rows, width), jnp.int32),
          "mask": s((rows, completion), jnp.int32), "advantages": s((rows,), F32),
          "old_logps": s((rows, completion), F32), "ref_logps": s((rows, completion), F32),
          "sampler_logps": None}
    return jax.jit(grad_fn), (state, mb, s((), F32), s((), F32))


def shape_parser(doc: str, arms: tuple[str, ...], models: list[str] | None = None
                 ) -> argparse.ArgumentParser:
    """The arguments this script shares with ``tpu_tunix_step.py``: the model shape (one of
    ``models``, default :data:`MODELS`), the arms, the generations, the batch, libtpu and the
    output file; ``doc``: the script's docstring (its first paragraph the description, from
    its third on the epilog)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 2)[2])
    p.add_argument("--model", choices=models or sorted(MODELS), default="qwen2.5-1.5b",
                   help="the model's shape (default: qwen2.5-1.5b)")
    p.add_argument("--layers", type=int, default=1,
                   help="decoder layers kept, the first N (default: 1)")
    p.add_argument("--arms", type=tpu_aot._list(arms), default=list(arms),
                   help=f"comma-separated, of {','.join(arms)} (default: all)")
    p.add_argument("--generations", type=tpu_aot._list(GENERATIONS), default=["v6e"],
                   help=f"comma-separated, of {','.join(GENERATIONS)} (default: v6e)")
    p.add_argument("--rows", type=int, default=8, help="rows of the batch (default: 8)")
    p.add_argument("--prompt", type=int, default=256, help="prompt width P (default: 256)")
    p.add_argument("--completion", type=int, default=1024,
                   help="completion tokens C (default: 1024)")
    p.add_argument("--libtpu", help="libtpu.so (default: $TPU_LIBRARY_PATH, then "
                   ".venv/libtpu/libtpu/libtpu.so)")
    p.add_argument("--out", help="also append the JSON lines to this file")
    return p


def check_shape(p: argparse.ArgumentParser, args: argparse.Namespace, config=None) -> None:
    """Exits through ``p.error`` on a batch size below 1 or a layer count the model lacks
    (``config(model, layers)`` raises ValueError; default :func:`model_config`)."""
    for name in ("rows", "prompt", "completion"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    try:
        (config or model_config)(args.model, args.layers)
    except ValueError as e:
        p.error(str(e))


def parse_args(argv=None) -> argparse.Namespace:
    p = shape_parser(__doc__, ARMS)
    p.add_argument("--logits-dtype", choices=DTYPE_CHOICES, default="float32",
                   help="loss.logits_dtype: the dtype the loss's logits are rounded to "
                   "(default: float32)")
    p.add_argument("--remat", action="store_true",
                   help="model.remat: recompute each layer in the backward pass")
    p.add_argument("--kernel", action="append", default=[], metavar="ARM.FIELD=VALUE",
                   help="a loss.kernel field on top of the arm's entry, value as YAML "
                   "(logits-pallas.alias_logits=true); repeatable")
    args = p.parse_args(argv)
    check_shape(p, args)
    args.overrides = {}
    for item in args.kernel:
        key, sep, value = item.partition("=")
        arm, dot, field = key.partition(".")
        if not sep or not dot or arm not in ARMS or not field:
            p.error(f"--kernel {item!r}: expected ARM.FIELD=VALUE with ARM one of {list(ARMS)}")
        args.overrides.setdefault(arm, {})[field] = yaml.safe_load(value)
    return args


def buffer_total(dump: Path) -> int | None:
    """``Total bytes`` of the default memory space in the memory-usage report XLA dumped for
    the last compile (the buffer assignment's own sum), and the dump cleared. Where a Pallas
    call writes over an intermediate (``alias_logits``) in this program, ``memory_analysis()``
    still counts both buffers and this does not."""
    reports = sorted(dump.glob("*memory-usage-report.txt"), key=lambda f: f.stat().st_mtime)
    match = re.search(r"Total bytes: (\d+)", reports[-1].read_text()) if reports else None
    for f in dump.iterdir():
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    return int(match.group(1)) if match else None


def rows(args: argparse.Namespace, dump: Path):
    cfg = model_config(args.model, args.layers)
    n = args.rows * args.completion
    for gen, arm in itertools.product(args.generations, args.arms):
        topo, devices = tpu_aot.topology(gen)
        entry = kernel_entry(arm, gen, args.overrides)
        fn, a = step(arm, entry, devices[0], cfg, args.rows, args.prompt, args.completion,
                     parse_dtype(args.logits_dtype), args.remat)
        row = {"op": "train-step", "arm": arm, "generation": gen, "topology": topo,
               "device_kind": devices[0].device_kind, "model": args.model,
               "layers": args.layers, "rows": args.rows, "prompt": args.prompt,
               "completion": args.completion, "vocab": cfg.vocab_size, "remat": args.remat,
               "hidden": cfg.hidden_size, "logits_f32_bytes": n * cfg.vocab_size * 4,
               "logits_dtype": dtype_name(args.logits_dtype),
               "kernel": merged_entry(arm, {arm: entry} if entry else {}) or None}
        row.update(tpu_aot.compile_case(fn, a, {"logits": [(args.rows, args.completion,
                                                             cfg.vocab_size),
                                                            (n, cfg.vocab_size)]}))
        row["buffer_total_bytes"] = buffer_total(dump)
        yield row


def compile_env(libtpu: str | None, name: str) -> Path | None:
    """Points this process at libtpu for TPU compiles on a CPU host and has XLA dump each
    compile's memory-usage report into a fresh directory, which it returns (None, with the
    reason printed, where no libtpu.so is found). Call before any backend starts."""
    lib = tpu_aot.libtpu_path(libtpu)
    if lib is None:
        print(f"{name}: no libtpu.so (give --libtpu or TPU_LIBRARY_PATH, or run "
              "`make .venv/.installed-dev`)", file=sys.stderr)
        return None
    os.environ["TPU_LIBRARY_PATH"] = str(lib)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # as tpu_aot.main: libtpu only compiles
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    dump = Path(tempfile.mkdtemp(prefix=f"{name}_"))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    return dump


def main(argv=None) -> int:
    args = parse_args(argv)
    dump = compile_env(args.libtpu, "tpu_train_step")
    if dump is None:
        return 2
    try:
        from grpo_kernels.rl.kernel import build_options
        arms = [*args.arms, *(a for a in args.overrides if a not in args.arms)]
        for gen, arm in itertools.product(args.generations, arms):  # before any compile
            entry = kernel_entry(arm, gen, args.overrides)
            if entry is not None:
                build_options("--kernel", arm, entry)
    except ValueError as e:
        print(f"tpu_train_step: {e}", file=sys.stderr)
        shutil.rmtree(dump)
        return 2
    return emit(rows(args, dump), args.out, dump)


def emit(rows, out_path: str | None, dump: Path) -> int:
    """Prints each row of ``rows`` as a JSON line (appended to ``out_path`` too, when given),
    then removes ``dump``; 1 if any row failed to compile, else 0."""
    failed = 0
    try:
        with open(out_path, "a") if out_path else open(os.devnull, "w") as out:
            for row in rows:
                failed += not row["ok"]
                line = json.dumps(row)
                print(line, flush=True)
                out.write(line + "\n")
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
