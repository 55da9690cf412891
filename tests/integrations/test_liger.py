"""Our losses against Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss (torch, CPU) wherever
Liger has the option: CISPO, SAPO, VESPO, LUSPO, the sampler correction (Liger takes the
ratio, ``vllm_is_ratio``), the KL bias correction. Liger has no entropy terms.

Where Liger 0.8.5 and TRL 1.16 differ, ours is TRL's and the test says so: LUSPO's
aggregation. TRL 1.16 (``GRPOTrainer._compute_loss``) takes ``(per_token_loss * mask).sum(-1)
.mean()``; Liger ``(per_token_loss * mask.sum(-1, keepdim=True)).mean()``, which also counts
padding positions. The two agree when the per-token loss is one value per sequence (sequence
level, no KL term); otherwise the case holds ours to the float64 oracle of TRL's formula and
checks that Liger's value is not it.

``make test`` installs liger-kernel (without its Triton dependency: the chunked losses are
plain torch), so CI runs these; without torch or liger-kernel the module is skipped and says
so.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import GRPOLossConfig, grpo_loss_from_hidden
from tests.oracle import _sampler_ratio, oracle

torch = pytest.importorskip("torch", reason="torch is not installed (the dev extra has it)")
liger = pytest.importorskip(
    "liger_kernel.chunked_loss.grpo_loss",
    reason="liger-kernel is not installed (make test installs liger-kernel==0.8.5 --no-deps)")

B, T, H, V = 3, 6, 16, 40

CASES = [
    dict(loss_type="cispo", epsilon_high=1.05),
    dict(loss_type="sapo", temperature=0.7),
    dict(loss_type="vespo", beta=0.04),
    dict(loss_type="vespo", sampler_correction="token_truncate", sampler_correction_max=1.05),
    dict(loss_type="luspo", beta=0.04),
    dict(loss_type="luspo", delta=1.5),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="grpo", beta=0.04, kl_bias_correction=True, delta=1.3),
    dict(loss_type="dapo", sampler_correction="token_mask", sampler_correction_min=0.9,
         sampler_correction_max=1.1),
    dict(loss_type="sapo", sampler_correction="sequence_truncate", sampler_correction_max=1.2),
    dict(loss_type="bnpo", importance_sampling_level="sequence", beta=0.04,
         kl_bias_correction=True, sampler_correction="sequence_mask",
         sampler_correction_min=0.5, sampler_correction_max=1.5),
]


def _liger_aggregates_otherwise(cfg):
    """LUSPO with a per-token loss that varies along the sequence (see the module docstring)."""
    return cfg.loss_type == "luspo" and (cfg.importance_sampling_level == "token"
                                         or cfg.beta > 0)


def _id(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)).astype(np.float32)
    w = (rng.normal(size=(V, H)) * 0.5).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T))
    lengths = rng.integers(1, T + 1, size=(B, 1))
    mask = (np.arange(T)[None] < lengths).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    base = (-np.log(V) + 0.3 * rng.normal(size=(B, T))).astype(np.float32)
    ref = (base + 0.1 * rng.normal(size=(B, T))).astype(np.float32)
    sampler = (base + 0.1 * rng.normal(size=(B, T))).astype(np.float32)
    return hidden, w, ids, mask, adv, base, ref, sampler


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_liger_fused_linear_grpo(case):
    cfg = GRPOLossConfig(**case)
    hidden, w, ids, mask, adv, old, ref, sampler = _inputs()

    def ours(h, ww):
        return grpo_loss_from_hidden(h, ww, jnp.asarray(ids), jnp.asarray(mask),
                                     jnp.asarray(adv), config=cfg, old_logps=jnp.asarray(old),
                                     ref_logps=jnp.asarray(ref),
                                     sampler_logps=jnp.asarray(sampler), impl="xla",
                                     lm_head_layout="vh")[0]

    loss, (dh, dw) = jax.value_and_grad(ours, (0, 1))(jnp.asarray(hidden), jnp.asarray(w))

    ratio = None
    if cfg.sampler_correction is not None:
        ratio = torch.tensor(_sampler_ratio(old.astype(np.float64), sampler, mask, cfg),
                             dtype=torch.float32)
    loss_fn = liger.LigerFusedLinearGRPOLoss(
        beta=cfg.beta, compiled=False, use_ref_model=cfg.beta > 0, chunk_size=1,
        epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type,
        max_completion_length=T, importance_sampling_level=cfg.importance_sampling_level,
        temperature=cfg.temperature, delta=cfg.delta,
        use_bias_correction_kl=cfg.kl_bias_correction)
    th = torch.tensor(hidden, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    out = loss_fn(th, tw, torch.tensor(ids), torch.tensor(mask), torch.tensor(adv),
                  ref_per_token_logps=torch.tensor(ref) if cfg.beta > 0 else None,
                  old_per_token_logps=torch.tensor(old), vllm_is_ratio=ratio,
                  num_items_in_batch=torch.tensor(float(mask.sum())))
    want = out[0] if isinstance(out, tuple) else out
    if _liger_aggregates_otherwise(cfg):
        trl, _ = oracle(hidden.astype(np.float64) @ w.astype(np.float64).T, ids, mask, adv, cfg,
                        old, ref if cfg.beta > 0 else None, sampler_logps=sampler)
        np.testing.assert_allclose(float(loss), trl, rtol=1e-5, atol=1e-6)
        assert abs(float(want.detach()) - trl) > 1e-3 * abs(trl)
        return
    want.backward()
    np.testing.assert_allclose(float(loss), float(want.detach()), rtol=1e-5, atol=1e-6)
    for got, ref_grad in ((dh, th.grad), (dw, tw.grad)):
        ref_grad = ref_grad.numpy()
        scale = np.abs(ref_grad).max()
        assert scale > 0
        assert np.abs(np.asarray(got) - ref_grad).max() <= 1e-5 * scale
