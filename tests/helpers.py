"""Shared test helpers."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels import GRPOLossConfig, grpo_loss
from grpo_kernels.cli.gradcheck import family_configs
from grpo_kernels.config import CLASSIC_LOSS_TYPES, LOSS_AGG_MODES


GRID_LEVELS = (CLASSIC_LOSS_TYPES, ("token", "sequence"), (0.0, 0.04), (None, 2.0), (1.0, 0.7))


def _grid_config(time: int, lt, lvl, beta, delta, temp) -> GRPOLossConfig:
    return GRPOLossConfig(loss_type=lt, importance_sampling_level=lvl, beta=beta, delta=delta,
                          temperature=temp, max_completion_length=time)


def loss_grid(time: int):
    """The grid: loss_type x level x beta x delta x temperature."""
    for values in itertools.product(*GRID_LEVELS):
        yield _grid_config(time, *values)


def loss_grid_split(time: int, dtypes: tuple = (jnp.float32, jnp.bfloat16)):
    """Every config of :func:`loss_grid` once, each paired with one of ``dtypes``.

    The dtype is the sum of the config's level indices modulo ``len(dtypes)``, so every level of
    every factor, and every pair of levels of two factors, meets every dtype (a parity split
    on one factor alone, say index parity, would tie float32 to one temperature).
    """
    for index in itertools.product(*(range(len(levels)) for levels in GRID_LEVELS)):
        values = [levels[i] for levels, i in zip(GRID_LEVELS, index, strict=True)]
        yield _grid_config(time, *values), dtypes[sum(index) % len(dtypes)]


def option_grid(time: int) -> list[tuple[GRPOLossConfig, bool]]:
    """The options beyond TRL's loss grid (tunix's aggregations, KL estimators and clamp, dual
    clip, log-ratio clamps, GSPO-token), each on its own and in a tunix-like mix, as
    ``(config, with_sampler_weights)``. With :func:`random_inputs`' ``noise=0.3`` every clamp and
    clip here is active on some tokens."""
    base = dict(beta=0.04, temperature=0.7, max_completion_length=time, epsilon_high=0.28)
    variants = [
        *({"loss_agg_mode": mode} for mode in LOSS_AGG_MODES),
        {"kl_estimator": "k1"}, {"kl_estimator": "k2"}, {"kl_clamp": 0.02},
        {"dual_clip": 1.2}, {"log_ratio_clamp": 0.25},
        {"importance_sampling_level": "sequence", "log_ratio_clamp": 0.25,
         "sequence_log_ratio_max": 0.05},
        {"importance_sampling_level": "sequence_token"},
        {"importance_sampling_level": "sequence_token", "sequence_log_ratio_max": 0.05},
        {"importance_sampling_level": "sequence_token", "loss_agg_mode": "seq-mean-token-sum",
         "kl_estimator": "k1", "dual_clip": 1.2, "log_ratio_clamp": 0.25,
         "sequence_log_ratio_max": 0.1, "loss_type": "dr_grpo"},
    ]
    return [(GRPOLossConfig(**{**base, **v}), i % 2 == 1) for i, v in enumerate(variants)]


def option_id(item) -> str:
    cfg, sampler = item
    fields = ("loss_agg_mode", "kl_estimator", "kl_clamp", "dual_clip", "log_ratio_clamp",
              "sequence_log_ratio_max")
    parts = [cfg.importance_sampling_level] + [
        f"{f}={getattr(cfg, f)}" for f in fields
        if getattr(cfg, f) != GRPOLossConfig.__dataclass_fields__[f].default]
    return "-".join(parts) + ("-sampler" if sampler else "")


def family_grid(time: int) -> list[GRPOLossConfig]:
    """The 2026 family's variants at token and sequence level (gradcheck's
    :data:`~grpo_kernels.cli.gradcheck.FAMILY_VARIANTS`), with ``beta`` where it is off."""
    return list(family_configs(GRPOLossConfig(max_completion_length=time), time))


_FAMILY_FIELDS = ("loss_type", "sampler_correction", "off_policy_mask_threshold",
                  "kl_bias_correction", "entropy_coef", "top_entropy_quantile", "beta")


def family_id(cfg: GRPOLossConfig) -> str:
    defaults = GRPOLossConfig.__dataclass_fields__
    parts = [f"{f}={getattr(cfg, f)}" for f in _FAMILY_FIELDS
             if getattr(cfg, f) != defaults[f].default]
    return "-".join([cfg.importance_sampling_level, *parts])


def dtype_id(dtype) -> str:
    """A test id's name of a float dtype: ``"f32"`` or ``"bf16"``."""
    return "f32" if dtype == jnp.float32 else "bf16"


def grid_id(cfg: GRPOLossConfig) -> str:
    return (f"{cfg.loss_type}-{cfg.importance_sampling_level}-b{cfg.beta}-d{cfg.delta}"
            f"-t{cfg.temperature}")


_REFERENCE_RESULTS: dict[tuple, Any] = {}


def fingerprint(tree: Any) -> str:
    """A digest of every array leaf of ``tree``: its path, dtype, shape and bytes (a
    dataclass of arrays is taken field by field)."""
    if dataclasses.is_dataclass(tree):
        tree = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    digest = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}{a.dtype}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


# The reference runs op by op where it is what a fast implementation is compared with
# (reference_value_and_grad, and the head's in tests/ops/lm_head_loss): each of its primitives
# is compiled once per shape and dtype and shared by every test of the run, where a jitted
# reference compiles one whole program per config (a third of a grid test's time). The
# operations and their float32 arithmetic are the same; only XLA's fusion of them into one
# program is not done.
def cached_reference(key: tuple, inputs: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per ``key`` and input values in this process: the reference results
    that several implementations (or kernels) are compared with.

    ``key`` holds the config and options (hashable); the inputs are keyed by their values, so a
    test that edits an input gets a fresh result.
    """
    full = (key, fingerprint(inputs))
    if full not in _REFERENCE_RESULTS:
        _REFERENCE_RESULTS[full] = compute()
    return _REFERENCE_RESULTS[full]


def reference_value_and_grad(inp, cfg, jit=False, **kw):
    """:func:`value_and_grad` of the reference implementation, cached per config and inputs.

    Op by op unless ``jit`` (the comment above :func:`cached_reference`)."""
    key = ("logits", cfg, tuple(sorted(kw.items())))
    return cached_reference(key, inp, lambda: value_and_grad("reference", inp, cfg, jit=jit,
                                                             **kw))


# The GPU a CUDA lowering is planned for when the host has none (jax >= 0.12's Triton lowering
# asks which GPU it compiles for).
ABSTRACT_GPU = dict(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")


@contextlib.contextmanager
def every_platform() -> Iterator[None]:
    """Traces every platform's branch of :func:`~grpo_kernels.ops.core.platform.by_platform`
    within: the suite stages out only the CPU's (tests/conftest.py), and a program traced
    here may be lowered for a GPU or a TPU."""
    from grpo_kernels.ops.core.platform import ENV
    before = os.environ.pop(ENV, None)
    try:
        yield
    finally:
        if before is not None:
            os.environ[ENV] = before


@every_platform()
def cuda_export(fn: Callable, *args) -> Any:
    """``jax.export(fn, platforms=["cuda"])(*args)`` with Triton custom calls allowed (they
    carry no serialization-compatibility promise; lowering is what counts). Where this jax
    asks for a GPU to lower Pallas's Triton kernels for (0.12: "No supported GPU devices
    found"), it is lowered again for an abstract H100 (:data:`ABSTRACT_GPU`). Skips where this
    jaxlib cannot lower Triton kernels at all."""
    import pytest
    from jax.sharding import AbstractDevice, AbstractMesh

    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    export = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)
    try:
        try:
            return export(*args)
        except Exception as e:  # noqa: BLE001 - only the "which GPU" error is retried
            if "AbstractDevice" not in str(e) and "No supported GPU" not in str(e):
                raise
        mesh = AbstractMesh((1,), ("gpu",), abstract_device=AbstractDevice(**ABSTRACT_GPU))
        with jax.sharding.use_abstract_mesh(mesh):
            return export(*args)
    except ValueError as e:
        if "install jaxlib GPU" in str(e):
            pytest.skip("this jaxlib cannot lower Pallas GPU (Triton) kernels without the CUDA "
                        "plugin; the interpret-mode tests cover the kernels' numerics")
        raise


def cuda_module(fn: Callable, *args) -> str:
    """The MLIR text of :func:`cuda_export` of ``jax.jit(fn)``."""
    return cuda_export(jax.jit(fn), *args).mlir_module()


def value_and_grad(impl, inp, cfg, jit=True, **kw):
    def fn(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl=impl,
                         **inp.kwargs(), **kw)

    f = jax.value_and_grad(fn, has_aux=True)
    if jit:
        f = jax.jit(f)
    (loss, metrics), grad = f(inp.logits)
    return loss, metrics, grad


def as64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def rel_err(a, b) -> float:
    a, b = as64(a), as64(b)
    scale = np.max(np.abs(b))
    err = np.max(np.abs(a - b))
    assert np.isfinite(err), "non-finite values"
    return float(err / scale) if scale > 0 else float(err)


def take_plan_of(monkeypatch, module: Any, kind: str) -> None:
    """Has ``module``'s :func:`~grpo_kernels.ops.core.platform.by_platform` run ``kind``'s
    branch on this host: the code a lowering for a ``kind`` platform keeps, its numerics
    checked here."""
    monkeypatch.setattr(module, "by_platform", lambda fn, plan, *args: fn(plan(kind), *args))


@every_platform()
def lowered_text(fn: Callable, *args: Any, platform: str) -> str:
    """The StableHLO of ``jit(fn)(*args)`` lowered for ``platform`` (no device needed)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def pairwise(*factors) -> list[tuple]:
    """A subset of ``itertools.product(*factors)`` in which every pair of levels of every two
    factors occurs at least once (greedy: each next case covers the most uncovered pairs, the
    first in product order on a tie; deterministic)."""
    cases = list(itertools.product(*factors))
    pairs = lambda c: {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}  # noqa: E731
    uncovered = set().union(*(pairs(c) for c in cases))
    chosen = []
    while uncovered:
        best = max(cases, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def objective(logp, mask, advantages, config, old_logps=None, ref_logps=None, entropy=None,
              **inputs):
    """:func:`grpo_kernels.objective.grpo_objective` of these inputs (``inputs``: the other
    fields of :meth:`~grpo_kernels.objective.TokenBatch.of`), in a batch whose ids are zeros:
    the objective does not read them."""
    from grpo_kernels.objective import TokenBatch, grpo_objective

    batch = TokenBatch.of(jnp.zeros(mask.shape, jnp.int32), mask, advantages, old_logps,
                          ref_logps, **inputs)
    return grpo_objective(logp, batch, config, entropy)
