"""Peer benchmark: our losses against Liger-Kernel's, one process, on a GPU or on the CPU.

``--op logits`` (a CUDA GPU): ``grpo_loss`` (impls ``--ours``) against ``liger_kernel.
transformers.grpo_loss.triton_grpo_loss`` on the same logits. ``--op lm_head``:
``grpo_loss_from_hidden`` against ``LigerFusedLinearGRPOLoss`` on the same hidden states and
``[V, H]`` head, on a CUDA GPU (``--device cuda``, the default) or on the CPU (``--device cpu``:
torch's and XLA's CPU builds). Both sides run forward + backward on the same inputs and loss
options (TRL semantics: ``loss_type``, clip 0.2, beta with given reference log-probs,
temperature, old log-probs given); JAX is told not to preallocate so torch has room. The script
checks the losses agree, then prints one JSON line: median times (CUDA-synchronised on the
torch side, ``block_until_ready`` on ours), ours / theirs, each side's time over three of its
own library's ``[N, H] x [H, V]`` matmuls (the least a fused forward and backward can cost),
and on a GPU torch's peak allocated bytes (``torch.cuda.max_memory_allocated``, inputs
included).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m grpo_kernels.proof.liger_peer --op logits \\
        --batch 1 --time 2048 --vocab 151643
    python3 -m grpo_kernels.proof.liger_peer --op lm_head --batch 1 --time 8192 --hidden 4096 \\
        --vocab 151936 --head-variants xla-tokens,xla-vocab@1024 --liger-modes eager,compiled
    python3 -m grpo_kernels.proof.liger_peer --op lm_head --device cpu --batch 2 --time 1024 \\
        --hidden 512 --vocab 32768 --beta 0.04 --iters 2 --warmup 0

``--op lm_head`` times each of our variants (``--head-variants``: the ``LmHeadBlockSizes``
dweight mode and chunk rows) with XLA's planned temporaries, and each Liger run
(``--liger-modes``: ``compiled=False`` and ``compiled=True``). Needs ``torch`` and
``liger-kernel``, neither a dependency of grpo-kernels; exit 3 (skipped, with the reason)
without them or without the device asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpo_kernels import GRPOLossConfig, grpo_loss, grpo_loss_from_hidden  # noqa: E402
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs  # noqa: E402
from grpo_kernels.ops.logits_loss.inputs import random_inputs  # noqa: E402
from grpo_kernels.proof.timing import median_ms  # noqa: E402


def liger_head_step(loss_fn, h_t, w_t, tensors):
    """One forward + backward of a ``LigerFusedLinearGRPOLoss`` w.r.t. hidden and head; the
    returned call gives the detached loss."""
    def step():
        h_t.grad = w_t.grad = None
        out = loss_fn(h_t, w_t, **tensors)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach()
    return step


def head_variants(text: str) -> list[tuple[str, tuple[str, object]]]:
    """``--head-variants`` -> ``[(name, (impl, options))]``; ValueError names a bad entry."""
    from grpo_kernels import LmHeadBlockSizes

    out = []
    for name in (s.strip() for s in text.split(",") if s.strip()):
        variant, at, rows = name.partition("@")
        if variant not in ("xla", "xla-tokens", "xla-vocab") or (at and not rows.isdigit()):
            raise ValueError(f"--head-variants: {name!r} is not xla, xla-tokens or xla-vocab "
                             "with an optional @ROWS")
        fields = {"dweight": variant[4:]} if variant != "xla" else {}
        if rows:
            fields["chunk_tokens"] = int(rows)
        out.append((name, ("xla", LmHeadBlockSizes(**fields) if fields else None)))
    return out


def torch_median_ms(torch, fn, iters: int, warmup: int) -> float:
    """:func:`timing.median_ms` of ``fn`` with the CUDA queue, where there is one, drained
    inside each call."""
    def synced():
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return median_ms(synced, iters, warmup)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=["logits", "lm_head"], required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where both sides run (default: cuda; cpu: --op lm_head only)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--time", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151643)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--ours", default="xla,pallas", help="our impls to time (logits op)")
    p.add_argument("--loss-type", default="grpo", choices=["grpo", "bnpo", "dr_grpo", "dapo"])
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--liger-compiled", action="store_true",
                   help="also LigerFusedLinearGRPOLoss(compiled=True) (torch.compile); "
                   "= adding 'compiled' to --liger-modes")
    p.add_argument("--liger-modes", default="eager",
                   help="--op lm_head: comma-separated Liger runs, of eager (compiled=False) "
                   "and compiled (compiled=True, torch.compile) (default: eager)")
    p.add_argument("--head-variants", default="xla",
                   help="--op lm_head: comma-separated variants of our fused head besides the "
                   "reference: xla (its defaults), xla-tokens / xla-vocab (LmHeadBlockSizes."
                   "dweight), each with an optional @ROWS for chunk_tokens (xla-vocab@1024) "
                   "(default: xla)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    try:
        head_variants(args.head_variants)
        if set(args.liger_modes.split(",")) - {"eager", "compiled", ""}:
            raise ValueError(f"--liger-modes: expected eager and/or compiled, got "
                             f"{args.liger_modes!r}")
        if args.device == "cpu" and args.op != "lm_head":
            raise ValueError("--device cpu: only --op lm_head (Liger's logits loss is a "
                             "Triton kernel)")
    except ValueError as e:
        p.error(str(e))
    cuda = args.device == "cuda"
    if cuda and jax.default_backend() != "gpu":  # before torch's import, the slow part of a skip
        print(f"liger_peer: skipped: needs a CUDA GPU for both torch and JAX (JAX's "
              f"backend is {jax.default_backend()})", file=sys.stderr)
        return 3
    try:
        import torch
        if args.op == "logits":
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        else:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as e:
        print(f"liger_peer: skipped: needs torch and liger-kernel ({e})", file=sys.stderr)
        return 3
    if cuda and not torch.cuda.is_available():
        print("liger_peer: skipped: needs a CUDA GPU for both torch and JAX (torch sees "
              "none)", file=sys.stderr)
        return 3

    b, t, v = args.batch, args.time, args.vocab
    cfg = GRPOLossConfig(loss_type=args.loss_type, beta=args.beta, temperature=args.temperature,
                         max_completion_length=t)
    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    dev = torch.device(args.device)

    def to_torch(x, dt=torch.float32):
        return torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).to(dev, dt).contiguous()

    record = {"op": args.op, "batch": b, "time": t, "vocab": v, "dtype": args.dtype,
              "loss_type": args.loss_type, "beta": args.beta, "temperature": args.temperature,
              "jax": jax.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              "jax_backend": jax.default_backend()}
    if args.op == "logits":
        inp = random_inputs(0, b, t, v, jdtype, cfg)
        ours = {}
        for impl in ["reference", *[s for s in args.ours.split(",") if s]]:
            step = jax.jit(jax.value_and_grad(
                lambda z, impl=impl: grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg,
                                               impl=impl, **inp.kwargs()), has_aux=True))
            ours[impl] = (float(step(inp.logits)[0][0]),
                          median_ms(lambda: step(inp.logits), args.iters, args.warmup))
        # Liger takes [B, T+1, V] (the causal shift's extra position) and drops the last.
        z = torch.cat([to_torch(inp.logits, tdtype), torch.zeros(b, 1, v, dtype=tdtype,
                                                                  device=dev)], dim=1)
        tensors = dict(old_logp=to_torch(inp.old_logps), ref_logp=to_torch(inp.ref_logps),
                       completion_ids=to_torch(inp.ids, torch.int64),
                       advantages=to_torch(inp.advantages),
                       completion_mask=to_torch(inp.mask, torch.int32))
        z.requires_grad_(True)

        def theirs(inplace: bool):
            z.grad = None
            loss, _ = triton_grpo_loss(z, **tensors, temperature=args.temperature,
                                       beta=args.beta, eps_low=0.2, eps_high=0.2,
                                       inplace=inplace, loss_type=args.loss_type,
                                       max_completion_length=t, reduce=True)
            loss.backward()
            return loss.detach()

        their_loss = float(theirs(False))
        results = {}
        for inplace in (False, True):
            torch.cuda.reset_peak_memory_stats()
            ms = torch_median_ms(torch, lambda: theirs(inplace), args.iters, args.warmup)
            results[f"liger_inplace_{inplace}"] = {
                "median_ms": ms, "torch_peak_allocated": torch.cuda.max_memory_allocated()}
        ref_loss = ours["reference"][0]
        record.update(loss_reference=ref_loss, loss_liger=their_loss,
                      loss_rel_diff=abs(ref_loss - their_loss) / max(abs(ref_loss), 1e-12),
                      ours={k: {"loss": l, "median_ms": ms} for k, (l, ms) in ours.items()},
                      liger=results)
        base = results["liger_inplace_False"]["median_ms"]
        record["ours_over_liger"] = {k: ms / base for k, (_, ms) in ours.items()}
    else:
        inp = random_head_inputs(0, b, t, args.hidden, v, jdtype, cfg, layout="vh")

        def ours_loss(h, w, impl, options):
            return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                         impl=impl, lm_head_layout="vh", options=options,
                                         old_logps=inp.old_logps, ref_logps=inp.ref_logps)[0]

        ours, planned = {}, {}
        for name, (impl, options) in [("reference", ("reference", None)),
                                      *head_variants(args.head_variants)]:
            step = jax.jit(jax.value_and_grad(
                lambda h, w, impl=impl, o=options: ours_loss(h, w, impl, o), argnums=(0, 1)))
            compiled = step.lower(inp.hidden, inp.lm_head).compile()
            planned[name] = compiled.memory_analysis().temp_size_in_bytes
            ours[name] = (float(compiled(inp.hidden, inp.lm_head)[0]),
                          median_ms(lambda: compiled(inp.hidden, inp.lm_head), args.iters,
                                    args.warmup))
            del step, compiled
        h_t = to_torch(inp.hidden, tdtype).requires_grad_(True)
        w_t = to_torch(inp.lm_head, tdtype).requires_grad_(True)
        tensors = dict(selected_token_ids=to_torch(inp.ids, torch.int64),
                       attention_mask=to_torch(inp.mask), advantages=to_torch(inp.advantages),
                       ref_per_token_logps=to_torch(inp.ref_logps),
                       old_per_token_logps=to_torch(inp.old_logps))
        modes = [m for m in args.liger_modes.split(",") if m]
        if args.liger_compiled and "compiled" not in modes:
            modes.append("compiled")
        liger, their_losses = {}, {}
        for mode in modes:
            loss_fn = LigerFusedLinearGRPOLoss(
                beta=args.beta, compiled=mode == "compiled", use_ref_model=args.beta > 0,
                chunk_size=1, loss_type=args.loss_type, max_completion_length=t,
                temperature=args.temperature)
            theirs = liger_head_step(loss_fn, h_t, w_t, tensors)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            their_losses[mode] = float(theirs())  # torch.compile's compile, when compiled
            liger[mode] = {"median_ms": torch_median_ms(torch, theirs, args.iters, args.warmup),
                           "torch_peak_allocated": (torch.cuda.max_memory_allocated() if cuda
                                                    else None),
                           "loss": their_losses[mode]}
            h_t.grad = w_t.grad = None
            del loss_fn, theirs
        n = b * t
        h2, w2 = h_t.detach().reshape(n, args.hidden), w_t.detach()
        torch_mm = torch_median_ms(torch, lambda: h2 @ w2.T, args.iters, args.warmup)
        xla_mm = jax.jit(lambda h, w: jax.lax.dot_general(
            h.reshape(n, args.hidden), w, (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32))
        xla_mm_ms = median_ms(lambda: xla_mm(inp.hidden, inp.lm_head), args.iters, args.warmup)
        ref_loss = ours["reference"][0]
        their_loss = next(iter(their_losses.values()))
        record.update(hidden=args.hidden, liger_modes=modes, loss_reference=ref_loss,
                      loss_liger=their_loss,
                      loss_rel_diff=max(abs(ref_loss - x) / max(abs(ref_loss), 1e-12)
                                        for x in their_losses.values()),
                      ours={k: {"loss": l, "median_ms": ms, "temp_size_in_bytes": planned[k]}
                            for k, (l, ms) in ours.items()},
                      liger=liger, torch_matmul_ms=torch_mm, xla_matmul_ms=xla_mm_ms,
                      liger_over_3_torch_matmuls={m: r["median_ms"] / (3 * torch_mm)
                                                  for m, r in liger.items()},
                      ours_over_3_xla_matmuls={k: ms / (3 * xla_mm_ms)
                                               for k, (_, ms) in ours.items()},
                      ours_over_liger={f"{k} / {m}": ms / r["median_ms"]
                                       for k, (_, ms) in ours.items() for m, r in liger.items()})
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
