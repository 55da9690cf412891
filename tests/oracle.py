"""Float64 NumPy oracle of the GRPO loss, written the way TRL's GRPOTrainer aggregates.

Deliberately independent of grpo_kernels.objective: no shared helpers, TRL-style aggregation
formulas instead of per-token weights.
"""

from __future__ import annotations

import numpy as np


def oracle(logits, ids, mask, adv, cfg, old=None, ref=None, num_items=None):
    """Returns ``(loss, metrics)`` in float64. Inputs are NumPy arrays (any float dtype)."""
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
    adv = np.asarray(adv, np.float64)[:, None]
    old = logp if old is None else np.asarray(old, np.float64)
    if cfg.importance_sampling_level == "token":
        log_w = logp - old
    else:
        log_w = ((logp - old) * mask).sum(-1, keepdims=True) / np.maximum(mask.sum(-1, keepdims=True), 1)
    coef_1 = np.exp(log_w)
    coef_2 = np.clip(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    if cfg.delta is not None:
        coef_1 = np.minimum(coef_1, cfg.delta)
    per_token = -np.minimum(coef_1 * adv, coef_2 * adv)
    per_token = np.broadcast_to(per_token, logp.shape)
    kl = None
    if ref is not None:
        d = np.asarray(ref, np.float64) - logp
        kl = np.exp(d) - d - 1
    if cfg.beta > 0:
        per_token = per_token + cfg.beta * kl
    if cfg.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
    elif cfg.loss_type == "bnpo":
        loss = (per_token * mask).sum() / max(mask.sum(), 1)
    elif cfg.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * cfg.max_completion_length)
    else:
        norm = max(mask.sum(), 1) if num_items is None else num_items
        loss = (per_token * mask).sum() / norm

    n_tok = max(mask.sum(), 1)

    def batch_mean(x):
        if x.shape[1] == 1:
            return x.mean()
        return (x * mask).sum() / n_tok

    low = ((coef_1 < 1 - cfg.epsilon_low) & (adv < 0)).astype(np.float64)
    high = ((coef_1 > 1 + cfg.epsilon_high) & (adv > 0)).astype(np.float64)
    metrics = {
        "logp": logp,
        "entropy": (entropy * mask).sum() / n_tok,
        "kl": 0.0 if kl is None else (kl * mask).sum() / n_tok,
        "clip_ratio_low": batch_mean(low),
        "clip_ratio_high": batch_mean(high),
        "clip_ratio_region": batch_mean(np.maximum(low, high)),
    }
    return float(loss), metrics
