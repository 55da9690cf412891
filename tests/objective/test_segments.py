"""Packed rows (grpo_kernels.objective.segments): the reference against the float64 oracle,
packing invariance of values and gradients, the fast implementations against the reference,
and the combinations refused by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import GRPOLossConfig, Segments, grpo_loss, grpo_loss_from_hidden
from grpo_kernels.config import LOSS_AGG_MODES
from tests.helpers import as64
from tests.oracle import oracle

LEVELS = ("token", "sequence", "sequence_token")


def packed_batch(seed: int, rows: int = 3, length: int = 16, vocab: int = 61,
                 segments_per_row=(3, 2, 1)):
    """Random packed rows: each row holds whole sequences (a prompt, mask 0, then a
    completion, mask 1 with a masked-out tail), then padding (segment 0). One sequence is
    fully masked. Per-token advantages: the sequence's on its tokens, 0 elsewhere. Returns the
    arrays and, for each sequence, ``(row, start, end)``."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.float32)
    adv = np.zeros((rows, length), np.float32)
    seg = np.zeros((rows, length), np.int32)
    spans = []
    for r in range(rows):
        pos = 0
        for k in range(1, segments_per_row[r] + 1):
            n = int(rng.integers(3, 6))
            prompt = int(rng.integers(1, 3))
            seg[r, pos:pos + n] = k
            scored = int(rng.integers(1, n - prompt + 1))
            if not (r == 1 and k == 2):  # one sequence fully masked
                mask[r, pos + prompt:pos + prompt + scored] = 1
            adv[r, pos + prompt:pos + n] = rng.normal()
            spans.append((r, pos, pos + n))
            pos += n
        ids[r] = rng.integers(0, vocab, length)
    return ids, mask, adv, seg, spans


def unpack(x, spans, width):
    """The sequences of packed ``[rows, L]`` arrays as unpacked rows ``[n, width]`` (padded
    with zeros, which the masks zero out)."""
    out = np.zeros((len(spans), width, *x.shape[2:]), x.dtype)
    for i, (r, a, b) in enumerate(spans):
        out[i, :b - a] = x[r, a:b]
    return out


def config(mode, level, **kw):
    return GRPOLossConfig(loss_agg_mode=mode, importance_sampling_level=level, beta=0.04,
                          epsilon_high=0.28, sequence_log_ratio_max=0.05,
                          loss_agg_norm=7.0 if mode == "sequence-mean-token-scale" else None,
                          **kw)


@pytest.fixture(scope="module")
def packed():
    ids, mask, adv, seg, spans = packed_batch(0)
    k = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(k[0], (*ids.shape, 61)) * 2.0
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1)[..., 0]
    old = logp + 0.3 * jax.random.normal(k[1], logp.shape)
    ref = logp + 0.3 * jax.random.normal(k[2], logp.shape)
    return dict(logits=logits, ids=ids, mask=mask, adv=adv, seg=seg, spans=spans, old=old,
                ref=ref)


def _loss(p, cfg, impl="reference", segments=True):
    def f(z):
        return grpo_loss(z, p["ids"], p["mask"], p["adv"], config=cfg, old_logps=p["old"],
                         ref_logps=p["ref"], impl=impl,
                         segments=Segments(p["seg"], 6) if segments else None)
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(p["logits"])
    return loss, metrics, grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_reference_matches_float64_oracle_per_segment(packed, mode):
    """Every aggregation at every level: loss, its two parts and the clip metrics."""
    for level in LEVELS:
        cfg = config(mode, level, dual_clip=2.0)
        loss, metrics, grad = _loss(packed, cfg)
        want, want_m = oracle(as64(packed["logits"]), packed["ids"], packed["mask"],
                              packed["adv"], cfg, as64(packed["old"]), as64(packed["ref"]),
                              segments=(packed["seg"], 6))
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7, err_msg=level)
        for key in ("policy_loss", "kl_loss", "clip_ratio_region", "clip_ratio_low", "kl"):
            np.testing.assert_allclose(float(metrics[key]), want_m[key], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{level}: {key}")


@pytest.mark.parametrize("level", LEVELS)
def test_packing_changes_nothing(packed, level):
    """The packed batch and its sequences unpacked one to a row give the same loss and the
    same gradient at every position (the modes whose per-row and per-segment forms agree)."""
    spans, width = packed["spans"], 6
    rows = {k: unpack(np.asarray(packed[k]), spans, width)
            for k in ("logits", "ids", "mask", "adv", "old", "ref")}
    for mode in ("token-mean", "sequence-mean-token-mean", "seq-mean-token-sum"):
        cfg = config(mode, level)
        loss, _, grad = _loss(packed, cfg)
        want, _, want_grad = _loss(rows, cfg, segments=False)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-6, err_msg=mode)
        np.testing.assert_allclose(unpack(np.asarray(grad), spans, width),
                                   np.asarray(want_grad), rtol=1e-5, atol=1e-7, err_msg=mode)


@pytest.mark.parametrize("impl", ["xla", "pallas", "fused"])
def test_fast_implementations_match_the_reference(packed, impl):
    """The logits-level xla and Pallas (interpreted) losses and the fused head's xla loss on
    packed rows, gspo-token and the sequence-mean aggregation: loss and gradient."""
    cfg = config("sequence-mean-token-mean", "sequence_token", dual_clip=2.0)
    want, want_m, want_g = _loss(packed, cfg)
    if impl == "fused":
        h = jax.random.normal(jax.random.key(3), (*packed["ids"].shape, 8))
        w = jax.random.normal(jax.random.key(4), (8, 61)) * 0.5

        def f(h, impl):
            return grpo_loss_from_hidden(h, w, packed["ids"], packed["mask"], packed["adv"],
                                         config=cfg, old_logps=packed["old"],
                                         ref_logps=packed["ref"], impl=impl,
                                         segments=Segments(packed["seg"], 6))[0]
        want, want_g = jax.value_and_grad(f)(h, "reference")
        loss, grad = jax.value_and_grad(f)(h, "xla")
    else:
        loss, metrics, grad = _loss(packed, cfg, impl)
        np.testing.assert_allclose(float(metrics["clip_ratio_region"]),
                                   float(want_m["clip_ratio_region"]), rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_g), rtol=1e-4, atol=1e-6)


def test_unsupported_combinations_are_named(packed):
    seg = Segments(packed["seg"], 6)

    def call(cfg, segments=seg):
        return grpo_loss(packed["logits"], packed["ids"], packed["mask"], packed["adv"],
                         config=cfg, old_logps=packed["old"], ref_logps=packed["ref"],
                         segments=segments)
    for cfg, match in (
            (GRPOLossConfig(loss_type="grpo", beta=0.04), "loss_type='grpo' without loss_agg"),
            (GRPOLossConfig(loss_type="vespo", beta=0.04), "'vespo'"),
            (GRPOLossConfig(loss_type="dapo", off_policy_mask_threshold=0.5, beta=0.04),
             "off_policy_mask_threshold"),
            (GRPOLossConfig(loss_agg_mode="sequence-mean-token-scale", beta=0.04),
             "needs config.loss_agg_norm")):
        with pytest.raises(ValueError, match=match):
            call(cfg)
    cfg = GRPOLossConfig(loss_type="dapo", beta=0.04)
    call(cfg)  # token-level normalisation: accepted
    with pytest.raises(ValueError, match=r"segments.ids must have shape \[B, T\]"):
        call(cfg, Segments(packed["seg"][:, :3], 6))
    with pytest.raises(ValueError, match="segments.count must be an int >= 1"):
        call(cfg, Segments(packed["seg"], 0))
    with pytest.raises(ValueError, match="segments must be a grpo_kernels.Segments"):
        call(cfg, packed["seg"])
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\] \(or \[B, T\]"):
        grpo_loss(packed["logits"], packed["ids"], packed["mask"], packed["adv"][:, :3],
                  config=cfg, ref_logps=packed["ref"])
    with pytest.raises(ValueError, match="loss_agg_norm is tunix's norm"):
        dataclasses.replace(cfg, loss_agg_norm=3.0)
