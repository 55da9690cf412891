"""Bad input: a ValueError naming the argument and the expected shape/value, at trace time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import GRPOLossConfig, grpo_loss
from grpo_kernels.ops.logits_loss import default_impl

B, T, V = 2, 5, 11
CFG = GRPOLossConfig()


def good(**over):
    args = dict(
        logits=jnp.asarray(np.random.default_rng(0).normal(size=(B, T, V)), jnp.float32),
        ids=jnp.zeros((B, T), jnp.int32) + 3, mask=jnp.ones((B, T), jnp.float32),
        advantages=jnp.ones((B,), jnp.float32),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, fragment",
    [
        (dict(logits=jnp.ones((B, V))), r"logits must have rank 3 \[B, T, V\], got shape \(2, 11\)"),
        (dict(logits=jnp.ones((B, T, V), jnp.int32)), "logits must be a floating dtype"),
        (dict(ids=jnp.zeros((B, T + 1), jnp.int32)), r"ids must have shape \[B, T\] = \(2, 5\), got \(2, 6\)"),
        (dict(ids=jnp.zeros((B, T), jnp.float32)), "ids must be an integer dtype"),
        (dict(mask=jnp.ones((B,))), r"mask must have shape \[B, T\] = \(2, 5\)"),
        (dict(advantages=jnp.ones((B, T + 1))), r"advantages must have shape \[B\] \(or \[B, T\], one per token\) = \(2,\)"),
        (dict(old_logps=jnp.ones((B, T + 2))), r"old_logps must have shape \[B, T\]"),
        (dict(ref_logps=jnp.ones((T,))), r"ref_logps must have shape \[B, T\]"),
        (dict(config=GRPOLossConfig(beta=0.1)), r"ref_logps \[B, T\] = \(2, 5\) is required when config.beta > 0"),
        (dict(config={"beta": 0.1}), "config must be a GRPOLossConfig"),
        (dict(impl="triton"), "impl must be one of"),
        (dict(logits=[[[1.0]]]), "logits must be an array"),
        (dict(logits=jnp.ones((B, 0, V))), "logits must have B, T, V >= 1"),
        (dict(config=GRPOLossConfig(sampler_correction="token_mask")),
         r"sampler_logps \[B, T\] = \(2, 5\) is required when config.sampler_correction"),
        (dict(sampler_logps=jnp.ones((B, T + 1))), r"sampler_logps must have shape \[B, T\]"),
        (dict(sampler_weights=jnp.ones((B,))), r"sampler_weights must have shape \[B, T\]"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(over, fragment):
    args = good()
    config = over.pop("config", CFG)
    impl = over.pop("impl", "auto")
    args.update(over)
    with pytest.raises(ValueError, match=fragment):
        grpo_loss(**args, config=config, impl=impl)


def test_errors_are_raised_at_trace_time_under_jit():
    args = good(ids=jnp.zeros((B, T + 1), jnp.int32))
    with pytest.raises(ValueError, match="ids must have shape"):
        jax.jit(lambda z: grpo_loss(z, args["ids"], args["mask"], args["advantages"],
                                    config=CFG)[0]).lower(args["logits"])


def test_ids_out_of_range_are_clamped_by_default():
    args = good(ids=jnp.full((B, T), V + 5, jnp.int32))
    clamped = good(ids=jnp.full((B, T), V - 1, jnp.int32))
    for impl in ("reference", "xla"):
        a = grpo_loss(**args, config=CFG, impl=impl)[1]["logp"]
        b = grpo_loss(**clamped, config=CFG, impl=impl)[1]["logp"]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checked_mode_raises_for_unmasked_out_of_range_ids():
    ids = jnp.zeros((B, T), jnp.int32).at[1, 2].set(V)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 11\) where mask != 0; ids\[1, 2\] = 11"):
        grpo_loss(**good(ids=ids), config=CFG, check_ids=True)
    # Masked-out positions (padding such as -100) are not checked.
    mask = jnp.ones((B, T), jnp.float32).at[1, 2].set(0)
    loss, _ = grpo_loss(**good(ids=ids.at[1, 2].set(-100), mask=mask), config=CFG, check_ids=True)
    assert np.isfinite(float(loss))


def test_checked_mode_raises_under_jit_at_run_time():
    args = good(ids=jnp.zeros((B, T), jnp.int32).at[0, 0].set(-1))
    f = jax.jit(lambda z, i: grpo_loss(z, i, args["mask"], args["advantages"], config=CFG,
                                       check_ids=True)[0])
    with pytest.raises(Exception, match=r"ids must lie in \[0, 11\)"):
        jax.block_until_ready(f(args["logits"], args["ids"]))


def test_auto_resolves_to_an_implementation():
    assert default_impl() == "xla"  # this suite runs on the CPU
    assert default_impl("cpu") == default_impl("tpu") == "xla"  # nothing measured on TPU
    assert default_impl("gpu") == default_impl("cuda") == "pallas"  # measured on an H100
    loss_auto = grpo_loss(**good(), config=CFG)[0]
    loss_xla = grpo_loss(**good(), config=CFG, impl="xla")[0]
    assert float(loss_auto) == float(loss_xla)


def test_block_sizes_match_the_impl():
    from grpo_kernels import PallasOptions, XlaBlockSizes

    for impl, blocks in (("reference", XlaBlockSizes()), ("pallas", XlaBlockSizes()),
                         ("xla", PallasOptions())):
        with pytest.raises(ValueError, match="options must be XlaBlockSizes for impl='xla'"):
            grpo_loss(**good(), config=CFG, impl=impl, options=blocks)
    with pytest.raises(ValueError, match="XlaBlockSizes.chunk_tokens must be None or an int >= 1"):
        XlaBlockSizes(chunk_tokens=0)
