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

from grpo_kernels.compat import vary_like
from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import BatchGather, BatchSum, token_row_grad, token_separable
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.options import check_int, check_interpret, resolved_interpret
from grpo_kernels.ops.core.tpu import check_generation
from grpo_kernels.ops.core.validate import backend_kind
from grpo_kernels.ops.core.vjp import loss_from_pieces, loss_with_gradient
from grpo_kernels.ops.core.truncation import Truncation, config_truncation
from grpo_kernels.ops.logits_loss import pallas_gpu, pallas_gpu_one_pass, pallas_tpu
from grpo_kernels.ops.logits_loss import xla as logits_xla

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class PallasBlockSizes:
    """Tiling of the Pallas kernels; ``None`` fields come from each kernel's planner.

    Both rules hold for both kernels, so a value valid on one chip is valid on the other.

    Attributes:
      block_rows: Rows per grid step of the TPU kernels: a multiple of 16 (TPU sublane tiling
        of 16-bit rows; 32-bit rows need 8). The GPU kernels take one row per program.
      block_vocab: Vocabulary tile: a power of two >= 128 (a multiple of 128 for the TPU
        lanes, a power of two for Triton's block shapes).
      gpu_programs: Persistent programs of the one-pass GPU kernel (each loops over every
        ``gpu_programs``-th row); ``None``: one per multiprocessor
        (:func:`~.pallas_gpu_one_pass.default_programs`).
      gpu_stages: Load stages of the one-pass GPU kernel: tiles each sweep has loading at
        once, 1 to ``MAX_STAGES`` (:class:`~.pallas_gpu_one_pass.OnePassBlocks`); ``None``:
        its planner's (``DEFAULT_STAGES``, 2).
    """

    block_rows: int | None = None
    block_vocab: int | None = None
    gpu_programs: int | None = None
    gpu_stages: int | None = None

    def __post_init__(self) -> None:
        check_int("PallasBlockSizes", "block_rows", self.block_rows, multiple=16,
                  why=" (TPU sublane tiling of 16-bit rows)")
        check_int("PallasBlockSizes", "block_vocab", self.block_vocab, multiple=128,
                  power_of_two=True, why=" (TPU lanes; Triton block shapes)")
        check_int("PallasBlockSizes", "gpu_programs", self.gpu_programs)
        check_int("PallasBlockSizes", "gpu_stages", self.gpu_stages,
                  maximum=pallas_gpu_one_pass.MAX_STAGES, why=pallas_gpu_one_pass.STAGES_WHY)


@dataclasses.dataclass(frozen=True)
class PallasOptions:
    """Options of ``impl="pallas"``.

    Attributes:
      kernel: ``"tpu"``, ``"gpu"`` or ``"auto"`` (the backend's own; ``"tpu"`` on CPU).
      blocks: The kernels' tiling; ``None``: each kernel's planner.
      alias_logits: Write dlogits into the logits' buffer (saves a ``[B, T, V]`` buffer when the
        logits are donated or otherwise dead).
      one_pass: The one-pass kernel (the logits read once, the gradient formed in the forward)
        for token-separable configs (:func:`grpo_kernels.objective.token_separable`): on TPU
        :func:`~.pallas_tpu.one_pass`, on GPU :func:`~.pallas_gpu_one_pass.one_pass` (its
        second read from L2; addresses rows as the ``"aligned"`` layout whatever
        ``gpu_layout``). ``None``: exactly when the TPU kernel runs and the config is
        token-separable (the GPU one was no faster than the aligned layout on an H100);
        ``True`` with another config, or under a sampler's truncation (the one-pass kernels
        take no floor), raises; ``False``: the two kernels.
      gpu_layout: How the GPU kernels address a row: ``"rows"`` (tiles from each row's start)
        or ``"aligned"`` (tiles on 16-byte boundaries, no column ids inside them;
        :mod:`~grpo_kernels.ops.logits_loss.pallas_gpu_aligned`; int32 offsets, so
        ``N * V < 2^31``). ``"auto"``: ``"aligned"`` where it fits, else ``"rows"`` (aligned
        was faster at every shape on an H100, docs/benchmarks.md); under a sampler's
        truncation ``"rows"`` (``"aligned"`` takes no floor: asked for by name, it raises).
        Ignored by the TPU kernels.
      tpu_generation: The TPU the TPU kernels' blocks are sized for (``"v4"``, ``"v5e"``,
        ``"v5p"``, ``"v6e"``, ``"v7x"``: :data:`grpo_kernels.ops.core.tpu.VMEM_BYTES`);
        ``None``: the first device's, else ``"v6e"``. Name it when tracing on one host for
        another (``jax.export``, or a compile for a TPU topology from a CPU host).
      interpret: Run the kernels in interpret mode; ``None``: exactly when the backend is CPU.
        ``"hlo"``: JAX's generic HLO interpreter instead of the TPU one (what
        :mod:`grpo_kernels.sharding` uses on a CPU mesh: the TPU interpreter makes every device
        wait for all the others at each kernel, which can deadlock against XLA:CPU's
        collectives).
    """

    kernel: Literal["auto", "tpu", "gpu"] = "auto"
    blocks: PallasBlockSizes | None = None
    alias_logits: bool = False
    interpret: bool | Literal["hlo"] | None = None
    one_pass: bool | None = None
    gpu_layout: Literal["auto", "rows", "aligned"] = "auto"
    tpu_generation: str | None = None

    def __post_init__(self) -> None:
        check_interpret("PallasOptions", self.interpret)
        check_generation("PallasOptions.tpu_generation", self.tpu_generation)
        if self.kernel not in ("auto", "tpu", "gpu"):
            raise ValueError(f"PallasOptions.kernel must be 'auto', 'tpu' or 'gpu', "
                             f"got {self.kernel!r}")
        if self.blocks is not None and not isinstance(self.blocks, PallasBlockSizes):
            raise ValueError(f"PallasOptions.blocks must be None or a PallasBlockSizes, "
                             f"got {type(self.blocks).__name__}")
        if self.one_pass not in (None, True, False):
            raise ValueError(f"PallasOptions.one_pass must be None, True or False, "
                             f"got {self.one_pass!r}")
        if self.gpu_layout not in pallas_gpu.LAYOUT_CHOICES:
            raise ValueError(f"PallasOptions.gpu_layout must be 'auto' or one of "
                             f"{pallas_gpu.LAYOUTS}, "
                             f"got {self.gpu_layout!r}")
        if not isinstance(self.alias_logits, bool):
            raise ValueError(f"PallasOptions.alias_logits must be True or False, "
                             f"got {self.alias_logits!r}")

    def resolved_kernel(self, backend: str | None = None) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "gpu" if backend_kind(backend) == "gpu" else "tpu"

    def resolved_interpret(self, backend: str | None = None) -> bool | str:
        return resolved_interpret(self.interpret, backend_kind(backend))

    def resolved_one_pass(self, config: GRPOLossConfig, backend: str | None = None,
                          truncated: bool = False) -> bool:
        """Whether a one-pass kernel computes ``config``'s loss (see ``one_pass``); never
        under a sampler's truncation (``truncated``: the one-pass kernels take no floor)."""
        fits = token_separable(config)
        if self.one_pass and not fits:
            raise ValueError(
                "PallasOptions.one_pass=True needs a token-separable config (token level; no "
                "vespo, off_policy_mask_threshold, sequence-level sampler_correction or "
                f"top_entropy_quantile < 1), got {config!r}")
        if self.one_pass and truncated:
            raise ValueError("PallasOptions.one_pass=True takes no top_k / top_p / min_p (the "
                             "one-pass kernels take no truncation floor); use one_pass=None")
        if truncated:
            return False
        if self.one_pass is None:
            return fits and self.resolved_kernel(backend) == "tpu"
        return self.one_pass


def _tpu_tiling(vocab: int, dtype, opts: PallasOptions, n: int) -> pallas_tpu.TpuBlocks:
    blocks = opts.blocks or PallasBlockSizes()
    return pallas_tpu.plan_blocks(vocab, dtype, opts.tpu_generation, blocks.block_rows,
                                  blocks.block_vocab, n)


def _gpu_layout(opts: PallasOptions, truncated: bool) -> str:
    """The GPU layout asked for; under a sampler's truncation ``"rows"`` (the one whose
    gradient kernel takes the rows' floors), and a ValueError for ``"aligned"`` by name."""
    if not truncated:
        return opts.gpu_layout
    if opts.gpu_layout == "aligned":
        raise ValueError("top_k / top_p / min_p: PallasOptions.gpu_layout='aligned' takes no "
                         "truncation floor; use gpu_layout='rows' or 'auto'")
    return "rows"


def kernels(vocab: int, dtype, opts: PallasOptions, n: int, softcap: float | None = None,
            truncated: bool = False):
    """``(row_statistics, logits_gradient)`` on ``[N, V]`` rows (``N = n``, which the TPU
    tiling fits its row blocks to), bound to their tiling, interpret flag and soft cap
    (``truncated``: the gradient takes a ``floor`` per row; the GPU kernels then use the
    ``"rows"`` layout)."""
    interpret = opts.resolved_interpret()
    blocks = opts.blocks or PallasBlockSizes()
    if opts.resolved_kernel() == "gpu":
        tiling = pallas_gpu.plan_blocks(vocab, blocks.block_vocab, _gpu_layout(opts, truncated),
                                        n)
        mod = pallas_gpu
    else:
        tiling, mod = _tpu_tiling(vocab, dtype, opts, n), pallas_tpu

    def stats(z, ids, tau):
        return mod.row_statistics(z, ids, tau, tiling, interpret=interpret, softcap=softcap)

    def grad(z, ids, lse, coef, tau, hcoef=None, entropy=None, floor=None):
        return mod.logits_gradient(z, ids, lse, coef, tau, tiling, interpret=interpret,
                                   alias_logits=opts.alias_logits, hcoef=hcoef,
                                   entropy=entropy, softcap=softcap, floor=floor)

    return stats, grad


def pieces(shape: tuple[int, ...], dtype, options: PallasOptions | None, temperature: float,
           softcap: float | None = None, trunc: Truncation | None = None):
    """``(stats, grad)`` on primals ``(z,)``, ``z`` ``[B, T, V_k]`` logits (soft-capped by
    ``softcap`` in the kernels), as :func:`..xla.pieces`: ``stats((z,), ids)`` -> ``[B, T]``
    ``(logp, lse, entropy)``;
    ``grad((z,), hit_ids, lse, row_grad)`` -> ``(dz,)`` where the
    :class:`~grpo_kernels.objective.RowGrad` already carries the loss cotangent.

    With the sampler's truncation ``trunc`` (whole rows): ``stats`` is the XLA pass that
    finds each row's floor with the kept set's statistics
    (:func:`..xla.truncated_statistics`: ``(logp, lse, entropy, floor, outside)``), and the
    gradient kernel takes ``(ids, floor)`` for ``hit_ids``, masking the dropped entries: one
    read of the logits for the statistics and one for the gradient, as without it."""
    b, t, vocab = shape
    n = b * t
    row_stats, row_grad = kernels(vocab, dtype, options or PallasOptions(), n, softcap,
                                  trunc is not None)

    def stats(primals, ids):
        if trunc is None:
            out = row_stats(primals[0].reshape(n, vocab), ids.reshape(n), temperature)
        else:
            out = logits_xla.truncated_statistics(primals[0], ids.reshape(n), temperature,
                                                  trunc, softcap=softcap)
        return tuple(x.reshape(b, t) for x in out)

    def grad(primals, hit_ids, lse, rg):
        floor = None
        if trunc is not None:
            hit_ids, floor = hit_ids
            floor = floor.reshape(n)
        rg = rg.map(lambda x: x.reshape(n)).over(temperature)
        dz = row_grad(primals[0].reshape(n, vocab), hit_ids.reshape(n), lse.reshape(n),
                      rg.g, temperature, rg.h, rg.entropy, floor)
        return (dz.reshape(b, t, vocab),)

    return stats, grad


def pallas_grpo_loss(logits: Array, batch: TokenBatch, config: GRPOLossConfig,
                     options: PallasOptions | None = None,
                     softcap: float | None = None) -> tuple[Array, dict[str, Array]]:
    """GRPO loss on the Pallas kernels, differentiable w.r.t. ``logits``.

    Args, returns: as :func:`grpo_kernels.grpo_loss` (checked there; ``softcap``: its
    ``logit_softcap``, applied inside the kernels). Under the config's sampler truncation
    (``top_k``, ``top_p``, ``min_p``) the two kernels' path with the XLA statistics pass
    (:func:`pieces`); the one-pass kernels take no floor.
    """
    options = options or PallasOptions()
    trunc = config_truncation(config, logits.shape[-1])
    if options.resolved_one_pass(config, truncated=trunc is not None):
        return one_pass_loss(logits, batch, config, options, softcap=softcap)
    stats, grad = pieces(logits.shape, logits.dtype, options, config.temperature, softcap,
                         trunc)
    return loss_from_pieces(stats, grad, batch.clamped_ids(logits.shape[-1]), config,
                            (logits,), batch, truncated=trunc is not None)


def one_pass_loss(logits: Array, batch: TokenBatch, config: GRPOLossConfig,
                  options: PallasOptions, batch_sum: BatchSum | None = None,
                  batch_gather: BatchGather | None = None,
                  softcap: float | None = None) -> tuple[Array, dict[str, Array]]:
    """:func:`pallas_grpo_loss` on a one-pass kernel (:func:`~.pallas_tpu.one_pass` or
    :func:`~.pallas_gpu_one_pass.one_pass`): the forward reads the logits once and forms the
    gradient for a unit cotangent.

    The gradient rides on a carrier: a zero added to the loss whose custom backward is
    ``dz * cotangent`` (XLA drops the multiply when the cotangent is the constant 1 of
    ``jax.grad(loss)``); the objective itself sees the statistics with no gradient of its own.
    ``batch_sum`` and ``batch_gather`` (:meth:`TokenBatch.loss`) make this device's whole rows
    part of a batch sharded over batch axes only (:mod:`grpo_kernels.sharding`): the
    normalisers in the per-token columns and in the loss are whole-batch figures, and the
    carrier is ``batch_sum``'d like the loss, so its cotangent is the loss's under either
    typing of ``shard_map`` (``check_vma``), where a collective inside the custom rule would
    see a cotangent split over the devices. ``softcap``: the logits' soft cap, in the
    kernel."""
    b, t, vocab = logits.shape
    n, tau = b * t, config.temperature
    interpret = options.resolved_interpret()
    blocks = options.blocks or PallasBlockSizes()
    if options.resolved_kernel() == "gpu":
        tiling = pallas_gpu_one_pass.plan_blocks(n, vocab, blocks.block_vocab,
                                                 blocks.gpu_programs, stages=blocks.gpu_stages)
        kernel = pallas_gpu_one_pass.one_pass
    else:
        tiling, kernel = _tpu_tiling(vocab, logits.dtype, options, n), pallas_tpu.one_pass
    row_stats = kernels(vocab, logits.dtype, options, n, softcap)[0]

    def forward(primals, batch, with_grad):
        z, ids = primals[0].reshape(n, vocab), batch.clamped_ids(vocab).reshape(n)
        if with_grad:
            logp, ent, dz = kernel(
                z, ids, batch.token_columns(config, batch_sum),
                lambda lp, cols: token_row_grad(lp, cols, config), tau, tiling,
                interpret=interpret, alias_logits=options.alias_logits, softcap=softcap)
        else:  # a primal-only call needs the statistics alone
            logp, _, ent = row_stats(z, ids, tau)
        stats = (logp.reshape(b, t), ent.reshape(b, t))
        # Typed like the logits (varying over the batch axes under shard_map), so that
        # batch_sum reduces it and its cotangent is the loss's, not n times it.
        carrier = vary_like(jnp.zeros((), jnp.float32), primals[0])
        return (carrier, stats), \
            ((dz.reshape(b, t, vocab),) if with_grad else None)

    carrier, (logp, ent) = loss_with_gradient(forward)((logits,), batch)
    loss, metrics, _ = batch.loss(logp, ent, config, False, batch_sum, batch_gather)
    return loss + (carrier if batch_sum is None else batch_sum(carrier)), metrics
