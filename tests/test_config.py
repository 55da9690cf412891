import dataclasses

import pytest

from grpo_kernels import GRPOLossConfig


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"loss_type": "ppo"}, "loss_type must be one of"),
        ({"importance_sampling_level": "seq"}, "importance_sampling_level must be one of"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"temperature": -1.0}, "temperature must be > 0"),
        ({"epsilon_low": -0.1}, "epsilon_low must be >= 0"),
        ({"epsilon_high": -0.1}, "epsilon_high must be >= 0"),
        ({"epsilon_low": 1.0}, "epsilon_low must be < 1"),
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"delta": 0.0}, "delta must be None or a finite number > 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"beta": "0.1"}, "beta must be a finite number"),
        ({"loss_type": "dr_grpo"}, "needs max_completion_length"),
        ({"loss_type": "dr_grpo", "max_completion_length": 0}, "max_completion_length must be"),
    ],
)
def test_bad_config_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        GRPOLossConfig(**kwargs)


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match=r"unknown GRPOLossConfig key\(s\) \['epsilon'\]"):
        GRPOLossConfig.from_dict({"epsilon": 0.2})


def test_round_trip_and_frozen():
    cfg = GRPOLossConfig(loss_type="dapo", epsilon_high=0.28, delta=2.0, beta=0.04)
    assert GRPOLossConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.beta = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_type="ppo"), "loss_type must be one of"),
    (dict(sampler_correction="tis"), "sampler_correction must be None or one of"),
    (dict(sampler_correction="token_mask", sampler_correction_min=2.0,
          sampler_correction_max=1.0), "sampler_correction_min must be < sampler_correction_max"),
    (dict(sampler_correction="token_truncate", sampler_correction_max=None),
     "needs sampler_correction_min or sampler_correction_max"),
    (dict(loss_type="vespo", sampler_correction="sequence_truncate"),
     "sampler_correction must be None, 'token_truncate' or 'token_mask'"),
    (dict(loss_type="sapo", sapo_temperature_pos=0.0), "sapo_temperature_pos must be > 0"),
    (dict(loss_type="sapo", sapo_temperature_neg=-1.0), "sapo_temperature_neg must be > 0"),
    (dict(entropy_coef=float("nan")), "entropy_coef must be a finite number"),
    (dict(vespo_k_pos=float("nan")), "vespo_k_pos must be a finite number"),
    (dict(vespo_lambda_neg=0.0), "vespo_lambda_neg must be > 0"),
    (dict(off_policy_mask_threshold=float("nan")), "off_policy_mask_threshold must be None"),
    (dict(sampler_correction_max=float("inf")), "sampler_correction_max must be None"),
    (dict(kl_estimator="k4"), "kl_estimator must be one of"),
    (dict(kl_bias_correction=1), "kl_bias_correction must be True or False"),
    (dict(top_entropy_quantile=0.0), r"top_entropy_quantile must be a number in \(0, 1\]"),
    (dict(top_entropy_quantile=1.5), r"top_entropy_quantile must be a number in \(0, 1\]"),
    (dict(top_entropy_quantile=float("nan")), "top_entropy_quantile"),
    (dict(loss_type="cispo", delta=2.0), "delta applies to the clipped loss types"),
    (dict(loss_type="sapo", dual_clip=2.0), "dual_clip applies to the clipped loss types"),
])
def test_family_options_reject_bad_values_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLossConfig(**kwargs)


def test_family_defaults_are_trls():
    cfg = GRPOLossConfig()
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) == (1.0, 1.05)
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (
        2.0, 3.0, 3.0, 2.0)
    assert cfg.sampler_correction is None and cfg.sampler_correction_max == 3.0
    assert cfg.entropy_coef == 0.0 and cfg.top_entropy_quantile == 1.0
    assert not cfg.kl_bias_correction and cfg.off_policy_mask_threshold is None
