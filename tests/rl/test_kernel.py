"""``loss.kernel``: per-arm options built into the ops' option dataclasses, ``impl: auto``
taking its resolved implementation's entry, and the options reaching the kernels."""

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.lm_head_loss import LmHeadBlockSizes, LmHeadPallasBlockSizes, \
    LmHeadPallasOptions
from grpo_kernels.ops.logits_loss import PallasBlockSizes, PallasOptions, XlaBlockSizes
from grpo_kernels.rl import kernel
from grpo_kernels.rl.config import TrainConfig
from grpo_kernels.rl.policy import make_programs
from tests.rl.test_policy import P, _batch, _model

KERNEL = {"logits-pallas": {"alias_logits": True, "gpu_layout": "aligned",
                            "blocks": {"block_vocab": 8192, "gpu_stages": 3}},
          "logits-xla": {"chunk_bytes": 1 << 20},
          "fused-xla": {"dweight": "vocab"},
          "fused-pallas": {"interpret": "hlo", "blocks": {"block_rows": 32}}}


def test_every_entry_builds_its_dataclass():
    config = TrainConfig.from_dict({"loss": {"kernel": KERNEL}})
    assert config.loss.kernel == KERNEL  # the YAML's mapping is kept, for the run dir's copy
    assert TrainConfig.from_dict(config.to_dict()) == config
    want = {
        ("logits", "pallas"): PallasOptions(alias_logits=True, gpu_layout="aligned",
                                            blocks=PallasBlockSizes(block_vocab=8192,
                                                                    gpu_stages=3)),
        ("logits", "xla"): XlaBlockSizes(chunk_bytes=1 << 20),
        ("fused", "xla"): LmHeadBlockSizes(dweight="vocab"),
        ("fused", "pallas"): LmHeadPallasOptions(interpret="hlo",
                                                 blocks=LmHeadPallasBlockSizes(block_rows=32)),
    }
    for (head, impl), options in want.items():
        assert kernel.resolve(head, impl, config.loss.kernel) == (impl, options)


def test_reference_and_missing_entries_have_no_options():
    assert kernel.resolve("logits", "reference", KERNEL) == ("reference", None)
    assert kernel.resolve("fused", "pallas", {}) == ("pallas", None)
    assert kernel.resolve("logits", "xla", {}) == ("xla", None)


def test_the_trainers_defaults_sit_under_the_entry():
    """The trainer's logits are dead after the loss: pallas writes dlogits over them unless
    the entry says otherwise; the entry's other fields keep the default."""
    assert kernel.resolve("logits", "pallas", {}) == ("pallas", PallasOptions(alias_logits=True))
    given = {"logits-pallas": {"gpu_layout": "aligned"}}
    assert kernel.resolve("logits", "pallas", given)[1] == PallasOptions(
        alias_logits=True, gpu_layout="aligned")
    off = {"logits-pallas": {"alias_logits": False}}
    assert kernel.resolve("logits", "pallas", off)[1] == PallasOptions()


@pytest.mark.parametrize("head", ["logits", "fused"])
def test_auto_takes_the_entry_of_the_implementation_it_resolves_to(head):
    impl, options = kernel.resolve(head, "auto", KERNEL)
    assert impl == "xla"  # this CPU's measured default for both ops
    assert options == kernel.build_options("loss.kernel", f"{head}-xla", KERNEL[f"{head}-xla"])


def test_the_options_reach_the_kernel():
    """A trainer program handed PallasOptions(one_pass=True) with a sequence-level config:
    the Pallas op itself refuses it, naming the option (without the options it runs)."""
    graphdef, state = nnx.split(_model())
    config = GRPOLossConfig(importance_sampling_level="sequence")
    mb = {k: None if v is None else jax.numpy.asarray(v)
          for k, v in _batch(rows=2, seed=4).micro(0, 2).items()}
    args = (state, mb, np.float32(1.0), np.float32(mb["mask"].sum()))
    grad_fn, _ = make_programs(graphdef, head="logits", impl="pallas", config=config,
                               prompt_width=P, options=PallasOptions(one_pass=True))
    with pytest.raises(ValueError, match="one_pass=True needs a token-separable config"):
        jax.eval_shape(grad_fn, *args)
    plain, _ = make_programs(graphdef, head="logits", impl="pallas", config=config,
                             prompt_width=P)
    (loss, _), _ = jax.eval_shape(plain, *args)
    assert loss.shape == ()


def test_the_fused_pallas_arm_on_a_gpu_fails_before_a_model_loads(monkeypatch):
    from grpo_kernels.ops.lm_head_loss import pallas_options

    monkeypatch.setattr(pallas_options, "backend_kind", lambda backend=None: "gpu")
    with pytest.raises(ValueError, match="^loss.impl: impl='pallas' of the fused head has TPU "
                                         "kernels only"):
        kernel.resolve("fused", "pallas", {})
    interpreted = {"fused-pallas": {"interpret": True}}
    assert kernel.resolve("fused", "pallas", interpreted)[1] == LmHeadPallasOptions(
        interpret=True)
