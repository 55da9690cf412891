"""One tunix update run on the device: tunix's own loss or ours, step time, peak and first step.

    python3 -m grpo_kernels.proof.gpu_tunix_step --arm tunix        # Qwen2.5-1.5B shape, 4 layers
    python3 -m grpo_kernels.proof.gpu_tunix_step --arm fused-xla
    python3 -m grpo_kernels.proof.gpu_tunix_step --arm fused-xla --model tiny   # any backend

The program is the one ``benchmarks/tpu_compile.py --op tunix-step`` (source tree) compiles
for a TPU:
``jit`` of ``value_and_grad`` of a tunix policy loss with respect to a tunix model's
parameters (a tunix Qwen2 of the ``--model`` shape, its first ``--layers`` layers, the whole
vocabulary, bf16 parameters and compute), as tunix's trainer differentiates it, on a
``TrainExample`` of ``--rows`` rows (beta 0.04, token-mean, low_var_kl, on-policy). Here it
runs, on random weights and the micro-batch of :mod:`grpo_kernels.proof.gpu_train_step` (same
seed, same numbers; the reference log-probs are the model's own, from tunix's log-prob pass,
plus noise).
Arms:

- ``tunix``: tunix's ``grpo_loss_fn`` (``policy_loss_fn="grpo"``): the model's
  ``[B, P + C, V]`` logits, float32; on tunix's development head with ``--chunk-size N``, its
  chunked log-prob pass (``compute_logps_chunk_size=N``: a scan over chunks of N positions
  whose float32 logits are rematerialised in the backward);
- ``fused-xla``: ours, ``policy_loss_fn="grpo_kernels_fused"`` with the adapter's defaults
  (``integrations.tunix.fused_policy_loss``: ``LmHeadBlockSizes(dweight="vocab")``);
- ``fused-xla-tokens``: the same with ``LmHeadBlockSizes(dweight="tokens")``, the faster
  and larger mode;
- ``xla``: ours, ``policy_loss_fn="grpo_kernels"`` on the completion's logits, impl xla;
- ``no-head``, ``logps-no-head``: the model without its head, the floor under every loss: the
  update of a loss that reads the completion's hidden states only (their mean, float32), and
  the forward pass to them. What an arm's peak and time exceed these by is its head and loss.
- ``logps-tunix``, ``logps-ours``: the log-prob pass alone (the reference model's and the old
  policy's in a GRPO iteration), forward only: tunix's ``compute_per_token_logps``, and ours
  (``integrations.tunix.log_probs_function()``, what ``patch_log_probs`` binds). Their row has
  the mean log-prob over the completion mask where the update's has the loss. ``--chunk-size``
  is tunix's ``chunk_size`` there.

Which tunix: the one on the import path, or the one installed under ``--tunix-path DIR`` (put
first on it; ``make gpu-proof`` installs the vendored development head in ``.whl/site-head``).
``--chunk-size`` applies to tunix's own arms only (ours hold no ``[B, T, V]`` at any setting) and
needs the head (0.1.7 has no chunked pass).

One arm per process (the device's peak is then the arm's own); prints one JSON line as
``gpu_train_step.py`` does. Exit 3 (skipped, with the reason) where tunix is not installed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpo_kernels.proof import gpu_train_step, shapes  # noqa: E402

ARMS = ("tunix", "fused-xla", "fused-xla-tokens", "xla", "logps-tunix", "logps-ours",
        "no-head", "logps-no-head")
TUNIX_ARMS = ("tunix", "logps-tunix")
PAD, EOS = 0, 1


def parse_args(argv=None) -> argparse.Namespace:
    p = gpu_train_step.step_parser(__doc__, list(ARMS), "the policy loss")
    p.add_argument("--chunk-size", type=int, default=0, metavar="N",
                   help="tunix's own arms (tunix, logps-tunix): the head's chunked log-prob "
                   "pass over N positions at a time (default: 0, unchunked)")
    p.add_argument("--tunix-path", metavar="DIR",
                   help="a directory holding the tunix to run (e.g. its development head), put "
                   "first on the import path (default: the installed tunix)")
    args = gpu_train_step.parse_step_args(p, argv)
    if args.chunk_size < 0:
        p.error(f"--chunk-size must be at least 0, got {args.chunk_size}")
    if args.chunk_size and args.arm not in TUNIX_ARMS:
        p.error(f"--chunk-size is tunix's option: arm {args.arm!r} is ours (give it to "
                f"{' or '.join(TUNIX_ARMS)})")
    if args.tunix_path is not None and not os.path.isdir(os.path.join(args.tunix_path, "tunix")):
        p.error(f"--tunix-path {args.tunix_path!r} holds no tunix package")
    return args


def tunix_version() -> str:
    """The tunix imported: ``0.1.7``, or ``head`` where its ``compute_per_token_logps`` has the
    development head's ``chunk_size`` (:func:`~grpo_kernels.integrations.tunix.offers.
    chunks_log_probs`)."""
    from grpo_kernels.integrations.tunix.offers import chunks_log_probs

    return "head" if chunks_log_probs() else "0.1.7"


def policy_loss(arm: str, chunk_size: int = 0):
    """The tunix policy loss of ``arm`` (signature: model, example, config, pad, eos)."""
    from tunix.rl import algo_core

    from grpo_kernels.integrations import tunix as ours
    if arm == "tunix":
        if chunk_size:
            return functools.partial(algo_core.grpo_loss_fn, compute_logps_chunk_size=chunk_size)
        return algo_core.grpo_loss_fn
    if arm == "fused-xla":
        return functools.partial(ours.fused_policy_loss, impl="xla")
    if arm == "fused-xla-tokens":
        from grpo_kernels.ops.lm_head_loss.xla_plan import LmHeadBlockSizes
        return functools.partial(ours.fused_policy_loss, impl="xla",
                                 options=LmHeadBlockSizes(dweight="tokens"))
    if arm == "no-head":
        return _no_head_loss
    return functools.partial(ours.logits_policy_loss, impl="xla")


def _completion_hidden(model, prompt_ids, completion_ids):
    """The hidden states before the head at the completion's positions, as our losses read
    them."""
    from grpo_kernels.integrations.tunix.inputs import token_inputs
    from grpo_kernels.integrations.tunix.models import completion_hidden

    inputs = token_inputs(model, prompt_ids, completion_ids, PAD, EOS)
    return completion_hidden(model, inputs, completion_ids.shape[1])[0]


def _no_head_loss(model, example, config, pad_id, eos_id, **kwargs):
    """The mean of the completion's hidden states, float32, as ``(loss, aux)``: a loss with no
    head (the ``no-head`` arm)."""
    del config, pad_id, eos_id, kwargs
    hidden = _completion_hidden(model, example.prompt_ids, example.completion_ids)
    return jnp.mean(hidden.astype(jnp.float32)), {}


def run(args: argparse.Namespace) -> dict:
    from flax import nnx
    from tunix.rl import common

    model, vocab = shapes.tunix_model(args.model, args.layers, abstract=False,
                                              seed=args.seed, models=gpu_train_step.MODELS)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mb = gpu_train_step.micro_batch(args.seed, args.rows, args.prompt, args.completion, vocab)
    p = args.prompt
    prompt_ids, completion_ids = jnp.asarray(mb["ids"][:, :p]), jnp.asarray(mb["ids"][:, p:])
    n = args.rows * args.completion
    common_row = {"arm": args.arm, "backend": jax.default_backend(),
                  "device_kind": jax.devices()[0].device_kind, "model": args.model,
                  "layers": args.layers, "rows": args.rows, "prompt": args.prompt,
                  "completion": args.completion, "vocab": vocab,
                  "tunix": tunix_version(), "chunk_size": args.chunk_size,
                  "logits_f32_bytes": n * vocab * 4}
    # The log-prob arms run before the update's set-up: that set-up calls tunix's own pass,
    # whose [B, P + C, V] logits would otherwise be the process's peak in both arms.
    from grpo_kernels.integrations import tunix as ours

    if args.arm.startswith("logps-"):
        if args.arm == "logps-tunix":
            fn = common.compute_per_token_logps
            if args.chunk_size:
                fn = functools.partial(fn, chunk_size=args.chunk_size)
        else:
            fn = ours.log_probs_function()
        full_graph, state = nnx.split(model)
        if args.arm == "logps-no-head":
            step = jax.jit(lambda st, p, c: _completion_hidden(nnx.merge(full_graph, st), p, c))
            r = gpu_train_step.measure(step, (state, prompt_ids, completion_ids), args.iters,
                                       args.warmup)
            r.pop("first")
            return {"op": "tunix-logps", **common_row, "mean_logp": None, **r}
        step = jax.jit(lambda st, p, c: fn(full_graph, st, p, c, PAD, EOS))
        r = gpu_train_step.measure(step, (state, prompt_ids, completion_ids), args.iters,
                                   args.warmup)
        logps = r.pop("first")
        mask = jnp.asarray(mb["mask"], jnp.float32)
        return {"op": "tunix-logps", **common_row,
                "mean_logp": float(jnp.sum(logps * mask) / jnp.sum(mask)), **r}
    # tunix's random initialisation is not a trained model's (its log-probs are far from
    # -log V), so the reference log-probs are the model's own, by tunix's own pass, plus the
    # micro-batch's noise: a first step's KL term, small and not zero.
    own = jax.jit(lambda state, a, b: common.compute_per_token_logps(
        graphdef, state, a, b, PAD, EOS))(nnx.state(model), prompt_ids, completion_ids)
    ref = own + (jnp.asarray(mb["ref_logps"]) + np.log(vocab))
    example = common.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=jnp.asarray(mb["attention"][:, :p]),
        completion_ids=completion_ids, completion_mask=jnp.asarray(mb["mask"]),
        advantages=jnp.asarray(mb["advantages"]), ref_per_token_logps=ref,
        old_per_token_logps=None)
    del own
    config = shapes.algo_config()
    fn = policy_loss(args.arm, args.chunk_size)

    def loss(params, ex):
        return ours.differentiated(fn(nnx.merge(graphdef, params, rest), ex, config, PAD, EOS))

    r = gpu_train_step.measure(jax.jit(jax.value_and_grad(loss)), (params, example),
                               args.iters, args.warmup)
    value, grads = r.pop("first")
    return {"op": "tunix-step", **common_row,
            "loss": float(value), "grad_norm": float(gpu_train_step.global_norm(grads)), **r}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tunix_path is not None:
        sys.path.insert(0, os.path.abspath(args.tunix_path))
    try:  # what run() imports, so that a missing dependency of tunix's is named here
        from tunix.models.qwen2 import model  # noqa: F401
        from tunix.rl import algo_core, common  # noqa: F401
    except ImportError as e:
        print(f"gpu_tunix_step: skipped: needs google-tunix ({e})", file=sys.stderr)
        return gpu_train_step.SKIPPED
    version = tunix_version()
    if args.chunk_size and version != "head":
        print("gpu_tunix_step: --chunk-size needs tunix's development head (--tunix-path); "
              f"the tunix imported is {version}", file=sys.stderr)
        return 2
    row = run(args)
    print(json.dumps(row), flush=True)
    values = ([row["mean_logp"]] if row.get("mean_logp") is not None
              else [] if "mean_logp" in row else [row["loss"], row["grad_norm"]])
    return 0 if all(np.isfinite(v) for v in values) else 1


if __name__ == "__main__":
    sys.exit(main())
