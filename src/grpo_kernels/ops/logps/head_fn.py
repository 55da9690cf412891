r"""Log-probs of a head given as a function: ``logits = head_fn(hidden)``, a chunk at a time.

For a model whose head is code rather than weights we can read (MaxText's adapter applies its
final norm and head in ``compute_final_logits``; tunix's chunked-log-prob protocol), the
completion's ``[B, T, H]`` hidden states are cut along ``T`` into chunks of ``c`` positions and
each chunk's ``[B, c, V]`` logits are formed, reduced to

.. math::

    \log\pi_{bt} = s_{bt, y_{bt}} - \log\sum_v e^{s_{btv}}, \qquad
    H_{bt} = -\sum_v \pi_{btv} \log \pi_{btv}, \qquad s = \mathrm{float32}(z) / \tau,

and dropped (:func:`jax.lax.scan` over the chunks). Under a sampler's truncation (``top_k``,
``top_p``, ``min_p``: :mod:`grpo_kernels.ops.core.truncation`) each chunk holds whole rows, so
each row's floor is found in its chunk (a top-k of the row's group maxima, or a bisection;
no sorted copy) and the sums run over the kept set and the chosen token. The chunk's function
is rematerialised (:func:`jax.checkpoint`), so the backward pass forms each chunk's logits again instead of
keeping them: at most one chunk's float32 logits (and their gradient) exist at a time, never
``[B, T, V]``. Gradients reach ``hidden`` and whatever ``head_fn`` closes over (a model's
parameters) by ordinary autodiff.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.ops.core.reference import truncated_token_logps
from grpo_kernels.ops.core.validate import backend_kind
from grpo_kernels.ops.lm_head_loss.xla_plan import LmHeadBlockSizes, plan_chunk

Array = jax.Array


def chunk_positions(batch: int, time: int, vocab: int, blocks: LmHeadBlockSizes,
                    backend: str) -> int:
    """Positions per chunk: the fused head's row budget (:func:`~grpo_kernels.ops.lm_head_loss.
    xla_plan.plan_chunk`, ``blocks.chunk_tokens`` rows or ``blocks.chunk_bytes`` of float32 logits)
    spread over the ``batch`` rows, at least 1 and at most ``time``."""
    rows = plan_chunk(batch * time, vocab, blocks, backend)
    return max(1, min(time, rows // batch))


def token_logps_from_head_fn(hidden: Array, head_fn: Callable[[Array], Array], ids: Array, *,
                             temperature: float = 1.0, return_entropy: bool = False,
                             blocks: LmHeadBlockSizes | None = None,
                             top_k: int | None = None, top_p: float | None = None,
                             min_p: float | None = None, return_outside: bool = False
                             ) -> Array | tuple[Array, ...]:
    """Per-token log-probs (and entropies) of ``softmax(float32(head_fn(hidden)) / tau)``.

    Args:
      hidden: ``[B, T, H]`` states; position ``t`` scores ``ids[:, t]``.
      head_fn: ``[B, c, H] -> [B, c, V]`` logits for any chunk length ``c``.
      ids: ``[B, T]`` integer ids, clamped into ``[0, V)``.
      temperature: :math:`\\tau > 0`.
      return_entropy: Also return each position's entropy.
      blocks: The chunk's size (``chunk_tokens`` rows or ``chunk_bytes`` of float32 logits;
        ``dweight`` does not apply); ``None``: the fused head's backend default.
      top_k: Keep the ``top_k`` largest scaled logits of each row (and their ties), as in
        :func:`grpo_kernels.token_logps`.
      top_p: Then the smallest top set of probability ``>= top_p``.
      min_p: First the tokens of probability ``>= min_p`` times the row's largest.
      return_outside: Also return ``[B, T]`` bool: the chosen token lies outside the kept set.

    Returns:
      ``logp [B, T]`` float32, then ``entropy`` (``return_entropy``) and ``outside``
      (``return_outside``) when asked; differentiable (the kept set a constant).

    Raises:
      ValueError: naming the argument.
    """
    from grpo_kernels.ops.logps.api import (check_temperature, check_token_ids,
                                            requested_truncation, results)

    if getattr(hidden, "ndim", None) != 3 or min(hidden.shape) < 1:
        raise ValueError(f"hidden must have rank 3 [B, T, H] with every size >= 1, got shape "
                         f"{tuple(getattr(hidden, 'shape', ()))}")
    if blocks is not None and not isinstance(blocks, LmHeadBlockSizes):
        raise ValueError(f"blocks must be None or LmHeadBlockSizes, got {type(blocks).__name__}")
    tau = check_temperature(temperature)
    b, t, _ = hidden.shape
    out = jax.eval_shape(head_fn, hidden[:, :1])
    if len(out.shape) != 3 or tuple(out.shape[:2]) != (b, 1):
        raise ValueError(f"head_fn must map [B, c, H] to [B, c, V], got {tuple(out.shape)} "
                         f"for a chunk of shape {(b, 1, hidden.shape[-1])}")
    vocab = out.shape[-1]
    trunc = requested_truncation(vocab, top_k, top_p, min_p, return_outside)
    ids = check_token_ids(ids, b, t, vocab, False)
    c = chunk_positions(b, t, vocab, blocks or LmHeadBlockSizes(), backend_kind())
    n = -(-t // c)
    pad = n * c - t
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, -1).swapaxes(0, 1)
    ys = jnp.pad(ids, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

    @jax.checkpoint
    def chunk(h: Array, y: Array) -> tuple[Array, Array, Array]:
        # The barrier keeps XLA from fusing the head's last matmul into the reductions that
        # read it: XLA:CPU (jaxlib 0.12) then evaluates a float32 x bfloat16 dot (MaxText's
        # tied head) at bfloat16 precision inside a scan, 2e-3 off (relative) in the
        # log-probs. The chunk's logits exist either way.
        z = jax.lax.optimization_barrier(head_fn(h).astype(jnp.float32))
        logp, ent, out = truncated_token_logps(z, y, tau, None, trunc, by_sorting=False)
        return logp, ent, jnp.zeros(logp.shape, jnp.bool_) if out is None else out

    def step(carry: Any, xs: tuple[Array, Array]) -> tuple[Any, tuple[Array, ...]]:
        return carry, chunk(*xs)

    _, stats = jax.lax.scan(step, None, (hs, ys))
    logp, ent, outside = (x.swapaxes(0, 1).reshape(b, n * c)[:, :t] for x in stats)
    return results(logp, ent, outside, return_entropy, return_outside)
