"""Tiny random tunix models and TrainExamples for the integration tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PAD, EOS = 0, 1
VOCAB = 257  # odd: no tile of any implementation divides it


def tiny_model(family: str, seed: int = 0, tied: bool = False, dtype=jnp.float32,
               softcap: float | None = None, vocab: int = VOCAB):
    """A 2-layer tunix Qwen2 / Qwen3 / Llama3 / Gemma3 / Gemma with random weights (Gemma's
    heads are always tied; ``softcap``: Gemma's ``final_logit_softcap``, as Gemma 2's)."""
    shape = dict(num_layers=2, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
                 num_kv_heads=2)
    rngs = nnx.Rngs(seed)
    if family == "gemma3":
        from tunix.models.gemma3 import model as m

        return m.Gemma3(m.ModelConfig(**shape, num_embed=vocab, sliding_window_size=4,
                                      param_dtype=jnp.float32), rngs=rngs)
    if family == "gemma":
        from tunix.models.gemma import model as m

        return m.Gemma(m.ModelConfig(
            **shape, num_embed=vocab, final_logit_softcap=softcap, use_post_attn_norm=True,
            use_post_ffw_norm=True, attention_types=(m.AttentionType.GLOBAL,) * 2), rngs=rngs)
    common = dict(**shape, vocab_size=vocab, rope_theta=10_000, norm_eps=1e-6)
    if family == "qwen3":
        from tunix.models.qwen3 import model as m

        return m.Qwen3(m.ModelConfig(**common, use_tied_embedding=tied, dtype=dtype,
                                     param_dtype=jnp.float32), rngs=rngs)
    if family == "qwen2":
        from tunix.models.qwen2 import model as m

        return m.Qwen2(m.ModelConfig(**common, use_tied_embedding=tied, dtype=dtype,
                                     param_dtype=jnp.float32), rngs=rngs)
    from tunix.models.llama3 import model as m

    return m.Llama3(m.ModelConfig(**common, weight_tying=tied), rngs=rngs)


def train_example(model, seed: int = 0, batch: int = 4, prompt: int = 5, completion: int = 7,
                  sampler: bool = False, ref: bool = True, noise: float = 0.3,
                  vocab: int = VOCAB):
    """A ``TrainExample`` like one GRPO step's: left-padded prompts, right-padded completions
    (one ends at once, one fills the length), advantages ~ N(0, 1), old and reference log-probs
    the model's own plus noise (so the clips and clamps act), sampler weights in [0.2, 2)."""
    from tunix.rl import common

    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(2, vocab, (batch, prompt))
    for b in range(batch):
        prompt_ids[b, :b % prompt] = PAD
    lengths = np.array([1, completion, *rng.integers(1, completion + 1, batch - 2)])
    completion_ids = rng.integers(2, vocab, (batch, completion))
    mask = (np.arange(completion)[None, :] < lengths[:, None]).astype(np.int32)
    completion_ids = np.where(mask > 0, completion_ids, PAD)
    for b in range(batch):
        if lengths[b] < completion:
            completion_ids[b, lengths[b] - 1] = EOS
    prompt_ids, completion_ids = jnp.asarray(prompt_ids), jnp.asarray(completion_ids)
    graphdef, state = nnx.split(model)
    logps = common.compute_per_token_logps(graphdef, state, prompt_ids, completion_ids, PAD, EOS)
    noise_a = jnp.asarray(rng.normal(size=logps.shape) * noise, jnp.float32)
    noise_b = jnp.asarray(rng.normal(size=logps.shape) * noise, jnp.float32)
    weights = jnp.asarray(rng.uniform(0.2, 2.0, logps.shape), jnp.float32) if sampler else None
    return common.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=(prompt_ids != PAD).astype(jnp.int32),
        completion_ids=completion_ids, completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=batch), jnp.float32),
        ref_per_token_logps=logps + noise_b if ref else None,
        old_per_token_logps=logps + noise_a, sampler_is_weights=weights)


def halved(model):
    """``model`` as an instance of a subclass whose ``__call__`` halves the logits."""
    base = type(model)

    def __call__(self, *args, **kwargs):
        logits, cache = base.__call__(self, *args, **kwargs)
        return logits * 0.5, cache
    model.__class__ = type("HalvedLogits", (base,), {"__call__": __call__})
    return model


def loss_and_grads(loss_fn, model, example, algo_config, jit: bool = True, **kwargs):
    """``(loss, aux, grads)`` of a tunix policy loss w.r.t. every parameter of ``model``, as the
    installed tunix's trainer differentiates it: 0.1.7's ``(loss, aux)``, or the head's
    ``LossOutput`` (``loss`` its primary sum, ``aux`` the whole ``LossOutput``)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        m = nnx.merge(graphdef, p, rest)
        out = loss_fn(m, example, algo_config, PAD, EOS, **kwargs)
        if isinstance(out, tuple):
            return out
        return out.primary_loss.unreduced_sum, out

    step = jax.value_and_grad(f, has_aux=True)
    if jit:
        step = jax.jit(step)
    (loss, aux), grads = step(params)
    return loss, aux, grads


TOL = 1e-5


def _close(got, want, err_msg, atol: float = 1e-6):
    np.testing.assert_allclose(float(got), float(want), rtol=TOL, atol=atol, err_msg=err_msg)


def _weighted(got, want, name):
    """A tunix ``WeightedMetric`` against another: sum, denominator and their bounds."""
    assert type(got) is type(want), f"{name}: {type(got).__name__} for {type(want).__name__}"
    # A sum over n tokens of float32 terms that cancel (the entropy: logsumexp minus the
    # expected logit, each of order one): its rounding grows with n and moves with the order
    # the CPU's vector width gives the reductions (an AVX2 Zen 3 reads 1.4e-6 from tunix's
    # head on the tiny qwen2 where other machines read within 1e-6), so the bound is a few
    # float32 ulps per token, not a fixed 1e-6.
    atol = max(1e-6, 4 * float(np.finfo(np.float32).eps) * abs(float(want.denominator)))
    _close(got.unreduced_sum, want.unreduced_sum, f"{name}: sum", atol=atol)
    _close(got.denominator, want.denominator, f"{name}: denominator")
    assert (got.eps, got.min_denom) == (want.eps, want.min_denom), name


def assert_parity(name, got, want, grad_tol: float = TOL):
    """``(loss, aux, grads)`` of :func:`loss_and_grads` equal to tunix's within ``TOL``: the
    loss (the head: the primary sum and its denominator), the gradient of every parameter
    (float32 relative, within ``grad_tol``), and every aux entry tunix logs (the head's
    ``WeightedMetric`` entries by sum and denominator)."""
    (loss, aux, grads), (want_loss, want_aux, want_g) = got, want
    assert np.isfinite(float(loss)), name
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=TOL, atol=TOL * 1e-2,
                               err_msg=name)
    err = max_rel_err(grads, want_g)
    assert err <= grad_tol, (name, err)
    if not isinstance(want_aux, dict):  # the head's LossOutput
        _weighted(aux.primary_loss, want_aux.primary_loss, f"{name}: primary_loss")
        aux, want_aux = aux.aux_metrics, want_aux.aux_metrics
    for key, value in want_aux.items():
        if hasattr(value, "unreduced_sum"):
            _weighted(aux[key], value, f"{name}: {key}")
        else:
            _close(aux[key], value, f"{name}: {key}")


def max_rel_err(a, b) -> float:
    """Largest, over the leaves of two pytrees, of max|a - b| / max|b|."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.isfinite(x).all(), "non-finite gradient"
        scale = np.max(np.abs(y))
        worst = max(worst, float(np.max(np.abs(x - y)) / scale) if scale > 0 else
                    float(np.max(np.abs(x))))
    return worst


def packed_example(model, seed: int = 0, rows: int = 2, length: int = 24, vocab: int = VOCAB,
                   ref: bool = True, sampler: bool = False, noise: float = 0.3,
                   segments_per_row=(3, 2)):
    """A packed ``TrainExample`` as tunix's ``pack_sequences`` makes one: ``prompt_ids`` empty,
    each row whole sequences (a prompt, ``completion_mask`` 0, then a completion, 1 up to its
    end), then padding (segment 0, mask 0); positions restart at each sequence; per-token
    advantages (the sequence's on its completion, 0 elsewhere); old and reference log-probs
    tunix's own packed pass's plus noise; ``num_segments`` where the installed tunix has it.
    The second row's last sequence is wholly masked."""
    import dataclasses

    from tunix.rl import common

    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, (rows, length))
    mask = np.zeros((rows, length), np.int32)
    adv = np.zeros((rows, length), np.float32)
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    for r in range(rows):
        start = 0
        for k in range(1, segments_per_row[r] + 1):
            n = int(rng.integers(5, 9))
            prompt = int(rng.integers(2, 4))
            seg[r, start:start + n] = k
            pos[r, start:start + n] = np.arange(n)
            if not (r == rows - 1 and k == segments_per_row[r]):
                mask[r, start + prompt:start + n] = 1
            adv[r, start + prompt:start + n] = rng.normal()
            start += n
        ids[r, start:] = PAD
    ids, seg, pos = (jnp.asarray(x) for x in (ids, seg, pos))
    prompt_ids = jnp.zeros((rows, 0), jnp.int32)
    graphdef, state = nnx.split(model)
    logps = common.compute_per_token_logps(graphdef, state, prompt_ids, ids, PAD, EOS,
                                           segment_ids=seg, segment_positions=pos)
    logps = logps * jnp.asarray(mask > 0)  # tunix's packer zero-fills the prompts' log-probs
    noisy = [logps + jnp.asarray(rng.normal(size=logps.shape) * noise, jnp.float32) * (mask > 0)
             for _ in range(2)]
    weights = jnp.asarray(rng.uniform(0.2, 2.0, logps.shape), jnp.float32) if sampler else None
    extra = {}
    if "num_segments" in {f.name for f in dataclasses.fields(common.TrainExample)}:
        extra["num_segments"] = max(segments_per_row) + 2
    return common.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids, completion_ids=ids,
        completion_mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
        ref_per_token_logps=noisy[1] if ref else None, old_per_token_logps=noisy[0],
        segment_ids=seg, segment_positions=pos, sampler_is_weights=weights, **extra)


class AdapterModel(nnx.Module):
    """A stand-in with MaxText's ``TunixMaxTextAdapter`` interface (MaxText's head, PR 5301):
    ``__call__(input_tokens, positions, cache, attention_mask, decoder_segment_ids=None,
    output_hidden_states=False, segment_ids=None, skip_lm_head=False)`` returning ``(logits,
    None)``, or with ``skip_lm_head`` the hidden states before the final norm, which
    ``compute_final_logits`` applies with the head (and a soft cap): weights we do not read.
    One causal attention-free mixing layer (a running mean over the segment's earlier
    positions) and an MLP, so every position depends on the ones before it."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.mix = nnx.Linear(dim, dim, rngs=rngs)
        self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, rngs=rngs)
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, input_tokens, positions, cache, attention_mask,
                 decoder_segment_ids=None, output_hidden_states=False, segment_ids=None,
                 skip_lm_head=False):
        seg = segment_ids if segment_ids is not None else decoder_segment_ids
        x = self.embed(input_tokens)
        t = x.shape[1]
        allowed = jnp.tril(jnp.ones((t, t), bool))[None]
        if seg is not None:
            allowed = allowed & (seg[:, :, None] == seg[:, None, :])
        elif attention_mask is not None:
            allowed = allowed & attention_mask.astype(bool)
        w = allowed.astype(x.dtype)
        mean = (w @ x) / jnp.maximum(w.sum(-1, keepdims=True), 1.0)
        x = x + jnp.tanh(self.mix(mean))
        x = x + self.down(jax.nn.gelu(self.up(x)))
        if skip_lm_head:
            return x, None
        return self.compute_final_logits(x), None

    def compute_final_logits(self, hidden):
        logits = self.head(self.norm(hidden)).astype(jnp.float32)
        return 30.0 * jnp.tanh(logits / 30.0)
