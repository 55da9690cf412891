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
