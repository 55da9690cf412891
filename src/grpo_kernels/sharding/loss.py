"""Both GRPO losses under ``shard_map``: one body, two entries.

Per device: the primals (logits ``[B/b, T, V/k]``, or hidden states ``[B/b, T, H]`` with a
tensor-parallel head shard ``[H, V/k]`` / ``[V/k, H]`` and its bias) and this device's rows of
the :class:`~grpo_kernels.objective.batch.TokenBatch` (``b`` = product of the batch axes, ``k``
= the vocab axis). :func:`_shard_loss` is the same for both ops: the chosen implementation's
statistics ``pieces`` over the local columns, :mod:`grpo_kernels.sharding.vocab` to combine
them across the vocab axis, the objective normalised over the whole batch through ``psum``
over the batch axes, and the implementation's gradient piece on the local block, fed the
global ``lse``. What differs between the ops is an :class:`~grpo_kernels.sharding.kinds.OpKind`
(:mod:`grpo_kernels.sharding.kinds`, with the per-device body :func:`~grpo_kernels.sharding.kinds.statistics`).

For the fused head, ``dW`` (and ``db``) stay local to their shard (``shard_map`` sums them over
the batch axes, the usual data-parallel reduction) and ``dhidden`` is summed over the vocab
axis, since every shard contributes ``delta_k W_k^T`` (the XLA head, sequence-parallel when
``T`` allows, sums it chunk by chunk into each device's own steps). The XLA head plans its
chunk from the *whole* vocabulary, so a device's ``[c, V/k]`` logits and ``[H, V/k]`` float32 ``dW``
accumulator shrink by ``k``. With ``ShardingSpec.head_axes`` (weights split over ``H`` by FSDP
axes) the XLA head instead sweeps vocabulary blocks, gathering each over those axes and
reduce-scattering its ``dW`` (:func:`grpo_kernels.ops.lm_head_loss.xla.gathered_pieces`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from grpo_kernels.compat import to_layout
from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.objective.segments import Segments
from grpo_kernels.ops.core.truncation import Truncation, config_truncation, outside_count
from grpo_kernels.ops.core.validate import (check_ids_in_range, check_softcap, resolve_impl,
                                            validate_token_inputs)
from grpo_kernels.ops.lm_head_loss import api as head_api
from grpo_kernels.ops.lm_head_loss import pallas_tpu as head_pallas
from grpo_kernels.ops.logits_loss import api as logits_api
from grpo_kernels.ops.logits_loss import pallas as logits_pallas
from grpo_kernels.sharding.kinds import (LOGITS, OpKind, Primals, on_mesh, head_kind,
                                         head_spec, logits_kind, sequence_split, statistics)
from grpo_kernels.sharding.spec import ShardingSpec, resolve
from grpo_kernels.sharding.truncation import mesh_truncation
from grpo_kernels.sharding.vocab import loss_and_metrics

Array = jax.Array
# What a sharded call is compiled for; the arrays are its arguments. Jitted, a call made
# outside ``jax.jit`` compiles one program (and a second call with the same statics none)
# instead of dispatching the body's operations one by one; inside ``jax.jit`` the program is
# inlined into the caller's.
RUN_STATIC = ("op", "primal_specs", "mesh", "spec", "config", "impl", "options", "vocab",
              "default_options", "trunc")


def _one_pass_options(op: OpKind, impl: str, options: Any, config: GRPOLossConfig,
                      spec: ShardingSpec, trunc: Truncation | None) -> Any:
    """The Pallas options when the logits loss runs the one-pass kernel on this mesh, else
    None: only without a vocab axis, since the kernel writes ``dlogits`` from the whole row's
    ``lse`` and a vocabulary shard has its own columns' alone until :func:`combine`. The
    normalisers it needs are whole-batch sums of the mask, known before the kernel. Never
    under a sampler's truncation ``trunc`` (the kernel takes no floor).

    Raises:
      ValueError: ``PallasOptions.one_pass=True`` on a mesh that splits the vocabulary.
    """
    if op is not LOGITS or impl != "pallas":
        return None
    opts = on_mesh(options, logits_pallas.PallasOptions())
    if spec.vocab_axis is not None:
        if opts.one_pass:
            raise ValueError(
                f"PallasOptions.one_pass=True needs whole vocabulary rows on each device, but "
                f"the mesh splits V over {spec.vocab_axis!r}; use one_pass=None (the two "
                f"kernels there, the one-pass kernel where nothing splits V)")
        return None
    return opts if opts.resolved_one_pass(config, truncated=trunc is not None) else None


def _shard_loss(primals: Primals, batch: TokenBatch, *, op: OpKind, config: GRPOLossConfig,
                spec: ShardingSpec, impl: str, options: Any, vocab: int,
                trunc: Truncation | None = None) -> tuple[Array, dict[str, Array]]:
    """The loss on one device's block; every collective goes through ``spec``. With the
    sampler's truncation ``trunc`` (whole rows) the metrics add ``outside_truncation``, the
    whole batch's count."""
    one_pass = _one_pass_options(op, impl, options, config, spec, trunc)
    if one_pass is not None:
        return logits_pallas.one_pass_loss(primals[0], batch, config, one_pass,
                                           spec.batch_sum, spec.batch_gather)
    logp, ent, out = statistics(primals, batch.ids, op=op, spec=spec, impl=impl,
                                options=options, vocab=vocab, temperature=config.temperature,
                                with_entropy=config.has_entropy_bonus, trunc=trunc)
    loss, metrics = loss_and_metrics(logp, ent, batch, config, spec)
    if trunc is not None:
        metrics["outside_truncation"] = spec.batch_sum(outside_count(out, batch.mask))
    return loss, metrics


@functools.partial(jax.jit, static_argnames=RUN_STATIC)
def _run(primals: Primals, batch: TokenBatch, *, op: OpKind, primal_specs: tuple, mesh: Mesh,
         spec: ShardingSpec, config: GRPOLossConfig, impl: str, options: Any, vocab: int,
         default_options: Any, trunc: Truncation | None = None
         ) -> tuple[Array, dict[str, Array]]:
    """``shard_map`` of :func:`_shard_loss` over ``mesh``, as one program (:data:`RUN_STATIC`).

    ``check_vma`` is off exactly when Pallas kernels run in JAX's HLO interpreter (CPU), which
    cannot type the mesh axes an array varies over; the gradients are the same either way
    (tested).
    """
    interpreted = impl == "pallas" and bool((options or default_options).resolved_interpret())
    rows2, scalar = spec.rows(2), PartitionSpec()
    batch_specs = TokenBatch(
        ids=rows2, mask=rows2, advantages=spec.rows(batch.advantages.ndim),
        old_logps=None if batch.old_logps is None else rows2,
        ref_logps=None if batch.ref_logps is None else rows2,
        num_items=None if batch.num_items is None else scalar,
        sampler_weights=None if batch.sampler_weights is None else rows2,
        sampler_logps=None if batch.sampler_logps is None else rows2,
        segments=None if batch.segments is None else Segments(rows2, batch.segments.count))
    metric_specs = {"logp": rows2, "token_entropy": rows2, **{k: scalar for k in (
        "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "kl", "entropy",
        "policy_loss", "kl_loss", *(("outside_truncation",) if trunc else ()))}}
    body = functools.partial(_shard_loss, op=op, config=config, spec=spec, impl=impl,
                             options=options, vocab=vocab, trunc=trunc)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(primal_specs, batch_specs),
                       out_specs=(scalar, metric_specs), check_vma=not interpreted)
    return fn(*to_layout((primals, batch), (primal_specs, batch_specs), mesh))


def sharded_grpo_loss(logits: Array, ids: Array, mask: Array, advantages: Array, *,
                      mesh: Mesh, sharding: ShardingSpec, config: GRPOLossConfig,
                      old_logps: Array | None = None, ref_logps: Array | None = None,
                      num_items_in_batch: Array | float | None = None,
                      sampler_weights: Array | None = None,
                      sampler_logps: Array | None = None, segments: Segments | None = None,
                      impl: str = "auto",
                      check_ids: bool = False, options: Any = None,
                      logit_softcap: float | None = None) -> tuple[Array, dict[str, Array]]:
    r""":func:`grpo_kernels.grpo_loss` with ``B`` split over ``sharding.batch_axes`` and ``V``
    over ``sharding.vocab_axis`` of ``mesh``.

    Equal to the one-device loss (every normaliser is a whole-batch figure; ``num_items_in_batch``
    is the whole batch's). Inputs may arrive with any sharding, on a mesh of Auto or Explicit
    axes (``jax.make_mesh``'s default): they are moved to the layout below (by ``shard_map``
    itself, or by ``jax.reshard`` on Explicit axes); nothing of size ``[B, T, V]`` is gathered.

    Layout inside: ``logits`` ``P(batch_axes, None, vocab_axis)``; ``[B, T]`` inputs (packed
    rows' segment ids too) and the per-token metrics ``P(batch_axes, None)``; ``advantages``
    ``P(batch_axes)`` (``[B, T]`` ones as the other ``[B, T]`` inputs); the loss and the
    scalar metrics replicated. The gradient w.r.t. ``logits`` has the logits' layout.

    The other arguments are those of :func:`grpo_kernels.grpo_loss` (``options`` apply to each
    device's block).

    Args:
      mesh: The device mesh.
      sharding: Which mesh axes split ``B`` and ``V``.

    Raises:
      ValueError: bad arguments (as ``grpo_loss``), a mesh without the named axes, or ``B``/``V``
        not divisible by their axes (nothing is padded).

    Examples:
      The batch over ``dp``, the vocabulary over ``tp`` (on however many devices there are;
      one is a mesh of size 1), equal to the one-device loss:

      >>> import jax, jax.numpy as jnp
      >>> from grpo_kernels import GRPOLossConfig, grpo_loss
      >>> from grpo_kernels.sharding import ShardingSpec, mesh_from_shape
      >>> mesh = mesh_from_shape((jax.device_count(), 1), ("dp", "tp"))
      >>> b, t, v = 2 * jax.device_count(), 3, 16
      >>> z = jax.random.normal(jax.random.key(0), (b, t, v))
      >>> ids, mask = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t))
      >>> adv = jnp.linspace(-1.0, 1.0, b)
      >>> cfg = GRPOLossConfig()
      >>> loss, _ = sharded_grpo_loss(z, ids, mask, adv, mesh=mesh,
      ...                             sharding=ShardingSpec("dp", "tp"), config=cfg)
      >>> bool(jnp.allclose(loss, grpo_loss(z, ids, mask, adv, config=cfg)[0], atol=1e-6))
      True
    """
    validate_token_inputs(logits, ids, mask, advantages, config, old_logps, ref_logps,
                          sampler_weights, sampler_logps, segments)
    b, _, vocab = logits.shape
    spec = resolve(sharding, mesh, b, vocab, "logits")
    impl = resolve_impl(impl, options, logits_api.OPTION_TYPES, logits_api.default_impl)
    trunc = mesh_truncation(config_truncation(config, vocab), spec, impl,
                            "sharded_grpo_loss")
    softcap = check_softcap(logit_softcap)
    if check_ids:
        check_ids_in_range(ids, mask, vocab)
    batch = TokenBatch.of(ids, mask, advantages, old_logps, ref_logps, num_items_in_batch,
                          sampler_weights, sampler_logps, segments)
    return _run((logits,), batch, op=logits_kind(softcap), primal_specs=(spec.logits(),),
                mesh=mesh, spec=spec, config=config, impl=impl, options=options, vocab=vocab,
                default_options=logits_pallas.PallasOptions(), trunc=trunc)


def sharded_grpo_loss_from_hidden(hidden: Array, lm_head: Array, ids: Array, mask: Array,
                                  advantages: Array, *, mesh: Mesh, sharding: ShardingSpec,
                                  config: GRPOLossConfig, old_logps: Array | None = None,
                                  ref_logps: Array | None = None,
                                  num_items_in_batch: Array | float | None = None,
                                  sampler_weights: Array | None = None,
                                  sampler_logps: Array | None = None,
                                  segments: Segments | None = None,
                                  impl: str = "auto", lm_head_layout: str = "hv",
                                  bias: Array | None = None, logits_dtype: Any = None,
                                  check_ids: bool = False, options: Any = None,
                                  logit_softcap: float | None = None
                                  ) -> tuple[Array, dict[str, Array]]:
    """:func:`grpo_kernels.grpo_loss_from_hidden` with ``B`` split over ``sharding.batch_axes``
    and the head's ``V`` over ``sharding.vocab_axis`` (a tensor-parallel head).

    Equal to the one-device loss; no ``[B, T, V]`` array exists on any device and nothing
    vocabulary-sized is gathered. Layout inside: ``hidden`` ``P(batch_axes, None, None)``, or
    for the xla head when ``T`` divides by the vocab axis ``P(batch_axes, vocab_axis, None)``
    (sequence-parallel: each chunk's rows are gathered and its ``dhidden`` scattered back, so
    no device holds ``[T, H]``; :func:`sequence_split`); ``lm_head`` ``P(None, vocab_axis)``
    for ``"hv"`` or ``P(vocab_axis, None)`` for ``"vh"``, and for the xla head with
    ``sharding.head_axes`` its ``H`` over those axes too (FSDP weights: gathered one block of
    vocabulary columns at a time, never whole); ``bias`` ``P(vocab_axis)``; the rest as
    :func:`sharded_grpo_loss`. Gradients come back in the inputs' layouts: ``dlm_head``
    sharded on ``V`` (summed over the batch axes; with ``head_axes`` on ``H`` too),
    ``dhidden`` on ``B`` (and ``T`` when sequence-parallel; summed over the vocab axis).

    The other arguments are those of :func:`grpo_kernels.grpo_loss_from_hidden`.

    Args:
      mesh: The device mesh.
      sharding: Which mesh axes split ``B`` and ``V``.

    Raises:
      ValueError: bad arguments, a mesh without the named axes, or ``B``/``V`` (or, with
        ``head_axes``, ``H``) not divisible by their axes (nothing is padded).

    Examples:
      A head placed FSDP-style, ``H`` over the batch axis too (``head_axes``), as tunix
      places one; its gradient comes back in that layout:

      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding
      >>> from grpo_kernels import GRPOLossConfig, grpo_loss_from_hidden
      >>> from grpo_kernels.sharding import ShardingSpec, mesh_from_shape
      >>> n = jax.device_count()
      >>> mesh = mesh_from_shape((n, 1), ("fsdp", "tp"))
      >>> spec = ShardingSpec("fsdp", "tp", head_axes="fsdp")
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> h = jax.random.normal(k1, (2 * n, 3, 8 * n))
      >>> w = jax.device_put(jax.random.normal(k2, (8 * n, 32)),
      ...                    NamedSharding(mesh, spec.head("hv")))
      >>> ids, mask = jnp.zeros((2 * n, 3), jnp.int32), jnp.ones((2 * n, 3))
      >>> adv = jnp.linspace(-1.0, 1.0, 2 * n)
      >>> cfg = GRPOLossConfig()
      >>> def loss(w):
      ...     return sharded_grpo_loss_from_hidden(h, w, ids, mask, adv, mesh=mesh,
      ...                                          sharding=spec, config=cfg, impl="xla")[0]
      >>> dw = jax.jit(jax.grad(loss))(w)
      >>> want = jax.grad(lambda w: grpo_loss_from_hidden(h, w, ids, mask, adv, config=cfg)[0])(w)
      >>> bool(jnp.allclose(dw, want, atol=1e-5))
      True
    """
    impl = resolve_impl(impl, options, head_api.OPTION_TYPES, head_api.default_impl)
    fmt = head_api.validate_call(hidden, lm_head, ids, mask, advantages, config, old_logps,
                                 ref_logps, lm_head_layout, bias, logits_dtype,
                                 sampler_weights, sampler_logps, logit_softcap, segments)
    vocab = fmt.vocab(lm_head)
    spec = resolve(sharding, mesh, hidden.shape[0], vocab, "hidden/lm_head")
    trunc = mesh_truncation(config_truncation(config, vocab), spec, impl,
                            "sharded_grpo_loss_from_hidden")
    spec = head_spec(spec, mesh, impl, hidden.shape[-1])
    if check_ids:
        check_ids_in_range(ids, mask, vocab)
    batch = TokenBatch.of(ids, mask, advantages, old_logps, ref_logps, num_items_in_batch,
                          sampler_weights, sampler_logps, segments)
    seq = sequence_split(spec, mesh, hidden.shape[1], impl, options)
    primal_specs = (spec.rows(3) if seq is None else spec.steps(),
                    spec.head(fmt.layout), None if bias is None else spec.vector())
    return _run((hidden, lm_head, bias), batch, op=head_kind(fmt, seq),
                primal_specs=primal_specs, mesh=mesh, spec=spec, config=config, impl=impl,
                options=options, vocab=vocab,
                default_options=head_pallas.LmHeadPallasOptions(), trunc=trunc)
