"""One tunix update with each of our losses, compiled for a TPU with no TPU: each arm's plan.

    python3 benchmarks/tpu_tunix_step.py                     # Qwen2.5-1.5B shapes, v6e
    python3 benchmarks/tpu_tunix_step.py --model qwen2.5-0.5b --rows 1 --completion 512
    python3 benchmarks/tpu_tunix_step.py --model gemma3-1b        # tunix's Gemma3 preset

The program is ``jit(value_and_grad)`` of a tunix policy loss with respect to a tunix model's
parameters (a Qwen2 of a Qwen2.5 shape, or tunix's own Gemma3 preset: its first ``--layers``
layers with the whole vocabulary, bf16 parameters and compute, abstract: ``nnx.eval_shape``),
on a ``TrainExample`` of ``--rows`` rows of ``--prompt`` prompt and ``--completion``
completion tokens (beta 0.04, token-mean, low_var_kl). Arms:

- ``tunix``: tunix's own ``grpo_loss_fn``;
- ``xla``: our ``grpo_kernels`` loss (``integrations.tunix.logits_policy_loss``), impl xla,
  planned for the TPU it is lowered for; its logits formed from the model's hidden states and head
  (``logits_from="auto"``: bf16, the completion's positions only);
- ``pallas``: the same, impl pallas, with the options the adapter picks when given none
  (``logits_options``: ``alias_logits=True``), compiled kernels sized for the generation;
- ``pallas-unaliased``: the same with ``alias_logits=False``;
- ``pallas-model``: ``pallas`` on the model's own logits (``logits_from="model"``: every
  position, cast to float32 by tunix's ``__call__``), as the adapter read them before;
- ``fused-xla``, ``fused-pallas``: ``grpo_kernels_fused`` (``fused_policy_loss``) with the
  adapter's default options (xla: ``dweight="vocab"``) made a TPU compile's.

Prints one JSON line per arm and generation, as ``benchmarks/tpu_train_step.py`` does: the
buffer assignment's total (``buffer_total_bytes``), ``memory_analysis()``'s bytes, the kernels
and the compile time. Nothing runs: no times come from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

import tpu_aot
import tpu_train_step

from grpo_kernels.proof.shapes import GEMMA3, algo_config, tunix_config, tunix_model

ARMS = ("tunix", "xla", "pallas", "pallas-unaliased", "pallas-model", "fused-xla",
        "fused-pallas")
PAD, EOS = 0, 1


def loss_fn(arm: str, generation: str):
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
        options = tpu_aot._options(op, impl, generation)
    else:  # the adapter's own default, made a TPU compile's
        options = dataclasses.replace(given, **(tpu_aot.option_fields(op, impl, generation)
                                                or {}))
    if arm == "pallas-unaliased":
        options = dataclasses.replace(options, alias_logits=False)
    if fused:
        return functools.partial(ours.fused_policy_loss, impl=impl, options=options)
    return functools.partial(ours.logits_policy_loss, impl=impl, options=options,
                             logits_from="model" if arm == "pallas-model" else "auto")


def step(arm: str, generation: str, device, model, rows: int, prompt: int, completion: int):
    """``(jitted value_and_grad, abstract args)`` of one tunix update on ``device``."""
    from flax import nnx
    from tunix.rl import common

    sh = SingleDeviceSharding(device)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                 part) for part in (params, rest))

    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    example = common.TrainExample(
        prompt_ids=s((rows, prompt), jnp.int32), prompt_mask=s((rows, prompt), jnp.int32),
        completion_ids=s((rows, completion), jnp.int32),
        completion_mask=s((rows, completion), jnp.int32), advantages=s((rows,), jnp.float32),
        ref_per_token_logps=s((rows, completion), jnp.float32),
        old_per_token_logps=s((rows, completion), jnp.float32))
    config = algo_config()
    fn = loss_fn(arm, generation)

    def loss(p, ex):
        return fn(nnx.merge(graphdef, p, rest), ex, config, PAD, EOS)[0]
    return jax.jit(jax.value_and_grad(loss)), (params, example)


def parse_args(argv=None) -> argparse.Namespace:
    p = tpu_train_step.shape_parser(__doc__, ARMS, [*sorted(tpu_train_step.MODELS), *GEMMA3])
    args = p.parse_args(argv)
    tpu_train_step.check_shape(p, args, tunix_config)
    return args


def rows(args: argparse.Namespace, dump):
    model, vocab = tunix_model(args.model, args.layers)
    n = args.rows * args.completion
    for gen, arm in itertools.product(args.generations, args.arms):
        topo, devices = tpu_aot.topology(gen)
        fn, a = step(arm, gen, devices[0], model, args.rows, args.prompt, args.completion)
        row = {"op": "tunix-step", "arm": arm, "generation": gen, "topology": topo,
               "model": args.model, "layers": args.layers, "rows": args.rows,
               "prompt": args.prompt, "completion": args.completion,
               "vocab": vocab, "logits_bf16_bytes": n * vocab * 2}
        row.update(tpu_aot.compile_case(fn, a, {"logits": [
            (args.rows, args.completion, vocab), (n, vocab)]}))
        row["buffer_total_bytes"] = tpu_train_step.buffer_total(dump)
        yield row


def main(argv=None) -> int:
    args = parse_args(argv)
    dump = tpu_train_step.compile_env(args.libtpu, "tpu_tunix_step")
    if dump is None:
        return 2
    return tpu_train_step.emit(rows(args, dump), args.out, dump)


if __name__ == "__main__":
    sys.exit(main())
