"""Both tunix losses and the patched log-prob pass against tunix's own, on a tiny MaxText decoder
in MaxText's own ``TunixMaxTextAdapter``.

Needs MaxText, which needs Python >= 3.12 and jax >= 0.11: a side environment, not the suite's
(about 2.8 GB)::

    python3.12 -m venv /tmp/mtvenv
    /tmp/mtvenv/bin/pip install "maxtext[tpu]==0.2.5"
    /tmp/mtvenv/bin/pip install --no-deps google-tunix==0.1.7 google-metrax==0.2.4 \\
        clu==0.0.12 perfetto==0.59.1 tensorboardX==2.6.5 wrapt
    JAX_PLATFORMS=cpu PYTHONPATH=src /tmp/mtvenv/bin/python benchmarks/maxtext_tunix_parity.py

(``PYTHONPATH=DIR:src`` with tunix's development head installed into ``DIR`` tests against
it.) The decoder is MaxText's ``Transformer`` built from its own ``base.yml`` with
``model_name=qwen3-0.6b`` and every size overridden (2 layers, width 32, vocabulary 256,
float32), wrapped two ways:

- ``released``: the adapter as ``maxtext==0.2.5`` ships it, whose ``__call__`` returns logits
  only: the logits-level loss calls it, the fused loss must refuse it and say why, the
  log-prob pass runs tunix's function for it;
- ``protocol``: the same adapter given what MaxText's PR 5301 adds, ``skip_lm_head`` (the
  decoder's hidden states before its final norm) and ``compute_final_logits`` (MaxText's
  ``logits_from_hidden_states_for_vocab_tiling``: final norm and head): both losses and the
  log-prob pass read it through ``compute_final_logits``.

Each loss's value and the gradient of every parameter against tunix's ``grpo`` (max relative
error; ``--tol``, 1e-5), and the log-probs against tunix's pass; one JSON line per check to
``--out``. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

PAD, EOS = 0, 1


def tiny_config(vocab: int) -> Any:
    """MaxText's config for a 2-layer, width-32 Qwen3-style decoder on the CPU."""
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    return pyconfig.initialize(
        ["", base], model_name="qwen3-0.6b", override_model_config=True, base_emb_dim=32,
        base_num_query_heads=4, base_num_kv_heads=2, base_mlp_dim=64,
        base_num_decoder_layers=2, head_dim=8, vocab_size=vocab, max_target_length=64,
        per_device_batch_size=2, dtype="float32", weight_dtype="float32",
        attention="dot_product", enable_checkpointing=False, hardware="cpu",
        skip_jax_distributed_system=True, run_name="maxtext_tunix_parity",
        base_output_directory="/tmp/maxtext_tunix_parity", scan_layers=False,
        dropout_rate=0.0)


def adapters(vocab: int, seed: int) -> dict[str, Any]:
    """The released adapter and the protocol one (module docstring), on the same decoder."""
    from flax import nnx
    from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
    from maxtext.utils import model_creation_utils

    class ProtocolAdapter(TunixMaxTextAdapter):
        """``skip_lm_head`` and ``compute_final_logits`` over the released adapter."""

        def __call__(self, input_tokens, positions, cache, attention_mask,
                     decoder_segment_ids=None, output_hidden_states=False,
                     forced_routed_experts=None, segment_ids=None, skip_lm_head=False):
            if not skip_lm_head:
                return super().__call__(input_tokens, positions, cache, attention_mask,
                                        decoder_segment_ids, output_hidden_states,
                                        forced_routed_experts, segment_ids)
            seg = segment_ids if segment_ids is not None else decoder_segment_ids
            if seg is None and attention_mask is not None:
                seg = attention_mask[:, -1, :].astype("int32")
            _, hidden, _ = self.base.decoder(
                shared_embedding=self.base.token_embedder, decoder_input_tokens=input_tokens,
                decoder_positions=positions, decoder_segment_ids=seg, deterministic=True,
                model_mode="train")
            return hidden, None

        def compute_final_logits(self, hidden):
            return self.base.logits_from_hidden_states_for_vocab_tiling(
                hidden, deterministic=True, model_mode="train")

    config = tiny_config(vocab)
    base = model_creation_utils.from_config(config, rngs=nnx.Rngs(seed))
    released = TunixMaxTextAdapter(base_model=base, pad_id=PAD)
    protocol = ProtocolAdapter(base_model=base, pad_id=PAD)
    return {"released": released, "protocol": protocol}


def train_example(model: Any, seed: int, vocab: int, batch: int = 4, prompt: int = 5,
                  completion: int = 9) -> Any:
    """A GRPO step's ``TrainExample``: left-padded prompts, right-padded completions,
    advantages ~ N(0, 1), old and reference log-probs tunix's own pass plus noise."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tunix.rl import common

    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(2, vocab, (batch, prompt))
    for b in range(batch):
        prompt_ids[b, :b % prompt] = PAD
    lengths = np.array([1, completion, *rng.integers(1, completion + 1, batch - 2)])
    mask = (np.arange(completion)[None, :] < lengths[:, None]).astype(np.int32)
    completion_ids = np.where(mask > 0, rng.integers(2, vocab, (batch, completion)), PAD)
    prompt_ids, completion_ids = jnp.asarray(prompt_ids), jnp.asarray(completion_ids)
    graphdef, state = nnx.split(model)
    logps = common.compute_per_token_logps(graphdef, state, prompt_ids, completion_ids, PAD,
                                           EOS)
    noise = [jnp.asarray(rng.normal(size=logps.shape) * 0.3, jnp.float32) for _ in range(2)]
    return common.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=(prompt_ids != PAD).astype(jnp.int32),
        completion_ids=completion_ids, completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=batch), jnp.float32),
        ref_per_token_logps=logps + noise[1], old_per_token_logps=logps + noise[0])


def algo_config() -> Any:
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    cfg = GRPOConfig(loss_agg_mode="sequence-mean-token-mean", kl_loss_mode="low_var_kl",
                     loss_algo="gspo-token", beta=0.04, epsilon=0.2, num_generations=2)
    cfg.temperature = 0.7
    return cfg


def rel_err(a: Any, b: Any) -> float:
    """Largest, over the leaves of two pytrees, of max|a - b| / max|b|."""
    import jax
    import numpy as np

    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.max(np.abs(y))) or 1.0
        worst = max(worst, float(np.max(np.abs(x - y))) / scale)
    return worst


def loss_and_grads(fn: Any, model: Any, example: Any, cfg: Any) -> tuple[Any, Any]:
    """The loss tunix's trainer differentiates and its gradient w.r.t. every parameter, taken
    as the trainer takes it (``nnx.value_and_grad`` of the model)."""
    from flax import nnx

    from grpo_kernels.integrations import tunix as ours

    def f(m):
        return ours.differentiated(fn(m, example, cfg, PAD, EOS))
    return nnx.value_and_grad(f)(model)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import jax
    import tunix
    from flax import nnx
    from tunix.rl import algo_core, common

    from grpo_kernels.integrations import tunix as ours
    from grpo_kernels.integrations.tunix import models

    rows = []
    cfg = algo_config()
    where = os.path.dirname(tunix.__file__)
    for name, model in adapters(args.vocab, args.seed).items():
        example = train_example(model, args.seed + 1, args.vocab)
        want, want_g = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg)
        row = {"adapter": name, "reading": models.reading(model), "tunix": where,
               "jax": jax.__version__}
        for loss in ("grpo_kernels", "grpo_kernels_fused"):
            fn = ours.logits_policy_loss if loss == "grpo_kernels" else ours.fused_policy_loss
            try:
                got, got_g = loss_and_grads(fn, model, example, cfg)
            except ValueError as e:
                rows.append({**row, "check": loss, "refused": str(e),
                             "ok": name == "released" and loss == "grpo_kernels_fused"})
                continue
            err = {"loss": rel_err(got, want), "grads": rel_err(got_g, want_g)}
            rows.append({**row, "check": loss, **err,
                         "ok": max(err.values()) <= args.tol})
        graphdef, state = nnx.split(model)
        fn = ours.log_probs_function("xla")
        got = fn(graphdef, state, example.prompt_ids, example.completion_ids, PAD, EOS,
                 temperature=0.7)
        want = common.compute_per_token_logps(graphdef, state, example.prompt_ids,
                                              example.completion_ids, PAD, EOS, temperature=0.7)
        err = rel_err(got, want)  # the released adapter: tunix's function inlined in ours
        rows.append({**row, "check": "log_probs", "logps": err, "calls": fn.calls,
                     "ok": err <= args.tol})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=256, help="the tiny decoder's vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-5, help="max relative error that passes")
    p.add_argument("--out", help="JSON lines of the checks (default: print only)")
    args = p.parse_args(argv)
    if args.vocab < 8:
        p.error(f"--vocab must be >= 8, got {args.vocab}")
    try:
        import maxtext  # noqa: F401
    except ImportError as e:
        print(f"maxtext_tunix_parity: needs MaxText in this environment ({e}); see --help",
              file=sys.stderr)
        return 2
    rows = run(args)
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
