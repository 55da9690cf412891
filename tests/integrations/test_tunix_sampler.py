"""``follow_sampler``: tunix's rollout top-k / top-p carried to our losses and log-prob pass,
on whichever tunix is installed. With the old log-probs a vLLM rollout returns (processed: the
truncated distribution), the policy losses' importance ratio at the first step is 1, and the
bias is there without it; the patched pass gives the truncated log-probs of the model's logits;
the rollouts whose log-probs are the whole vocabulary's are left alone; what cannot truncate
says so."""

import dataclasses
import types

import numpy as np
import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (make test installs it)")

from flax import nnx  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl.rollout.base_rollout import RolloutConfig  # noqa: E402

from grpo_kernels import LmHeadBlockSizes, token_logps  # noqa: E402
from grpo_kernels.integrations import tunix as ours  # noqa: E402
from grpo_kernels.integrations.tunix.inputs import token_inputs  # noqa: E402
from grpo_kernels.integrations.tunix.models import call_model  # noqa: E402
from grpo_kernels.ops.core.truncation import Truncation  # noqa: E402
from tests.integrations.test_tunix import TUNIX_LIKE, algo_config  # noqa: E402
from tests.integrations.tunix_models import (EOS, PAD, AdapterModel, tiny_model,  # noqa: E402
                                             train_example)

TAU = 0.7  # the algo_config's (the learner copies the rollout's there)


class Train:  # a mode key like tunix's Mode.TRAIN (its enum moved between versions)
    value = "train"


def cluster(engine="vllm", **rollout):
    """The two fields of a tunix ClusterConfig that follow_sampler reads."""
    config = RolloutConfig(temperature=TAU, **rollout)
    return types.SimpleNamespace(rollout_engine=engine, rollout_config={Train(): config})


@pytest.fixture(autouse=True)
def unbound():
    yield
    ours.unpatch_log_probs()


def truncated_logps(model, prompt, completion, trunc):
    """The reference's log-probs, entropies and outside flags of the completion under
    ``trunc`` (sorting each row of the model's own logits), at the temperature TAU."""
    inputs = token_inputs(model, prompt, completion, PAD, EOS, None, None)
    t = completion.shape[1]
    logits = call_model(model, inputs)[0][:, -t - 1:-1, :]
    return token_logps(logits, completion, temperature=TAU, impl="reference", top_k=trunc.top_k,
                       top_p=trunc.top_p, min_p=trunc.min_p, return_entropy=True,
                       return_outside=True)


@pytest.mark.parametrize("engine, rollout, want", [
    ("vllm", dict(top_k=20, top_p=0.9), Truncation(20, 0.9)),
    ("vllm", dict(top_k=0, top_p=0.8), Truncation(None, 0.8)),  # top_k <= 0: off, as tunix
    ("vllm", dict(top_k=None, top_p=1.0), None),
    ("vllm", dict(top_k=20, rollout_vllm_logprobs_mode="raw_logprobs"), None),
    ("vanilla", dict(top_k=20, top_p=0.9), None),  # its log-probs are the whole row's
])
def test_follow_sampler_sets_the_loss_and_binds_the_pass(engine, rollout, want):
    cfg = algo_config(*TUNIX_LIKE)
    ours.patch_log_probs("xla")
    assert ours.follow_sampler(cfg, cluster(engine, **rollout)) == want
    config = ours.loss_config(cfg, has_ref=True)
    w = want or Truncation()
    assert (config.top_k, config.top_p, config.min_p) == (w.top_k, w.top_p, w.min_p)
    bound = ours.log_probs.bound_options()
    assert bound == {"impl": "xla", "options": None, "truncation": want}  # impl kept


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="RolloutConfig.top_p"):
        ours.follow_sampler(algo_config(*TUNIX_LIKE), cluster(top_p=1.5))
    with pytest.raises(ValueError, match="rollout_engine"):
        ours.follow_sampler(algo_config(*TUNIX_LIKE), cluster("sglang_jax", top_k=20))
    bad = types.SimpleNamespace(rollout_engine="vllm", rollout_config={"eval": RolloutConfig()})
    with pytest.raises(ValueError, match="training mode"):
        ours.follow_sampler(algo_config(*TUNIX_LIKE), bad)
    cfg = algo_config(*TUNIX_LIKE)
    cfg.top_k = 0
    with pytest.raises(ValueError, match="GRPOConfig.top_k"):
        ours.loss_config(cfg, has_ref=True)
    assert common.compute_per_token_logps.__module__.startswith("tunix")  # nothing bound


def test_first_step_ratio_is_one_with_it_and_biased_without():
    """A vLLM rollout's old log-probs are its processed ones; at the first step the policy is
    the sampler, so the ratio is 1 on every token once the loss follows the sampler."""
    model = tiny_model("qwen3", seed=4)
    ex = train_example(model, seed=5)
    trunc = Truncation(top_k=20, top_p=0.9)
    sampler_logps, _, outside = truncated_logps(model, ex.prompt_ids, ex.completion_ids, trunc)
    ex = dataclasses.replace(ex, old_per_token_logps=sampler_logps)
    mask = np.asarray(ex.completion_mask, bool)
    share = float(np.asarray(outside)[mask].mean())  # random tokens: many outside the top 20
    assert 0 < share < 1

    def ratios(cfg):
        out = {}
        for name, loss in (("logits", ours.logits_policy_loss),
                           ("fused", ours.fused_policy_loss)):
            result = loss(model, ex, cfg, PAD, EOS, impl="xla")
            aux = result[1] if isinstance(result, tuple) else result.aux_metrics
            out[name] = (float(np.asarray(aux["is_ratio/max"])),
                         float(np.asarray(aux["is_ratio/min"])),
                         float(np.asarray(aux.get("grpo_kernels/outside_truncation", -1.0))))
        return out

    for hi, lo, outside_share in ratios(algo_config(*TUNIX_LIKE)).values():
        assert hi < 0.999 and outside_share == -1.0  # the whole row: every ratio below 1
    cfg = algo_config(*TUNIX_LIKE)
    assert ours.follow_sampler(cfg, cluster(top_k=20, top_p=0.9)) == trunc
    for name, (hi, lo, outside_share) in ratios(cfg).items():
        assert abs(hi - 1) <= 1e-5 and abs(lo - 1) <= 1e-5, name
        assert abs(outside_share - share) <= 1e-6, name
    # the patched pass (reference, old policy and tunix's own losses call it) agrees
    graphdef, state = nnx.split(model)
    got = common.compute_per_token_logps(graphdef, state, ex.prompt_ids, ex.completion_ids, PAD,
                                         EOS, temperature=TAU)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(sampler_logps)[mask],
                               rtol=1e-5, atol=1e-5)


def test_a_head_function_truncates_a_chunk_at_a_time():
    """A compute_final_logits head (MaxText's adapter), read a chunk of positions at a time:
    with the old log-probs the reference's truncated ones of its logits, the fused loss's
    ratio is 1 on every token, its outside share is the reference's, and the patched pass
    gives those log-probs (each chunk holds whole rows, so its floors are found there)."""
    model = AdapterModel(seed=1)
    ex = train_example(model, seed=2, ref=False)
    trunc = Truncation(top_k=20, top_p=0.9)
    sampler_logps, _, outside = truncated_logps(model, ex.prompt_ids, ex.completion_ids, trunc)
    ex = dataclasses.replace(ex, old_per_token_logps=sampler_logps)
    mask = np.asarray(ex.completion_mask, bool)
    share = float(np.asarray(outside)[mask].mean())
    assert 0 < share < 1
    cfg = algo_config(*TUNIX_LIKE)
    ours.follow_sampler(cfg, cluster(top_k=20, top_p=0.9))
    result = ours.fused_policy_loss(model, ex, cfg, PAD, EOS,
                                    options=LmHeadBlockSizes(chunk_tokens=8))
    aux = result[1] if isinstance(result, tuple) else result.aux_metrics
    for key in ("is_ratio/max", "is_ratio/min"):
        assert abs(float(np.asarray(aux[key])) - 1) <= 1e-5, key
    assert abs(float(np.asarray(aux["grpo_kernels/outside_truncation"])) - share) <= 1e-6
    graphdef, state = nnx.split(model)
    got = common.compute_per_token_logps(graphdef, state, ex.prompt_ids, ex.completion_ids, PAD,
                                         EOS, temperature=TAU)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(sampler_logps)[mask],
                               rtol=1e-5, atol=1e-5)
