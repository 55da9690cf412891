"""Tuning probes for a lent GPU, one process per section: what the proof's defaults rest on.

    python3 benchmarks/probes/gpu_probes.py copy      # memory bandwidth (copy_bandwidth.py), bf16 and f32
    python3 benchmarks/probes/gpu_probes.py pallas    # GPU kernel tiles x warps, per kernel
    python3 benchmarks/probes/gpu_probes.py step      # whole steps: xla and pallas per tile
    python3 benchmarks/probes/gpu_probes.py head      # fused LM head: chunk rows x dW blocking

Each prints one JSON line per measurement and a table. Times are medians after warm-up
(``timing.median_ms``), two input sets alternated where a cache could hold one.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
from grpo_kernels.proof import copy_bandwidth
from grpo_kernels.proof.timing import median_ms

# The B=1, T=2048 logits shape; PROBE_N / PROBE_V shrink it for a CPU smoke run.
N, V = int(os.environ.get("PROBE_N", 2048)), int(os.environ.get("PROBE_V", 151643))


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def copy() -> None:
    for dtype in (jnp.bfloat16, jnp.float32):
        for r in copy_bandwidth.measure(4096, V, dtype, 30, 5):
            emit(section="copy", how=r["how"], dtype=r["dtype"], ms=r["median_ms"],
                 tb_per_s=r["bandwidth_bytes_per_s"] / 1e12)


def pallas() -> None:
    from grpo_kernels.ops.logits_loss import pallas_gpu as G
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    zs = [(jax.random.normal(k, (N, V), jnp.float32) * 2).astype(jnp.bfloat16) for k in keys[:2]]
    ids = jax.random.randint(keys[2], (N,), 0, V, dtype=jnp.int32)
    coef = jax.random.normal(keys[3], (N,), jnp.float32)
    nb = zs[0].nbytes
    ref_lse = None
    for bv, warps in itertools.product((1024, 2048, 4096, 8192), (2, 4, 8)):
        blocks = G.GpuBlocks(bv, warps)
        try:
            stats = jax.jit(lambda z, b=blocks: G.row_statistics(z, ids, 1.0, b))
            grad = jax.jit(lambda z, lse, b=blocks: G.logits_gradient(z, ids, lse, coef, 1.0, b))
            _, lse, _ = stats(zs[0])
            if ref_lse is None:
                ref_lse = lse
            err = float(jnp.max(jnp.abs(lse - ref_lse)))
            k = iter(range(10 ** 9))
            s_ms = median_ms(lambda: stats(zs[next(k) % 2]), 20, 3)
            g_ms = median_ms(lambda: grad(zs[next(k) % 2], lse), 20, 3)
        except Exception as e:  # a config Triton rejects is a result too
            emit(section="pallas", block_vocab=bv, warps=warps,
                 error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        emit(section="pallas", block_vocab=bv, warps=warps, stats_ms=s_ms,
             stats_tb_s=nb / s_ms / 1e9, grad_ms=g_ms, grad_tb_s=2 * nb / g_ms / 1e9,
             total_ms=s_ms + g_ms, total_tb_s=3 * nb / (s_ms + g_ms) / 1e9,
             lse_max_abs_diff=err)


def step() -> None:
    """Whole value_and_grad steps: xla and pallas at block_vocab 1024-8192, both shapes."""
    from grpo_kernels import GRPOLossConfig, PallasBlockSizes, PallasOptions, grpo_loss
    from grpo_kernels.ops.logits_loss.inputs import random_inputs
    for b, t in ((1, 2048), (4, 1024)):
        cfg = GRPOLossConfig()
        inp = random_inputs(0, b, t, V, jnp.bfloat16, cfg)
        variants = [("xla", None)] + [("pallas", bv) for bv in (1024, 2048, 4096, 8192)]
        for impl, bv in variants:
            opts = PallasOptions(blocks=PallasBlockSizes(block_vocab=bv)) if bv else None
            f = jax.jit(jax.value_and_grad(lambda z: grpo_loss(
                z, inp.ids, inp.mask, inp.advantages, config=cfg, impl=impl,
                options=opts, **inp.kwargs()), has_aux=True))
            ms = median_ms(lambda: f(inp.logits), 20, 3)
            emit(section="step", batch=b, time=t, impl=impl, block_vocab=bv, ms=ms,
                 tb_s=3 * inp.logits.nbytes / ms / 1e9)
        del inp


def head() -> None:
    from grpo_kernels import GRPOLossConfig, LmHeadBlockSizes, grpo_loss_from_hidden
    from grpo_kernels.ops.lm_head_loss import xla as X
    from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
    b, t, hdim, vocab = 1, 8192, 4096, 151936
    cfg = GRPOLossConfig(max_completion_length=t)
    inp = random_head_inputs(0, b, t, hdim, vocab, jnp.bfloat16, cfg)
    n = b * t
    mm = jax.jit(lambda h, w: jax.lax.dot_general(h.reshape(n, hdim), w, (((1,), (0,)), ((), ())),
                                                  preferred_element_type=jnp.float32))
    mm_ms = median_ms(lambda: mm(inp.hidden, inp.lm_head), 10, 2)
    emit(section="head", what="matmul", ms=mm_ms)
    whole = X.dweight_rows
    for dw, chunks in (("whole", (None, 2048, 4096, 8192)), ("cpu_blocks", (None,))):
        X.dweight_rows = whole if dw == "whole" else (
            lambda h, v, kind: whole(h, v, "cpu"))
        for chunk in chunks:
            def loss(h, w, chunk=chunk):
                return grpo_loss_from_hidden(
                    h, w, inp.ids, inp.mask, inp.advantages, config=cfg, impl="xla",
                    old_logps=inp.old_logps, ref_logps=inp.ref_logps,
                    options=LmHeadBlockSizes(chunk_tokens=chunk))
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
            compiled = step.lower(inp.hidden, inp.lm_head).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            ms = median_ms(lambda: compiled(inp.hidden, inp.lm_head), 8, 2)
            emit(section="head", what="xla", dw=dw,
                 chunk=chunk or X.plan_chunk(n, vocab, LmHeadBlockSizes(), "gpu"), ms=ms,
                 over_3_matmuls=ms / (3 * mm_ms), temp_bytes=temp)
    X.dweight_rows = whole


if __name__ == "__main__":
    for name in sys.argv[1:] or ["copy", "pallas", "step", "head"]:
        {"copy": copy, "pallas": pallas, "step": step, "head": head}[name]()
