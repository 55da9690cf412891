r"""The Qwen2 / Llama decoder in Flax NNX.

Per layer, with :math:`\mathrm{RMS}(x) = x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \odot w`:

.. math::

    h &= x + W_o\,\mathrm{Attn}(\mathrm{RoPE}(W_q u + b_q), \mathrm{RoPE}(W_k u + b_k),
         W_v u + b_v), \quad u = \mathrm{RMS}(x) \\
    x' &= h + W_d\,(\mathrm{silu}(W_g v) \odot W_u v), \quad v = \mathrm{RMS}(h)

Attention is causal, grouped-query (each key/value head serves ``num_heads / num_kv_heads``
query heads), scaled by :math:`1/\sqrt{d}`, softmax in float32, with padded positions masked.
RoPE rotates pairs ``(i, i + d/2)`` by angle ``p \theta_i`` (the Hugging Face layout), with
``linear`` and ``llama3`` frequency scaling. Projections are stored ``[in, out]``; the embedding
and an untied LM head ``[V, H]`` (so the head is ``lm_head_layout="vh"`` for the fused loss).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_kernels.models.config import ModelConfig

Array = jax.Array
_F32 = jnp.float32


def rope_frequencies(config: ModelConfig) -> Array:
    """Inverse frequencies ``[head_dim / 2]`` with the config's scaling applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=_F32) / d))
    scaling = config.rope_scaling or {}
    kind = config.rope_type
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # long wavelengths (beyond old/low) are slowed by `factor`, short ones (below old/high)
        # kept, and the band between interpolated smoothly in old/wavelen.
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        return jnp.where(wavelen > old / low, inv / factor,
                         jnp.where(wavelen < old / high, inv, mid))
    return inv


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotates ``x [B, T, heads, d]`` at integer ``positions [B, T]`` (float32 math)."""
    angles = positions.astype(_F32)[..., None] * inv_freq[None, None, :]  # [B, T, d/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(_F32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def linear(x: Array, w: Array, dtype: Any) -> Array:
    r"""``x @ w``, operands in ``dtype``, accumulated in float32, rounded once to ``dtype``.

    For bfloat16 this is the rounding of a bfloat16-output dot, but XLA:CPU runs a
    float32-output dot of bfloat16 operands on its fast matmul path and a bfloat16-output one on
    a slow path (docs/benchmarks.md, "Sampling throughput on a CPU", has the figures and the
    probe). The
    gradient is written out for the same reason:

    .. math::

        \partial x = g\, w^\top, \qquad \partial w = x^\top g \quad (\text{float32, cast
        once to } w\text{'s own dtype})

    both as plain ``[M, K] x [K, N]`` products of materialised transposes in ``dtype`` (the
    form XLA:CPU hands to its fast library; ``x^T g`` written as a contraction over the rows
    of both ran several times slower). ``w`` enters in its stored dtype, so float32 parameters get a
    float32 gradient rather than one rounded to ``dtype``.
    """
    return _linear(x.astype(dtype), w, jnp.dtype(dtype))


def _mm(a: Array, b: Array, dtype: Any) -> Array:
    return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear(x: Array, w: Array, dtype: Any) -> Array:
    return _mm(x, w, dtype).astype(dtype)


def _linear_fwd(x, w, dtype):
    return _linear(x, w, dtype), (x, w)


def _linear_bwd(dtype, res, g):
    x, w = res
    barrier = jax.lax.optimization_barrier
    dx = _mm(g, barrier(w.astype(dtype).T), dtype).astype(x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    dw = _mm(barrier(rows.T), g.reshape(-1, g.shape[-1]), dtype)
    return dx, dw.astype(w.dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(_F32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(_F32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (w * xf.astype(x.dtype).astype(_F32)).astype(x.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any, std: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, _F32) * std).astype(dtype))


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, pd = config, config.param_dtype
        self.config = c
        self.q = _param(rngs, (c.hidden_size, c.num_heads * c.head_dim), pd)
        self.k = _param(rngs, (c.hidden_size, c.num_kv_heads * c.head_dim), pd)
        self.v = _param(rngs, (c.hidden_size, c.num_kv_heads * c.head_dim), pd)
        self.o = _param(rngs, (c.num_heads * c.head_dim, c.hidden_size), pd)
        if c.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((c.num_heads * c.head_dim,), pd))
            self.k_bias = nnx.Param(jnp.zeros((c.num_kv_heads * c.head_dim,), pd))
            self.v_bias = nnx.Param(jnp.zeros((c.num_kv_heads * c.head_dim,), pd))

    def _proj(self, x: Array, name: str, heads: int) -> Array:
        dt = self.config.compute_dtype
        y = linear(x, getattr(self, name)[...], dt)
        if self.config.attention_bias:
            y = y + getattr(self, name + "_bias")[...].astype(dt)[None, None, :]
        return y.reshape(*x.shape[:2], heads, self.config.head_dim)

    def __call__(self, x: Array, positions: Array, mask: Array, inv_freq: Array,
                 cache: tuple[Array, Array] | None = None, index: Any = None) -> Any:
        """Attention output; with ``cache = (k, v)`` (``[B, Hk, S, d]``) this call's keys and
        values are written at slot ``index`` first and ``(output, new cache)`` is returned."""
        c = self.config
        q = apply_rope(self._proj(x, "q", c.num_heads), positions, inv_freq)
        # keys and values head-major, [B, Hk, T, d]: the layout attend() multiplies in
        k = apply_rope(self._proj(x, "k", c.num_kv_heads), positions, inv_freq)
        k, v = k.transpose(0, 2, 1, 3), self._proj(x, "v", c.num_kv_heads).transpose(0, 2, 1, 3)
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), index, 2)
            v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), index, 2)
        out = attend(q, k.astype(q.dtype), v.astype(q.dtype), mask)
        out = linear(out.reshape(*x.shape[:2], -1), self.o[...], c.compute_dtype)
        return out if cache is None else (out, (k, v))


def attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Grouped-query attention: ``q [B, T, Hq, d]``, ``k, v [B, Hk, S, d]``, ``mask [B, T, S]``
    (True = may attend). Softmax in float32; a row with nothing to attend gives zeros.

    Keys and values are head-major so that both products are batched over ``(B, Hk)`` with no
    copy of ``k`` or ``v``: in a decode step they are the whole cache, and with the cache
    ``[B, S, Hk, d]`` XLA:CPU transposed it every step (twice the attention time of the
    SmolLM2 decode step, docs/benchmarks.md).
    """
    b, t, hq, d = q.shape
    hk = k.shape[1]
    q = q.reshape(b, t, hk, hq // hk, d).transpose(0, 2, 3, 1, 4)  # [B, Hk, G, T, d]
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=_F32) / math.sqrt(d)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(mask[:, None, None], weights, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", weights, v, preferred_element_type=_F32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(v.dtype)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, pd = config, config.param_dtype
        self.dtype = c.compute_dtype
        self.gate = _param(rngs, (c.hidden_size, c.intermediate_size), pd)
        self.up = _param(rngs, (c.hidden_size, c.intermediate_size), pd)
        self.down = _param(rngs, (c.intermediate_size, c.hidden_size), pd)

    def __call__(self, x: Array) -> Array:
        dt = self.dtype
        return linear(jax.nn.silu(linear(x, self.gate[...], dt)) * linear(x, self.up[...], dt),
                      self.down[...], dt)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.param_dtype)
        self.attn = Attention(config, rngs)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.param_dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x: Array, positions: Array, mask: Array, inv_freq: Array,
                 cache: tuple[Array, Array] | None = None, index: Any = None) -> Any:
        a = self.attn(self.input_norm(x), positions, mask, inv_freq, cache, index)
        a, cache = a if cache is not None else (a, None)
        h = x + a
        out = h + self.mlp(self.post_norm(h))
        return out if cache is None else (out, cache)


def positions_from_mask(attention_mask: Array) -> Array:
    """Positions ``[B, T]`` of left- or right-padded rows: 0 at each row's first real token."""
    m = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


class Decoder(nnx.Module):
    """A Qwen2 / Llama decoder with its LM head.

    Args:
      config: The model's shape and dtypes.
      rngs: Random initialisation (loaders overwrite every weight).
      remat: Recompute each layer's activations in the backward pass (``nnx.remat``).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, remat: bool = False):
        c = config
        self.config = c
        self.remat = remat
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), c.param_dtype)
        self.layers = nnx.List([DecoderLayer(c, rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.vocab_size, c.hidden_size), c.param_dtype)

    def head(self) -> Array:
        """The LM head ``[V, H]`` (layout ``"vh"``): the embedding when tied."""
        return (self.embed if self.config.tie_word_embeddings else self.lm_head)[...]

    def __call__(self, ids: Array, attention_mask: Array | None = None,
                 positions: Array | None = None, *, return_hidden: bool = False,
                 embeddings: Array | None = None) -> Array:
        """Logits ``[B, T, V]`` (float32), or the final hidden states ``[B, T, H]``.

        Args:
          ids: ``[B, T]`` token ids.
          attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (default: all real).
          positions: ``[B, T]`` RoPE positions (default: from the mask, so left padding works).
          return_hidden: Return the hidden states after the final norm, before the head (in the
            compute dtype), for :func:`grpo_kernels.grpo_loss_from_hidden` with
            ``lm_head=model.head()``, ``lm_head_layout="vh"``.
          embeddings: ``[B, T, H]`` rows to use in place of the lookup ``embed[ids]`` (a
            caller's own lookup of ``embed``, e.g. one whose gradient is formed differently).
        """
        c = self.config
        b, t = ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        if positions is None:
            positions = positions_from_mask(attention_mask)
        causal = jnp.tril(jnp.ones((t, t), bool))
        mask = causal[None] & (attention_mask[:, None, :] != 0)
        inv_freq = rope_frequencies(c)
        x = jnp.take(self.embed[...], ids, axis=0) if embeddings is None else embeddings
        x = x.astype(c.compute_dtype)
        for layer in self.layers:
            if self.remat:
                x = nnx.remat(lambda lyr, y: lyr(y, positions, mask, inv_freq))(layer, x)
            else:
                x = layer(x, positions, mask, inv_freq)
        hidden = self.norm(x)
        if return_hidden:
            return hidden
        return self.logits(hidden)

    def logits(self, hidden: Array, dtype: Any = _F32) -> Array:
        """Logits of hidden states ``[..., H]``: the head in the compute dtype, float32
        accumulation, the float32 result rounded to ``dtype`` (float32: kept)."""
        z = jnp.einsum("...h,vh->...v", hidden, self.head().astype(self.config.compute_dtype),
                       preferred_element_type=_F32)
        return z.astype(dtype)

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> list[tuple[Array, Array]]:
        """An empty key/value cache: per layer ``(k, v)`` of ``[B, Hk, length, d]``."""
        c = self.config
        shape = (batch, c.num_kv_heads, length, c.head_dim)
        dtype = dtype or c.compute_dtype
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(c.num_layers)]

    def extend(self, ids: Array, positions: Array, kv_mask: Array, cache: list, index: Any,
               ) -> tuple[Array, list]:
        """Runs ``ids [B, t]`` at cache slots ``index .. index+t-1``; returns the last
        position's float32 logits ``[B, V]`` and the updated cache.

        ``kv_mask [B, S]`` marks the cache slots holding real tokens (this call's slots
        included); a query at slot ``index + i`` sees the real slots up to its own.
        """
        c = self.config
        t, s = ids.shape[1], kv_mask.shape[1]
        slots = index + jnp.arange(t)
        mask = (jnp.arange(s)[None, :] <= slots[:, None])[None] & (kv_mask[:, None, :] != 0)
        inv_freq = rope_frequencies(c)
        x = jnp.take(self.embed[...], ids, axis=0).astype(c.compute_dtype)
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x, layer_cache = layer(x, positions, mask, inv_freq, layer_cache, index)
            new_cache.append(layer_cache)
        return self.logits(self.norm(x[:, -1])), new_cache


def empty_decoder(config: ModelConfig, remat: bool = False) -> Decoder:
    """A :class:`Decoder` whose weights are shapes only (``nnx.eval_shape``), for a loader
    that sets every weight: no random initialisation to throw away (at 135M parameters on a
    2-core CPU it took longer than reading the checkpoint). See :func:`check_loaded`."""
    return nnx.eval_shape(lambda: Decoder(config, nnx.Rngs(0), remat=remat))


def check_loaded(model: Decoder, source: str) -> Decoder:
    """``model``, after checking that a loader set each weight of :func:`empty_decoder`.

    Raises:
      ValueError: naming ``source`` and the weights still without a value.
    """
    unset = [jax.tree_util.keystr(path) for path, leaf in
             jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
             if isinstance(leaf, jax.ShapeDtypeStruct)]
    if unset:
        raise ValueError(f"{source}: no value loaded for {len(unset)} weight(s): "
                         f"{', '.join(unset[:5])}{' ...' if len(unset) > 5 else ''}")
    return model
