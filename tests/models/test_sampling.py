"""generate(): greedy equals step-by-step argmax of the full forward; log-probs; stopping; shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_kernels import token_logps
from grpo_kernels.models import ModelConfig
from grpo_kernels.models.decoder import Decoder
from grpo_kernels.models.sampling import TRACES, generate

CFG = ModelConfig(family="qwen2", vocab_size=61, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True,
                  compute_dtype=jnp.float32)
PROMPTS = [[5, 9, 2, 33], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model():
    m = Decoder(CFG, nnx.Rngs(3))
    # larger random weights than the init, so the argmax is decisive and varies
    state = nnx.state(m)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    nnx.update(m, jax.tree.unflatten(tree, leaves))
    return m


@nnx.jit
def _forward(model, ids):
    return model(ids)[0]


def full_forward_greedy(model, prompt, steps):
    """Step-by-step argmax of the full forward. The sequence is right-padded to one fixed length
    (one compiled forward); causal attention keeps the padding out of the real positions."""
    cur = list(prompt)
    logps = []
    width = len(prompt) + steps
    for _ in range(steps):
        logits = _forward(model, jnp.asarray([cur + [0] * (width - len(cur))]))[len(cur) - 1]
        tok = int(jnp.argmax(logits))
        logps.append(float(jax.nn.log_softmax(logits)[tok]))
        cur.append(tok)
    return cur[len(prompt):], logps


def test_greedy_equals_full_forward_argmax(model):
    out = generate(model, PROMPTS, max_new_tokens=12, temperature=0.0, eos_ids=[60])
    assert out.ids.shape == (3, 12) and out.prompt_ids.shape == (3, 64)
    for i, p in enumerate(PROMPTS):
        want, want_logps = full_forward_greedy(model, p, 12)
        n = int(out.mask[i].sum())
        assert list(out.ids[i, :n]) == want[:n]
        np.testing.assert_allclose(out.logps[i, :n], want_logps[:n], atol=1e-4)
        if n < 12:  # stopped at the end token
            assert out.ids[i, n - 1] == 60 and (out.ids[i, n:] == 0).all()


def test_sampled_logps_are_those_of_the_truncated_distribution(model):
    """The sampler's log-probs under min-p, top-k and top-p are the log-prob op's with the same
    options (the distribution the tokens were drawn from), below the untruncated ones."""
    out = generate(model, PROMPTS[:2], num_generations=3, max_new_tokens=6, temperature=0.7,
                   top_k=20, top_p=0.9, min_p=0.01, eos_ids=[60], seed=4)
    assert out.ids.shape == (6, 6)
    for r in range(6):
        prompt = PROMPTS[r // 3]
        n = int(out.mask[r].sum())
        seq = list(prompt) + list(out.ids[r, :n])
        logits = model(jnp.asarray([seq]))[:, len(prompt) - 1:len(seq) - 1]
        ids = jnp.asarray([seq[len(prompt):]])
        want, outside = token_logps(logits, ids, temperature=0.7, top_k=20, top_p=0.9,
                                    min_p=0.01, impl="reference", return_outside=True)
        np.testing.assert_allclose(out.logps[r, :n], want[0], atol=1e-4)
        assert not bool(outside.any())  # every drawn token is in the kept set
        plain = token_logps(logits, ids, temperature=0.7, impl="reference")
        assert bool(jnp.all(want >= plain - 1e-6))
    # generations of one prompt differ (sampling), same seed reproduces
    again = generate(model, PROMPTS[:2], num_generations=3, max_new_tokens=6, temperature=0.7,
                     top_k=20, top_p=0.9, eos_ids=[60], seed=4)
    np.testing.assert_array_equal(again.ids, out.ids)
    assert len({tuple(out.ids[r]) for r in range(3)}) > 1


def test_top_k_one_is_greedy(model):
    a = generate(model, PROMPTS, max_new_tokens=5, temperature=1.3, top_k=1, eos_ids=[60])
    b = generate(model, PROMPTS, max_new_tokens=5, temperature=0.0, eos_ids=[60])
    np.testing.assert_array_equal(a.ids, b.ids)


def test_stops_when_every_row_ended_and_no_recompile_within_a_bucket(model):
    first = generate(model, [PROMPTS[0]], max_new_tokens=8, temperature=0.0, eos_ids=[60])
    tok = int(first.ids[0, 0])  # make the first greedy token the end token
    out = generate(model, [PROMPTS[0]], max_new_tokens=8, temperature=0.0, eos_ids=[tok])
    assert out.mask[0].tolist() == [1] + [0] * 7
    before = TRACES["count"]
    generate(model, [[3, 4, 5, 6, 7, 8, 9]], max_new_tokens=8, temperature=0.0, eos_ids=[tok])
    assert TRACES["count"] == before  # another prompt length in the same bucket: no retrace


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="prompts must be"):
        generate(model, [], max_new_tokens=4, eos_ids=[1])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        generate(model, PROMPTS, max_new_tokens=0, eos_ids=[1])
    with pytest.raises(ValueError, match="top_p must be"):
        generate(model, PROMPTS, max_new_tokens=2, top_p=1.5, eos_ids=[1])
    with pytest.raises(ValueError, match="eos_ids"):
        generate(model, PROMPTS, max_new_tokens=2, eos_ids=[])
    context = model.config.max_position_embeddings
    longest = max(len(p) for p in PROMPTS)
    with pytest.raises(ValueError, match=f"max_new_tokens={context} after a prompt of "
                       f"{longest} tokens .* max_position_embeddings is {context}"):
        generate(model, PROMPTS, max_new_tokens=context, eos_ids=[1])
