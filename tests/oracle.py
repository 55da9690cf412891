"""Float64 NumPy oracle of the GRPO loss, written the way TRL's GRPOTrainer aggregates.

Deliberately independent of grpo_kernels.objective: no shared helpers, TRL-style aggregation
formulas instead of per-token weights.
"""

from __future__ import annotations

import numpy as np


def _sequences(mask, segments):
    """The sequences of a batch as lists of ``(row, positions)``: one per row, or with packed
    rows (``segments = (ids, count)``) one per segment id >= 1 present in a row, and the
    padding segment 0 of each row apart."""
    if segments is None:
        return [(b, np.arange(mask.shape[1])) for b in range(mask.shape[0])], []
    ids = np.asarray(segments[0])
    real, padding = [], []
    for b in range(ids.shape[0]):
        for k in np.unique(ids[b]):
            (real if k != 0 else padding).append((b, np.flatnonzero(ids[b] == k)))
    return real, padding


def _aggregate(per_token, mask, cfg, num_items, segments=None):
    """TRL's aggregation by ``loss_type``, or tunix's ``loss_agg_mode`` (common.aggregate_loss;
    with packed rows, its segment-aware form)."""
    mode = cfg.loss_agg_mode
    norm = cfg.loss_agg_norm
    seqs, _ = _sequences(mask, segments)
    sums = [(per_token[b, pos] * mask[b, pos]).sum() for b, pos in seqs]
    counts = [mask[b, pos].sum() for b, pos in seqs]
    live = [i for i, c in enumerate(counts) if c > 0]
    rows = max(len(live), 1)
    if mode == "token-mean" or (mode is None and cfg.loss_type == "bnpo"):
        return (per_token * mask).sum() / max(mask.sum(), 1)
    if mode == "sequence-mean-token-mean":
        return sum(sums[i] / max(counts[i], 1) for i in live) / rows
    if mode == "sequence-mean-token-scale":
        return sum(sums[i] for i in live) / (per_token.shape[-1] if norm is None else norm) / rows
    if mode == "seq-mean-token-sum":
        return sum(sums[i] for i in live) / rows
    if mode == "sequence-mean-token-sum-norm":
        return (per_token * mask).sum() / (rows if norm is None else norm)
    seq_sum = (per_token * mask).sum(-1)
    if cfg.loss_type in ("grpo", "sapo"):
        return (seq_sum / np.maximum(mask.sum(-1), 1)).mean()
    if cfg.loss_type == "luspo":  # TRL 1.16: mask, sum each row, mean over rows
        return (per_token * mask).sum(-1).mean()
    if cfg.loss_type == "dr_grpo":
        return seq_sum.sum() / (per_token.shape[0] * cfg.max_completion_length)
    norm = max(mask.sum(), 1) if num_items is None else num_items
    return seq_sum.sum() / norm


def _sampler_ratio(old, sampler_logps, mask, cfg):
    """TRL's vllm_importance_sampling_ratio, as _generate_and_score_completions forms it."""
    diff = (old - np.asarray(sampler_logps, np.float64)) * mask
    if cfg.sampler_correction.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    ratio = np.exp(diff)
    low = -np.inf if cfg.sampler_correction_min is None else cfg.sampler_correction_min
    high = np.inf if cfg.sampler_correction_max is None else cfg.sampler_correction_max
    if cfg.sampler_correction.endswith("truncate"):
        return np.clip(ratio, low, high)
    return np.where((ratio < low) | (ratio > high), 0.0, ratio)


def _gamma_weights(log_ratio, mask, adv, ratio, cfg):
    """TRL's get_gamma_weights (VESPO), written out in log space."""
    floor = np.log(1e-8)
    seq = (np.clip(log_ratio, -20, 20) * mask).sum(-1, keepdims=True)
    if ratio is not None:
        with np.errstate(divide="ignore"):
            seq = seq + np.clip(np.log(ratio), floor, 20).sum(-1, keepdims=True)
    log_w = np.clip(seq, floor, 20)
    k = np.where(adv >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = np.maximum(np.where(adv >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
    with np.errstate(over="ignore", invalid="ignore"):
        phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
    return np.where(np.isfinite(phi), phi, 0.0)


def oracle(logits, ids, mask, adv, cfg, old=None, ref=None, num_items=None, sampler=None,
           sampler_logps=None, segments=None):
    """Returns ``(loss, metrics)`` in float64. Inputs are NumPy arrays (any float dtype);
    ``adv`` is ``[B]`` or ``[B, T]``; ``segments``: ``(ids [B, T], count)`` of packed rows.

    The value only: at ``importance_sampling_level="sequence_token"`` the loss equals the
    ``sequence`` one (the levels differ in their gradients alone)."""
    s = np.asarray(logits, np.float64) / cfg.temperature
    m = s.max(-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True))
    logsm = s - lse
    vocab = s.shape[-1]
    ids = np.clip(np.asarray(ids), 0, vocab - 1)
    logp = np.take_along_axis(logsm, ids[..., None], -1)[..., 0]
    p = np.exp(logsm)
    with np.errstate(invalid="ignore"):
        entropy = -np.where(p > 0, p * logsm, 0.0).sum(-1)
    mask = np.asarray(mask, np.float64)
    adv = np.asarray(adv, np.float64)
    adv = adv[:, None] if adv.ndim == 1 else adv
    old = logp if old is None else np.asarray(old, np.float64)
    diff = logp - old
    if cfg.log_ratio_clamp is not None:
        diff = np.clip(diff, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    if cfg.importance_sampling_level == "token":
        log_w = diff
    elif segments is None:
        log_w = (diff * mask).sum(-1, keepdims=True) / np.maximum(mask.sum(-1, keepdims=True), 1)
    else:  # each segment's mean, padding's included (tunix pools segment 0 alike)
        log_w = np.zeros_like(diff)
        real, padding = _sequences(mask, segments)
        for b, pos in real + padding:
            log_w[b, pos] = (diff[b, pos] * mask[b, pos]).sum() / max(mask[b, pos].sum(), 1)
    if cfg.importance_sampling_level != "token" and cfg.sequence_log_ratio_max is not None:
        log_w = np.minimum(log_w, cfg.sequence_log_ratio_max)
    coef_1 = np.exp(log_w)
    unclipped = coef_1
    ratio = None if cfg.sampler_correction is None else _sampler_ratio(old, sampler_logps,
                                                                       mask, cfg)
    coef_2 = np.clip(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    if cfg.loss_type == "cispo":
        policy = -np.minimum(coef_1, cfg.epsilon_high) * adv * logp
    elif cfg.loss_type == "sapo":
        tau = np.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        policy = -(4 / tau) / (1 + np.exp(-tau * (coef_1 - 1))) * adv
    elif cfg.loss_type == "vespo":
        policy = -_gamma_weights(diff, mask, adv, ratio, cfg) * adv * logp
    else:
        if cfg.delta is not None:
            coef_1 = np.minimum(coef_1, cfg.delta)
        policy = -np.minimum(coef_1 * adv, coef_2 * adv)
        if cfg.dual_clip is not None:
            policy = np.where(adv < 0, np.minimum(policy, -cfg.dual_clip * adv), policy)
    policy = np.broadcast_to(policy, logp.shape)
    if cfg.off_policy_mask_threshold is not None:
        behaviour = old if sampler_logps is None else np.asarray(sampler_logps, np.float64)
        seq_kl = ((behaviour - logp) * mask).sum(-1, keepdims=True) / np.maximum(
            mask.sum(-1, keepdims=True), 1)
        policy = policy * ((adv >= 0) | (seq_kl <= cfg.off_policy_mask_threshold))
    selected = np.ones_like(mask)
    if cfg.top_entropy_quantile < 1:
        values = entropy[mask > 0]
        if values.size:
            threshold = np.quantile(values, 1 - cfg.top_entropy_quantile)
            selected = ((entropy >= threshold) & (mask > 0)).astype(np.float64)
        else:
            selected = np.zeros_like(mask)
        policy = policy * selected
    if ratio is not None and cfg.loss_type != "vespo":
        policy = policy * ratio
    if sampler is not None:
        policy = policy * np.asarray(sampler, np.float64)
    kl = None
    if ref is not None:
        d = np.asarray(ref, np.float64) - logp
        kl = {"k3": np.exp(d) - d - 1, "k1": -d, "k2": d * d / 2}[cfg.kl_estimator]
        if cfg.kl_clamp is not None:
            kl = np.clip(kl, -cfg.kl_clamp, cfg.kl_clamp)
        if cfg.kl_bias_correction:
            kl = kl * unclipped
    policy_loss = _aggregate(policy, mask, cfg, num_items, segments)
    kl_loss = 0.0 if kl is None else _aggregate(kl, mask, cfg, num_items, segments)
    loss = policy_loss + cfg.beta * kl_loss if cfg.beta > 0 else policy_loss
    if cfg.entropy_coef != 0:  # TRL 1.16: a token mean, whatever the loss type normalises by
        effective = mask * selected
        loss = loss - cfg.entropy_coef * (entropy * effective).sum() / max(effective.sum(), 1)

    n_tok = max(mask.sum(), 1)

    def batch_mean(x):
        if cfg.importance_sampling_level == "token":
            return (np.broadcast_to(x, mask.shape) * mask).sum() / n_tok
        if segments is None:  # one value per sequence
            return np.broadcast_to(x, mask.shape)[:, 0].mean()
        x = np.broadcast_to(x, mask.shape)
        live = [(b, pos) for b, pos in _sequences(mask, segments)[0] if mask[b, pos].sum() > 0]
        return sum((x[b, pos] * mask[b, pos]).sum() / mask[b, pos].sum()
                   for b, pos in live) / max(len(live), 1)

    low = ((coef_1 < 1 - cfg.epsilon_low) & (adv < 0)).astype(np.float64)
    high = ((coef_1 > 1 + cfg.epsilon_high) & (adv > 0)).astype(np.float64)
    metrics = {
        "logp": logp,
        "entropy": (entropy * mask).sum() / n_tok,
        "kl": 0.0 if kl is None else (kl * mask).sum() / n_tok,
        "clip_ratio_low": batch_mean(low),
        "clip_ratio_high": batch_mean(high),
        "clip_ratio_region": batch_mean(np.maximum(low, high)),
        "policy_loss": float(policy_loss),
        "kl_loss": float(kl_loss),
    }
    return float(loss), metrics


def truncated_oracle(scaled, ids, top_k=None, top_p=None, min_p=None):
    """Float64 log-probs under a sampler's min-p, top-k and top-p (in that order, vLLM's), by
    sorting each row of ``scaled [N, V]`` (the logits over the temperature).

    Returns ``(logp [N], entropy [N], kept [N, V] bool, outside [N] bool, dlogp [N, V])``:
    the kept set of each row (tie groups kept whole), whether the chosen id lies outside it,
    and the gradient of each log-prob w.r.t. the scaled row. The log-prob is taken over the
    kept set and the chosen token (documented in grpo_kernels.ops.core.truncation).
    """
    scaled = np.asarray(scaled, np.float64)
    n, v = scaled.shape
    logp, ent = np.zeros(n), np.zeros(n)
    kept = np.zeros((n, v), bool)
    grad = np.zeros((n, v))
    for r in range(n):
        s, keep = scaled[r], np.ones(v, bool)
        if min_p:
            keep &= s >= s.max() + np.log(min_p)
        if top_k is not None and keep.sum() > top_k:
            keep &= s >= np.sort(s[keep])[::-1][top_k - 1]
        if top_p is not None and top_p < 1:
            a = s[keep]
            q = np.exp(a - a.max())
            q /= q.sum()
            order = np.argsort(-a, kind="stable")
            desc, qs = a[order], q[order]
            before = np.cumsum(qs) - qs
            # a tie group's mass above is that before its first member
            first = np.searchsorted(-desc, -desc, side="left")
            above = np.empty_like(a)
            above[order] = before[first]
            sub = keep.copy()
            sub[keep] = above < top_p
            keep = sub
        kept[r] = keep
        support = keep.copy()
        support[ids[r]] = True
        x = s[support]
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        p = np.where(support, np.exp(np.where(support, s, 0.0) - lse), 0.0)
        logp[r] = s[ids[r]] - lse
        ent[r] = -(p[support] * (s[support] - lse)).sum()
        grad[r] = -p
        grad[r, ids[r]] += 1.0
    outside = ~kept[np.arange(n), ids]
    return logp, ent, kept, outside, grad
