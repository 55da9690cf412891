"""The forward-only log-prob ops under ``shard_map``: ``B`` over batch axes, ``V`` over a vocab
axis, the same body as the losses (:func:`grpo_kernels.sharding.kinds.statistics`).

Per device, the implementation's statistics of its block (logits ``[B/b, T, V/k]``, or hidden
states and a head shard) are combined across the vocab axis with ``[B/b, T]``-sized
collectives only (:mod:`grpo_kernels.sharding.vocab`); the log-probs come back
``P(batch_axes, None)``, equal to the one-device op's, and differentiable (the gradient piece
runs on the local block with the whole row's ``lse``). With a sampler's truncation (``top_k``,
``top_p``, ``min_p``) each device must hold whole rows (:mod:`grpo_kernels.sharding.truncation`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh

from grpo_kernels.compat import to_layout
from grpo_kernels.ops.lm_head_loss import api as head_api
from grpo_kernels.ops.lm_head_loss import pallas_tpu as head_pallas
from grpo_kernels.ops.logits_loss import api as logits_api
from grpo_kernels.ops.logits_loss import pallas as logits_pallas
from grpo_kernels.ops.core.truncation import Truncation
from grpo_kernels.ops.core.validate import check_softcap, resolve_impl
from grpo_kernels.ops.logps.api import (check_logits, check_temperature, check_token_ids,
                                        requested_truncation, results)
from grpo_kernels.sharding.kinds import (OpKind, head_kind, head_spec, logits_kind,
                                         sequence_split, statistics)
from grpo_kernels.sharding.spec import ShardingSpec, resolve
from grpo_kernels.sharding.truncation import mesh_truncation

Array = jax.Array


# What a call is compiled for (as grpo_kernels.sharding.loss.RUN_STATIC).
RUN_STATIC = ("op", "primal_specs", "mesh", "spec", "impl", "options", "vocab", "temperature",
              "return_entropy", "return_outside", "default_options", "trunc")


@functools.partial(jax.jit, static_argnames=RUN_STATIC)
def _run(primals: tuple, ids: Array, *, op: OpKind, primal_specs: tuple, mesh: Mesh,
         spec: ShardingSpec, impl: str, options: Any, vocab: int, temperature: float,
         return_entropy: bool, return_outside: bool, default_options: Any,
         trunc: Truncation | None) -> Array | tuple[Array, ...]:
    """``shard_map`` of :func:`~grpo_kernels.sharding.kinds.statistics` over ``mesh``, as one
    program (as :func:`grpo_kernels.sharding.loss._run`)."""
    interpreted = impl == "pallas" and bool((options or default_options).resolved_interpret())
    rows = spec.rows(2)

    def body(primals, ids):
        return statistics(primals, ids, op=op, spec=spec, impl=impl, options=options,
                          vocab=vocab, temperature=temperature, with_entropy=return_entropy,
                          trunc=trunc)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(primal_specs, rows),
                       out_specs=(rows, rows, None if trunc is None else rows),
                       check_vma=not interpreted)
    logp, ent, outside = fn(*to_layout((primals, ids), (primal_specs, rows), mesh))
    return results(logp, ent, outside, return_entropy, return_outside)


def sharded_token_logps(logits: Array, ids: Array, *, mesh: Mesh, sharding: ShardingSpec,
                        temperature: float = 1.0, return_entropy: bool = False,
                        impl: str = "auto", options: Any = None, check_ids: bool = False,
                        logit_softcap: float | None = None, top_k: int | None = None,
                        top_p: float | None = None, min_p: float | None = None,
                        return_outside: bool = False) -> Array | tuple[Array, ...]:
    """:func:`grpo_kernels.token_logps` with ``B`` split over ``sharding.batch_axes`` and ``V``
    over ``sharding.vocab_axis`` of ``mesh``.

    Layout inside: ``logits`` ``P(batch_axes, None, vocab_axis)``, ``ids`` and the results
    ``P(batch_axes, None)``; inputs in any other layout (on Auto or Explicit axes) are moved
    there first. Nothing vocabulary-sized crosses devices.

    The other arguments are those of :func:`grpo_kernels.token_logps` (``options`` apply to
    each device's block; ``top_k`` / ``top_p`` / ``min_p`` where each device holds whole
    rows, :mod:`grpo_kernels.sharding.truncation`).

    Args:
      mesh: The device mesh.
      sharding: Which mesh axes split ``B`` and ``V``.

    Raises:
      ValueError: bad arguments, a mesh without the named axes, ``B``/``V`` not divisible
        by their axes, or a truncation on a mesh that splits the rows.
    """
    b, t, vocab = check_logits(logits)
    tau = check_temperature(temperature)
    spec = resolve(sharding, mesh, b, vocab, "logits")
    impl = resolve_impl(impl, options, logits_api.OPTION_TYPES, logits_api.default_impl)
    trunc = mesh_truncation(requested_truncation(vocab, top_k, top_p, min_p, return_outside),
                            spec, impl, "sharded_token_logps")
    softcap = check_softcap(logit_softcap)
    ids = check_token_ids(ids, b, t, vocab, check_ids)
    return _run((logits,), ids, op=logits_kind(softcap), primal_specs=(spec.logits(),),
                mesh=mesh, spec=spec, impl=impl, options=options, vocab=vocab, temperature=tau,
                return_entropy=return_entropy, return_outside=return_outside,
                default_options=logits_pallas.PallasOptions(), trunc=trunc)


def sharded_token_logps_from_hidden(hidden: Array, lm_head: Array, ids: Array, *, mesh: Mesh,
                                    sharding: ShardingSpec, lm_head_layout: str = "hv",
                                    bias: Array | None = None, temperature: float = 1.0,
                                    logits_dtype: Any = None, logit_softcap: float | None = None,
                                    return_entropy: bool = False, impl: str = "auto",
                                    options: Any = None, check_ids: bool = False,
                                    top_k: int | None = None, top_p: float | None = None,
                                    min_p: float | None = None, return_outside: bool = False
                                    ) -> Array | tuple[Array, ...]:
    """:func:`grpo_kernels.token_logps_from_hidden` with ``B`` split over
    ``sharding.batch_axes`` and the head's ``V`` over ``sharding.vocab_axis``.

    Layouts inside as :func:`grpo_kernels.sharding.sharded_grpo_loss_from_hidden` (the xla head
    sequence-parallel over the vocab axis when ``T`` divides by it, or, with
    ``sharding.head_axes``, gathering the head block by block); results
    ``P(batch_axes, None)``. No device holds ``[B, T, V]`` or ``[T, V]``; the collectives are
    ``[B/b, T]``-sized (and, sequence-parallel, each chunk's hidden rows).

    The other arguments are those of :func:`grpo_kernels.token_logps_from_hidden`.

    Args:
      mesh: The device mesh.
      sharding: Which mesh axes split ``B`` and ``V``.

    Raises:
      ValueError: as :func:`sharded_token_logps`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from grpo_kernels import token_logps_from_hidden
      >>> from grpo_kernels.sharding import ShardingSpec, mesh_from_shape
      >>> n = jax.device_count()
      >>> mesh = mesh_from_shape((n, 1), ("dp", "tp"))
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> h, w = jax.random.normal(k1, (n, 4, 8)), jax.random.normal(k2, (8, 32))
      >>> ids = jnp.arange(4 * n).reshape(n, 4) % 32
      >>> logp = sharded_token_logps_from_hidden(h, w, ids, mesh=mesh,
      ...                                        sharding=ShardingSpec("dp", "tp"))
      >>> bool(jnp.allclose(logp, token_logps_from_hidden(h, w, ids), atol=1e-5))
      True
    """
    impl = resolve_impl(impl, options, head_api.OPTION_TYPES, head_api.default_impl)
    fmt = head_api.validate_head(hidden, lm_head, lm_head_layout, bias, logits_dtype,
                                 logit_softcap)
    b, t, _ = hidden.shape
    vocab = fmt.vocab(lm_head)
    tau = check_temperature(temperature)
    spec = resolve(sharding, mesh, b, vocab, "hidden/lm_head")
    trunc = mesh_truncation(requested_truncation(vocab, top_k, top_p, min_p, return_outside),
                            spec, impl, "sharded_token_logps_from_hidden")
    spec = head_spec(spec, mesh, impl, hidden.shape[-1])
    ids = check_token_ids(ids, b, t, vocab, check_ids)
    seq = sequence_split(spec, mesh, t, impl, options)
    primal_specs = (spec.rows(3) if seq is None else spec.steps(), spec.head(fmt.layout),
                    None if bias is None else spec.vector())
    return _run((hidden, lm_head, bias), ids, op=head_kind(fmt, seq),
                primal_specs=primal_specs, mesh=mesh, spec=spec, impl=impl, options=options,
                vocab=vocab, temperature=tau, return_entropy=return_entropy,
                return_outside=return_outside,
                default_options=head_pallas.LmHeadPallasOptions(), trunc=trunc)

