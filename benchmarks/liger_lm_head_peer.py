"""Peer benchmark: our fused LM-head loss against Liger-Kernel's LigerFusedLinearGRPOLoss.

Needs ``torch`` and ``liger-kernel`` (CPU builds are enough); neither is a dependency of
grpo-kernels. Both run forward + backward w.r.t. hidden states and head weights on the same
inputs and loss options (TRL semantics: ``loss_type``, beta with given reference log-probs,
old log-probs, temperature), in one process; the script checks the two losses agree, then prints
the median times and ours / theirs, and each side's time over three of its own library's
``[N, H] x [H, V]`` matmuls (the least a fused forward and backward can cost).

    pip install torch==2.13.0 && pip install --no-deps liger-kernel
    python benchmarks/liger_lm_head_peer.py --batch 2 --time 1024 --hidden 512 --vocab 32768
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms

from grpo_kernels import GRPOLossConfig, grpo_loss_from_hidden
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--time", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--loss-type", default="grpo", choices=["grpo", "bnpo", "dr_grpo", "dapo"])
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--liger-chunk-size", type=int, default=1, help="sequences per Liger chunk")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    try:
        import torch
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as e:
        print(f"liger_lm_head_peer: needs torch and liger-kernel ({e}); see the module docstring",
              file=sys.stderr)
        return 2

    cfg = GRPOLossConfig(loss_type=args.loss_type, beta=args.beta,
                         temperature=args.temperature, max_completion_length=args.time)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    inp = random_head_inputs(0, args.batch, args.time, args.hidden, args.vocab, dtype, cfg,
                             layout="vh")  # [V, H]: the nn.Linear layout Liger takes

    def ours(h, w):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                     impl="xla", lm_head_layout="vh", old_logps=inp.old_logps,
                                     ref_logps=inp.ref_logps)[0]

    step = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))
    our_loss = float(step(inp.hidden, inp.lm_head)[0])
    our_ms = median_ms(lambda: step(inp.hidden, inp.lm_head),
                       args.iters, args.warmup)

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    def to_torch(x, dt=torch.float32):
        return torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).to(dt)

    h_t = to_torch(inp.hidden, tdtype).requires_grad_(True)
    w_t = to_torch(inp.lm_head, tdtype).requires_grad_(True)
    ids_t = torch.from_numpy(np.asarray(inp.ids)).long()
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=args.beta, compiled=False, use_ref_model=args.beta > 0,
        chunk_size=args.liger_chunk_size, loss_type=args.loss_type,
        max_completion_length=args.time, temperature=args.temperature)
    tensors = dict(selected_token_ids=ids_t, attention_mask=to_torch(inp.mask),
                   advantages=to_torch(inp.advantages),
                   ref_per_token_logps=to_torch(inp.ref_logps),
                   old_per_token_logps=to_torch(inp.old_logps))

    step = liger_head_step(loss_fn, h_t, w_t, tensors)

    def theirs():
        return float(step())

    their_loss = theirs()
    their_ms = median_ms(theirs, args.iters, args.warmup)

    # Each side's matmul floor: one [N, H] x [H, V] product in its own library, same dtype.
    n = args.batch * args.time
    xla_mm = jax.jit(lambda h, w: jax.lax.dot_general(
        h.reshape(n, args.hidden), w, (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32))
    xla_mm_ms = median_ms(lambda: xla_mm(inp.hidden, inp.lm_head),
                          args.iters, args.warmup)
    h_2d, w_d = h_t.detach().reshape(n, args.hidden), w_t.detach()
    torch_mm_ms = median_ms(lambda: h_2d @ w_d.T, args.iters, args.warmup)
    print(f"shape B={args.batch} T={args.time} H={args.hidden} V={args.vocab} {args.dtype}, "
          f"loss_type={args.loss_type} beta={args.beta} temperature={args.temperature}; "
          f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"loss: ours {our_loss:.6f}  liger {their_loss:.6f}  "
          f"rel diff {abs(our_loss - their_loss) / max(abs(their_loss), 1e-12):.2e}")
    print(f"value_and_grad median ms: ours {our_ms:.1f}  liger {their_ms:.1f}  "
          f"ours/liger {our_ms / their_ms:.3f}")
    print(f"one [N,H]x[H,V] matmul, median ms: xla {xla_mm_ms:.1f}  torch {torch_mm_ms:.1f}; "
          f"time / (3 x own matmul): ours {our_ms / (3 * xla_mm_ms):.3f}  "
          f"liger {their_ms / (3 * torch_mm_ms):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
