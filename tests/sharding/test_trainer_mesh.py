"""The trainer with a mesh: rows over dp, the fused head's vocabulary over tp (or whole rows on
each device, under the sampler's truncation); step 1 equals the one-device run (identical
rollouts, so the loss and grad norm agree), with the xla and the pallas implementations."""

import numpy as np
import pytest

from grpo_kernels.rl.config import TrainConfig
from grpo_kernels.ops.lm_head_loss import LmHeadPallasBlockSizes, LmHeadPallasOptions
from grpo_kernels.ops.logits_loss import PallasOptions
from grpo_kernels.rl.trainer import Trainer
from tests.rl.test_trainer import _values, _varied_reward  # noqa: F401  (fixture)


def test_mesh_step_under_truncation_equals_one_device(tmp_path):
    """Sampling under ``top_k`` / ``top_p``, the fused xla loss and log-prob passes take the
    truncation on a mesh that keeps rows whole (dp splits them; tp, unnamed, replicates)."""
    import jax

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    loss = {"head": "fused", "impl": "xla"}
    rollout = {"top_k": 20, "top_p": 0.9}
    mesh = {"shape": {"dp": 2, "tp": 2}, "batch_axes": ["dp"]}
    base = _values(tmp_path / "one", train={"steps": 1}, loss=loss, rollout=rollout)
    one = Trainer(TrainConfig.from_dict(base), progress=False).run()[0]
    sharded = _values(tmp_path / "mesh", train={"steps": 1}, loss=loss, rollout=rollout)
    sharded["mesh"] = mesh
    config = TrainConfig.from_dict(sharded)
    assert (config.loss_config().top_k, config.loss_config().top_p) == (20, 0.9)
    got = Trainer(config, progress=False).run()[0]
    assert got["reward/mean"] == one["reward/mean"]
    for key, rtol in (("loss", 1e-4), ("grad_norm", 1e-3), ("entropy", 1e-4),
                      ("sampler_ratio", 1e-5), ("outside_truncation", 0)):
        np.testing.assert_allclose(got[key], one[key], rtol=rtol, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("head,mesh", [
    ("logits", {"shape": {"dp": 4}, "batch_axes": ["dp"]}),  # the one-pass kernel per device
    ("fused", {"shape": {"dp": 2, "tp": 2}, "batch_axes": ["dp"], "vocab_axis": "tp"}),
])
def test_mesh_step_with_pallas_equals_one_device_xla(tmp_path, head, mesh):
    """``loss.impl: pallas`` on a mesh (the kernels interpreted on this CPU, as on one), with
    ``loss.kernel`` options handed through, against the one-device xla run's step."""
    import jax

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    rows = {"rollout": {"batch_size": 8, "num_generations": 2, "max_new_tokens": 6},
            "train": {"steps": 1, "micro_batch_size": 4}}
    base = _values(tmp_path / "one", loss={"head": head, "impl": "xla"}, **rows)
    one = Trainer(TrainConfig.from_dict(base), progress=False).run()[0]
    kernel = {"logits-pallas": {"one_pass": True}} if head == "logits" else \
        {"fused-pallas": {"blocks": {"block_rows": 16}}}
    sharded = _values(tmp_path / "mesh", loss={"head": head, "impl": "pallas", "kernel": kernel},
                      **rows)
    sharded["mesh"] = mesh
    trainer = Trainer(TrainConfig.from_dict(sharded), progress=False)
    want = PallasOptions(one_pass=True, alias_logits=True) if head == "logits" else \
        LmHeadPallasOptions(blocks=LmHeadPallasBlockSizes(block_rows=16))
    assert trainer.loss_options == want  # the entry, over the trainer's defaults
    got = trainer.run()[0]
    assert got["reward/mean"] == one["reward/mean"]
    np.testing.assert_allclose(got["loss"], one["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["grad_norm"], one["grad_norm"], rtol=1e-3)
    np.testing.assert_allclose(got["entropy"], one["entropy"], rtol=1e-4)
