"""Measurements behind the CPU notes of docs/lm_head.md, in one process.

    python benchmarks/probes/lm_head_cpu_probes.py [--iters 3]

Medians of ``--iters`` calls after one warm-up call, and compiled temp bytes, of:

- ``dw``: the two forms of one chunk's ``dW`` product, ``delta^T h`` (layout ``"vh"``'s natural
  form, contracting the rows of both operands) against ``h^T delta`` with ``h^T`` materialised
  (the plain form), one bf16 ``[1024, 49152]`` chunk, H = 576;
- ``blocks``: the gradient of the fused op at the benchmark shape (N = 2048, H = 512,
  V = 32768, bf16, planned chunks) for several heights of the ``dW`` update blocks;
- ``trainer``: value_and_grad at the trainer's shape (N = 1024, H = 576, V = 49152, bf16
  operands, ``logits_dtype=float32``, layout ``"vh"``, beta 0.04) for several chunk sizes,
  against one ``[N, H] x [H, V]`` matmul;
- ``primal``: the loss without gradient (one matmul and the softmax statistics per 128-row
  chunk) at N = 2048, H = 512 for V = 32768 and 49152.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from grpo_kernels.proof.timing import median_ms

from grpo_kernels import GRPOLossConfig, LmHeadBlockSizes, grpo_loss_from_hidden
from grpo_kernels.ops.lm_head_loss import xla as X

F32, BF16 = jnp.float32, jnp.bfloat16


def report(name, fn, args, iters):
    compiled = jax.jit(fn).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    ms = median_ms(lambda: compiled(*args), iters)
    print(f"{name:<58} {ms:9.1f} ms  {temp / 2**20:8.1f} MiB",
          flush=True)


def inputs(n_b, n_t, hidden, vocab, layout, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(n_b, n_t, hidden)), BF16)
    shape = (hidden, vocab) if layout == "hv" else (vocab, hidden)
    w = jnp.asarray(rng.normal(size=shape) * 0.05, BF16)
    ids = jnp.asarray(rng.integers(0, vocab, size=(n_b, n_t)), jnp.int32)
    mask = jnp.ones((n_b, n_t), F32)
    adv = jnp.asarray(rng.normal(size=n_b), F32)
    logps = jnp.asarray(rng.normal(size=(n_b, n_t)) - 3.0, F32)
    return h, w, ids, mask, adv, logps


def loss_fn(ids, mask, adv, logps, cfg, layout, rows, **kw):
    def f(h, w):
        return grpo_loss_from_hidden(h, w, ids, mask, adv, config=cfg, impl="xla",
                                     old_logps=logps, ref_logps=logps if cfg.beta else None,
                                     lm_head_layout=layout,
                                     options=LmHeadBlockSizes(chunk_tokens=rows), **kw)[0]
    return f


def probe_dw(iters):
    rng = np.random.default_rng(0)
    d = jnp.asarray(rng.normal(size=(1024, 49152)), BF16)
    h = jnp.asarray(rng.normal(size=(1024, 576)), BF16)
    dims = lambda c: (c, ((), ()))  # noqa: E731
    report("dW = delta^T h  ([V, H], rows contracted)",
           lambda d, h: jax.lax.dot_general(d, h, dims(((0,), (0,))),
                                            preferred_element_type=F32), (d, h), iters)
    report("dW^T = (h^T materialised) delta  ([H, V], plain form)",
           lambda d, h: jax.lax.dot_general(jax.lax.optimization_barrier(h.T), d,
                                            dims(((1,), (0,))), preferred_element_type=F32),
           (d, h), iters)


def probe_blocks(iters):
    h, w, ids, mask, adv, logps = inputs(2, 1024, 512, 32768, "hv")
    f = loss_fn(ids, mask, adv, logps, GRPOLossConfig(), "hv", None)
    default = X.DWEIGHT_ELEMENTS
    try:
        for rows in (32, 64, 128, 256, 512):
            X.DWEIGHT_ELEMENTS = rows * 32768
            report(f"benchmark shape, bf16, planned chunks, dW blocks of {rows} rows",
                   jax.grad(f, argnums=(0, 1)), (h, w), iters)
    finally:
        X.DWEIGHT_ELEMENTS = default


def probe_trainer(iters):
    h, w, ids, mask, adv, logps = inputs(32, 32, 576, 49152, "vh")
    report("trainer shape: one [N, H] x [H, V] matmul",
           lambda h, w: jnp.einsum("bth,vh->btv", h, w, preferred_element_type=F32),
           (h, w), iters)
    cfg = GRPOLossConfig(beta=0.04)
    for rows in (None, 128, 256, 344):
        f = loss_fn(ids, mask, adv, logps, cfg, "vh", rows, logits_dtype=F32)
        report(f"trainer shape, f32 head, rows {rows or 'planned'}",
               jax.grad(f, argnums=(0, 1)), (h, w), iters)


def probe_primal(iters):
    for vocab in (32768, 49152):
        h, w, ids, mask, adv, logps = inputs(2, 1024, 512, vocab, "hv")
        report(f"primal, N 2048, H 512, V {vocab}, 128 rows",
               loss_fn(ids, mask, adv, logps, GRPOLossConfig(), "hv", 128), (h, w), iters)


PROBES = {"dw": probe_dw, "blocks": probe_blocks, "trainer": probe_trainer,
          "primal": probe_primal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--only", choices=tuple(PROBES), action="append",
                        help="run only these probes (repeatable)")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for name in args.only or PROBES:
        PROBES[name](args.iters)


if __name__ == "__main__":
    main()
