r"""tunix's rollout sampling settings carried to our losses and log-prob pass.

tunix's development head takes the old policy's log-probs from the rollout where it returns
them (``GRPOConfig.use_rollout_logps``, default on, with ``RolloutConfig.return_logprobs``). A
vLLM rollout returns its processed log-probs by default (``rollout_vllm_logprobs_mode=
"processed_logprobs"``): those of the distribution it drew from, after ``temperature``,
``top_k`` and ``top_p``. tunix's losses and log-prob passes score the whole vocabulary, so the
importance ratio :math:`\pi_\theta / \pi_{old}` is biased at the first step, where the two are
one model. :func:`follow_sampler` gives our losses and our log-prob pass the sampler's
truncation, so both sides describe one distribution
(:mod:`grpo_kernels.ops.core.truncation`).

Which rollouts return what (read from tunix's code):

- ``"vllm"`` with ``processed_logprobs``: the truncated distribution; we follow it;
- ``"vllm"`` with another mode, ``"vanilla"`` (tunix's own sampler draws under top-k and top-p
  but returns the log-probs of the whole scaled row): the whole vocabulary; we keep it;
- anything else: not known; :func:`follow_sampler` raises.
"""

from __future__ import annotations

from typing import Any

from grpo_kernels.integrations.tunix.config import TRUNCATION_FIELDS, field
from grpo_kernels.integrations.tunix.log_probs import bound_options, patch_log_probs
from grpo_kernels.ops.core.truncation import Truncation

# tunix's rollout engines whose log-probs we know (processed_log_probs says which return the
# truncated distribution), and vLLM's mode that returns it.
ENGINES: tuple[str, ...] = ("vanilla", "vllm")
PROCESSED_MODE = "processed_logprobs"


def train_rollout_config(rollout_config: Any) -> Any:
    """The training mode's ``RolloutConfig``: ``rollout_config`` itself, or its entry for
    ``Mode.TRAIN`` when it is tunix's per-mode dict."""
    if not isinstance(rollout_config, dict):
        return rollout_config
    for mode, value in rollout_config.items():
        if str(getattr(mode, "value", mode)).lower() == "train":
            return value
    raise ValueError(f"rollout_config: a dict of modes without a training mode "
                     f"({list(rollout_config)})")


def sampler_truncation(rollout_config: Any) -> Truncation | None:
    """The truncation a tunix ``RolloutConfig`` samples under: its ``top_k`` (None or <= 0:
    off, as tunix) and ``top_p`` (None or 1: off), and a ``min_p`` where it has one; None when
    none of them drops a token.

    Raises:
      ValueError: naming the ``RolloutConfig`` field whose value is not a truncation.
    """
    top_k, top_p = field(rollout_config, "top_k"), field(rollout_config, "top_p")
    min_p = field(rollout_config, "min_p")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k <= 0:
        top_k = None
    try:
        trunc = Truncation(top_k, None if top_p in (None, 1, 1.0) else top_p, min_p or None)
    except ValueError as e:
        raise ValueError(f"RolloutConfig.{str(e).split(' ', 1)[0]}: {e}") from None
    return None if trunc == Truncation() else trunc


def processed_log_probs(engine: Any, rollout_config: Any) -> bool:
    """Whether ``engine``'s rollout under ``rollout_config`` returns the log-probs of the
    distribution it drew from (module docstring).

    Raises:
      ValueError: for an engine not in :data:`ENGINES` (a class of its own included).
    """
    if engine not in ENGINES:
        raise ValueError(f"rollout_engine: grpo_kernels knows the log-probs of {list(ENGINES)}'s "
                         f"rollouts, not {engine!r}'s; bind a truncation yourself "
                         f"(patch_log_probs(truncation=...) and top_k / top_p / min_p on the "
                         f"GRPOConfig) if it returns processed log-probs")
    mode = field(rollout_config, "rollout_vllm_logprobs_mode", PROCESSED_MODE)
    return engine == "vllm" and mode == PROCESSED_MODE


def follow_sampler(algo_config: Any, cluster_config: Any) -> Truncation | None:
    """Makes our losses and our log-prob pass score the distribution tunix's rollout drew
    from, and returns its truncation (None: the whole vocabulary).

    Reads ``cluster_config.rollout_engine`` and its (training mode's) ``rollout_config``. For a
    rollout that returns processed log-probs (:func:`processed_log_probs`) the sampler's
    truncation (:func:`sampler_truncation`) is set as ``top_k`` / ``top_p`` / ``min_p`` on
    ``algo_config`` (the ``GRPOConfig`` our registered losses read, as tunix's learner sets its
    ``temperature`` from the rollout) and bound into our log-prob pass (:func:`~grpo_kernels.
    integrations.tunix.patch_log_probs`, keeping its ``impl`` and ``options``; bound with the
    defaults where it was not), so the reference's, the old policy's and the policy losses'
    log-probs all describe that distribution. Otherwise the three fields are set to None and
    the pass keeps the whole vocabulary. Call it before the learner is built.

    Raises:
      ValueError: for a rollout engine whose log-probs we do not know, or a truncation setting
        out of range, naming the field.
    """
    rollout = train_rollout_config(cluster_config.rollout_config)
    engine = field(cluster_config, "rollout_engine", "vanilla")
    trunc = sampler_truncation(rollout) if processed_log_probs(engine, rollout) else None
    for name in TRUNCATION_FIELDS:
        setattr(algo_config, name, None if trunc is None else getattr(trunc, name))
    bound = bound_options() or {"impl": "auto", "options": None}
    patch_log_probs(bound["impl"], bound["options"], trunc)
    return trunc
