r"""``impl="pallas"``: the GRPO loss on the Pallas kernels for TPU or GPU.

Forward: the statistics kernel gives per-row ``logp``, ``lse`` and the entropy in one sweep over
the logits; :func:`grpo_kernels.objective.grpo_objective` turns ``logp`` into the loss and
:math:`g = \partial L/\partial \log\pi`. The residuals are the logits (already alive), ``lse``
and ``g``: ``O(N)`` floats. Backward: the gradient kernel writes
:math:`\partial L/\partial z = (g\,\bar{L}/\tau)(\mathbb{1}[v=y] - e^{s-\mathrm{lse}})` once, in
the logits dtype, with the cotangent :math:`\bar L` folded into the per-row factor (optionally
into the logits' own buffer).

Which kernel: ``PallasOptions.kernel`` ``"auto"`` picks the TPU kernel on TPU and the GPU (Triton)
kernel on GPU. On CPU there is no Pallas compiler, so the kernels run in interpret mode (TPU
interpret mode with out-of-bounds reads raising, or the generic interpreter for the GPU kernel):
numerically the same program, for tests, far too slow to benchmark.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import loss_from_token_stats
from grpo_kernels.ops.logits_loss import pallas_gpu, pallas_tpu
from grpo_kernels.ops.logits_loss.xla import zero_cotangent

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class PallasOptions:
    """Options of ``impl="pallas"``.

    Attributes:
      kernel: ``"tpu"``, ``"gpu"`` or ``"auto"`` (the backend's own; ``"tpu"`` on CPU).
      block_rows: Rows per grid step of the TPU kernels; ``None``: the heuristic table.
      block_vocab: Vocabulary tile (TPU: a multiple of 128; GPU: a power of two); ``None``: the
        heuristic table.
      alias_logits: Write dlogits into the logits' buffer (saves a ``[B, T, V]`` buffer when the
        logits are donated or otherwise dead).
      interpret: Run the kernels in interpret mode; ``None``: exactly when the backend is CPU.
        ``"hlo"``: JAX's generic HLO interpreter instead of the TPU one (what
        :mod:`grpo_kernels.sharding` uses on a CPU mesh: the TPU interpreter makes every device
        wait for all the others at each kernel, which can deadlock against XLA:CPU's
        collectives).
    """

    kernel: Literal["auto", "tpu", "gpu"] = "auto"
    block_rows: int | None = None
    block_vocab: int | None = None
    alias_logits: bool = False
    interpret: bool | Literal["hlo"] | None = None

    def __post_init__(self) -> None:
        if self.interpret not in (None, True, False, "hlo"):
            raise ValueError(f"PallasOptions.interpret must be None, True, False or 'hlo', "
                             f"got {self.interpret!r}")
        if self.kernel not in ("auto", "tpu", "gpu"):
            raise ValueError(f"PallasOptions.kernel must be 'auto', 'tpu' or 'gpu', "
                             f"got {self.kernel!r}")
        for name in ("block_rows", "block_vocab"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"PallasOptions.{name} must be None or an int >= 1, "
                                 f"got {value!r}")
        if self.block_vocab is not None and self.kernel == "tpu" and self.block_vocab % 128:
            raise ValueError(f"PallasOptions.block_vocab must be a multiple of 128 for the TPU "
                             f"kernel, got {self.block_vocab}")
        if self.block_rows is not None and self.block_rows % 8:
            raise ValueError(f"PallasOptions.block_rows must be a multiple of 8 (TPU sublane "
                             f"tiling), got {self.block_rows}")

    def resolved_kernel(self, backend: str | None = None) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "gpu" if (backend or jax.default_backend()) in ("gpu", "cuda", "rocm") else "tpu"

    def resolved_interpret(self, backend: str | None = None) -> bool | str:
        if self.interpret is not None:
            return self.interpret
        return (backend or jax.default_backend()) == "cpu"


def kernels(logits: Array, opts: PallasOptions):
    """``(row_statistics, logits_gradient)`` bound to their block sizes and interpret flag."""
    vocab = logits.shape[-1]
    interpret = opts.resolved_interpret()
    if opts.resolved_kernel() == "gpu":
        blocks = pallas_gpu.plan_blocks(vocab, opts.block_vocab)
        mod = pallas_gpu
    else:
        if opts.block_rows is not None and logits.dtype.itemsize == 2 and opts.block_rows % 16:
            raise ValueError(f"PallasOptions.block_rows must be a multiple of 16 for 16-bit "
                             f"logits on TPU, got {opts.block_rows}")
        blocks = pallas_tpu.plan_blocks(vocab, logits.dtype, None, opts.block_rows,
                                        opts.block_vocab)
        mod = pallas_tpu

    def stats(z, ids, tau):
        return mod.row_statistics(z, ids, tau, blocks, interpret=interpret)

    def grad(z, ids, lse, coef, tau):
        return mod.logits_gradient(z, ids, lse, coef, tau, blocks, interpret=interpret,
                                   alias_logits=opts.alias_logits)

    return stats, grad


def pallas_grpo_loss(
    logits: Array,
    ids: Array,
    mask: Array,
    advantages: Array,
    *,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | None = None,
    block_sizes: PallasOptions | None = None,
) -> tuple[Array, dict[str, Array]]:
    """GRPO loss on the Pallas kernels, differentiable w.r.t. ``logits``.

    Args, returns: as :func:`grpo_kernels.grpo_loss`; ``block_sizes`` is a
    :class:`PallasOptions`.
    """
    opts = block_sizes or PallasOptions()
    if not isinstance(opts, PallasOptions):
        raise ValueError(f"block_sizes for impl='pallas' must be a PallasOptions, "
                         f"got {type(opts).__name__}")
    b, t, vocab = logits.shape
    n, tau = b * t, config.temperature
    ids = jnp.clip(ids.astype(jnp.int32), 0, vocab - 1)
    stats, grad = kernels(logits, opts)
    rest = (mask, advantages, old_logps, ref_logps, num_items_in_batch)

    def forward(z, rest, with_grad):
        logp, lse, entropy = (x.reshape(b, t) for x in stats(z.reshape(n, vocab),
                                                            ids.reshape(n), tau))
        mask, adv, *others = rest
        loss, metrics, g = loss_from_token_stats(logp, entropy, mask, adv, config, *others,
                                                 with_grad=with_grad)
        return (loss, metrics), (lse, g)

    @jax.custom_vjp
    def loss_fn(z, rest):
        return forward(z, rest, False)[0]

    def loss_fwd(z, rest):
        out, (lse, g) = forward(z, rest, True)
        return out, (z, lse, g, rest)

    def loss_bwd(res, cotangents):
        z, lse, g, rest = res
        coef = (g * cotangents[0].astype(jnp.float32) / tau).reshape(n)
        dz = grad(z.reshape(n, vocab), ids.reshape(n), lse.reshape(n), coef, tau)
        zeros = jax.tree.map(zero_cotangent, rest, is_leaf=lambda x: x is None)
        return dz.reshape(b, t, vocab), zeros

    loss_fn.defvjp(loss_fwd, loss_bwd)
    return loss_fn(logits, rest)
