"""Gradients of the fused LM-head loss against the materialised reference at a real shape.

``grpo-kernels gradcheck`` covers the logits op; this covers ``grpo_loss_from_hidden``. Both
implementations run on the same bfloat16 inputs, and a float32 reference (the reference on
upcast inputs) is the yardstick: for each of loss, dhidden and dW it prints the relative
Frobenius error of the bf16 reference and of the fused op against it. The gate is the bound
tests/ops/lm_head_loss/test_lm_head.py derives for one bf16 rounding of every logit (the fused
op rounds them as declared; XLA may keep the reference's in float32):
``2^-8 (1 + max|z| / tau)`` for the gradients.

    python3 -m grpo_kernels.proof.head_gradcheck --batch 1 --time 8192 --hidden 4096 --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from grpo_kernels import GRPOLossConfig, grpo_loss_from_hidden
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs


def rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--time", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--impl", default="xla")
    args = p.parse_args(argv)
    cfg = GRPOLossConfig(beta=0.04, max_completion_length=args.time)
    inp = random_head_inputs(0, args.batch, args.time, args.hidden, args.vocab, jnp.bfloat16, cfg)

    def grads(impl, h, w):
        def loss(h, w):
            return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                         impl=impl, old_logps=inp.old_logps,
                                         ref_logps=inp.ref_logps)[0]
        value, (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h, w)
        return value, dh, dw

    f32 = grads("reference", inp.hidden.astype(jnp.float32), inp.lm_head.astype(jnp.float32))
    bf16_ref = grads("reference", inp.hidden, inp.lm_head)
    fused = grads(args.impl, inp.hidden, inp.lm_head)
    record = {"batch": args.batch, "time": args.time, "hidden": args.hidden,
              "vocab": args.vocab, "impl": args.impl, "device": jax.devices()[0].device_kind}
    n = args.batch * args.time
    zmax = float(jnp.max(jnp.abs(jnp.dot(inp.hidden.reshape(n, args.hidden).astype(jnp.float32),
                                         inp.lm_head.astype(jnp.float32)))))
    bound = 2.0 ** -8 * (1 + zmax / cfg.temperature)
    record.update(max_abs_logit=zmax, bound=bound)
    ok = True
    for name, i in (("loss", 0), ("dhidden", 1), ("dW", 2)):
        e_ref, e_fused = rel(bf16_ref[i], f32[i]), rel(fused[i], f32[i])
        finite = bool(jnp.all(jnp.isfinite(jnp.asarray(fused[i], jnp.float32))))
        record[f"{name}_err_bf16_reference"] = e_ref
        record[f"{name}_err_{args.impl}"] = e_fused
        ok &= finite and e_fused <= bound
    record["passed"] = ok
    print(json.dumps(record))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
