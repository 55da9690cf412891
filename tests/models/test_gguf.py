"""GGUF loading: a llama.cpp-style file written here from a tiny transformers model, and SmolLM2."""

import numpy as np
import pytest

import jax.numpy as jnp

gguf = pytest.importorskip("gguf", reason="the gguf package reads and writes GGUF files")
torch = pytest.importorskip("torch", reason="torch (dev extra) makes the reference model")
transformers = pytest.importorskip("transformers", reason="transformers (dev extra)")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from grpo_kernels.models.gguf_loader import (gguf_metadata, load_gguf,  # noqa: E402
                                             smollm2_path, tokenizer_from_gguf, unpermute_rows)
from tests.models.kquants import quantize_q4_k, quantize_q6_k  # noqa: E402
from tests.models.test_hf import IDS, SMALL, hf_logits  # noqa: E402

K_QUANTS = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}


def llama_cpp_permute(w, heads):
    """What llama.cpp's converter does to q/k rows (written from its description, for tests)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_the_converter():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, model, qtype=None, dequantised=None):
    """A llama.cpp-layout GGUF of a transformers Llama: names, q/k permutation, optional quant.
    For Q4_K / Q6_K, ``dequantised`` (a dict) receives the values each tensor holds."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    for name, p in model.state_dict().items():
        x = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, i, *rest = name.split(".")
            key = ".".join(rest[:-1])
            out = f"blk.{i}.{_NAMES[key]}.{rest[-1]}"
            if key in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in key else cfg.num_key_value_heads
                x = llama_cpp_permute(x, heads)
        if qtype in K_QUANTS and x.ndim == 2:
            raw, meant = K_QUANTS[qtype](x)
            w.add_tensor(out, raw, raw_dtype=qtype)
            if dequantised is not None:  # what the file holds, in transformers' layout
                dequantised[name] = (unpermute_rows(meant, heads) if "_proj" in name and
                                     name.split(".")[-2] in ("q_proj", "k_proj") else meant)
        elif qtype is not None and x.ndim == 2:
            w.add_tensor(out, quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype,tol", [(None, 1e-4), (Q.Q8_0, 0.05), (Q.Q4_1, 0.5),
                                       (Q.Q4_0, 0.5)], ids=["f32", "q8_0", "q4_1", "q4_0"])
def test_gguf_of_a_transformers_llama_gives_its_logits(tmp_path, qtype, tol):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**SMALL, "hidden_size": 64, "intermediate_size": 256,
                                      "vocab_size": 128}, tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, ref, qtype)
    config, model = load_gguf(str(path), compute_dtype=jnp.float32)
    assert config.family == "llama" and not config.tie_word_embeddings
    ids = IDS % 128
    err = np.max(np.abs(np.asarray(model(jnp.asarray(ids))) - hf_logits(ref, ids)))
    assert err <= tol, err


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=["q4_k", "q6_k"])
def test_k_quant_writer_round_trips_through_the_gguf_reader(qtype):
    """The test's Q4_K / Q6_K blocks dequantise, by the `gguf` package the loader uses, to
    exactly the values the writer meant: the packing is right, so files made with it are
    valid ones."""
    x = np.random.default_rng(3).normal(size=(3, 512)).astype(np.float32)
    x[1, :256] = np.abs(x[1, :256])  # a super-block without negatives (min 0)
    x[2, 256:] = 0.0                 # and an all-zero one
    raw, meant = K_QUANTS[qtype](x)
    back = gguf.quants.dequantize(raw, qtype)
    assert back.shape == x.shape
    np.testing.assert_array_equal(back, meant)
    assert np.max(np.abs(meant - x)) <= (0.15 if qtype == Q.Q4_K else 0.05) * np.max(np.abs(x))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K], ids=["q6_k", "q4_k"])
def test_k_quant_gguf_gives_the_logits(tmp_path, qtype):
    """A file of Q4_K / Q6_K tensors (rows of 256: hidden 256 here) gives the logits of the
    transformers model holding the very values the file encodes (float32, 1e-4), and stays
    near the unquantised model's."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**{**SMALL, "hidden_size": 256, "intermediate_size": 512,
                                      "vocab_size": 128}, tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    path, held = tmp_path / "tiny.gguf", {}
    write_gguf(path, ref, qtype, dequantised=held)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == qtype and types["blk.0.ffn_down.weight"] == qtype
    _, model = load_gguf(str(path), compute_dtype=jnp.float32)
    ids = IDS % 128
    ours = np.asarray(model(jnp.asarray(ids)))
    unquantised = hf_logits(ref, ids)
    state = ref.state_dict()
    ref.load_state_dict({k: torch.from_numpy(held[k]) if k in held else v
                         for k, v in state.items()})
    assert len(held) == 2 + 7 * cfg.num_hidden_layers  # every matrix was K-quantised
    assert np.max(np.abs(ours - hf_logits(ref, ids))) <= 1e-4
    assert np.max(np.abs(ours - unquantised)) <= (0.1 if qtype == Q.Q6_K else 0.5)


def test_bad_gguf_files(tmp_path):
    with pytest.raises(ValueError, match="no such GGUF file"):
        load_gguf(str(tmp_path / "none.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "gpt.gguf"), arch="gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unknown architecture 'gpt2'"):
        load_gguf(str(tmp_path / "gpt.gguf"))


def _write_metadata(path, template):
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("tokenizer.chat_template", template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_metadata_of_a_rewritten_file_is_read_again(tmp_path):
    # The parsed file is shared between readers (parsing costs seconds); a rewrite must not be
    # served from it.
    path = tmp_path / "m.gguf"
    _write_metadata(path, "first")
    assert gguf_metadata(str(path), "tokenizer.chat_template") == "first"
    _write_metadata(path, "second, longer")
    assert gguf_metadata(str(path), "tokenizer.chat_template") == "second, longer"
    assert gguf_metadata(str(path), "no.such.key", "default") == "default"


def _smollm2():
    try:
        return smollm2_path()
    except ValueError as e:
        pytest.skip(f"{e} (make test installs it)")


PARAGRAPH = ("The history of science is the study of the development of science and scientific "
             "knowledge, including both the natural and social sciences. Science is a body of "
             "empirical, theoretical, and practical knowledge about the natural world, produced "
             "by scientists who emphasize the observation, explanation, and prediction of "
             "real-world phenomena.")


def test_smollm2_perplexity_greedy_and_tokenizer():
    import jax
    from flax import nnx

    path = _smollm2()
    config, model = load_gguf(path)  # f32 params, bf16 compute
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    tok = tokenizer_from_gguf(path)
    text = "Digits 12345, and <|im_start|>user\nHi<|im_end|>"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids.count(1) == 1  # <|im_start|> is one special token
    forward = nnx.jit(lambda m, x: m(x))
    ids = tok.encode(PARAGRAPH).ids
    width = len(ids)

    def logits(tokens: list[int]) -> jax.Array:
        """Logits at the positions of ``tokens``, right-padded to one width so the model
        compiles once: a causal model's earlier positions never see the padding."""
        return forward(model, jnp.asarray([tokens + [0] * (width - len(tokens))]))[0]

    logp = jax.nn.log_softmax(logits(ids)[:-1], axis=-1)
    ppl = float(jnp.exp(-jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids)[1:, None],
                                                       axis=-1))))
    assert ppl < 30, ppl
    cur = tok.encode("The capital of France is").ids
    for _ in range(4):  # greedy by full forward; the KV-cache sampler is the next step
        cur.append(int(jnp.argmax(logits(cur)[len(cur) - 1])))
    assert "Paris" in tok.decode(cur)
