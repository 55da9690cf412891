"""The GRPO objective on per-token statistics ``[B, T]``: one copy of the math for every
implementation.

Every implementation of the loss (reference, chunked XLA, Pallas, fused LM head, sharded)
reduces the vocabulary to per-token log-probs and entropies and then calls this package, so
the math lives in one place. All inputs are upcast to float32.

- :mod:`.weights`: the per-token weights of every ``loss_type`` and aggregation;
- :mod:`.terms`: ratios, the per-token loss of every ``loss_type`` and the objective;
- :mod:`.factors`: the per-token factors of TRL's newer options (sampler correction,
  off-policy and high-entropy masks, VESPO's weight, the entropy bonus's weights);
- :mod:`.metrics`: TRL's metrics;
- :mod:`.segments`: packed rows (several sequences to a row) and their per-segment sums;
- :mod:`.batch`: ``TokenBatch``, a call's inputs besides the log-probs, as one pytree;
- :mod:`.gradient`: ``dL/dlogp`` and ``dL/dH`` as the fast implementations consume them.
"""

from grpo_kernels.objective.gradient import (
    RowGrad,
    entropy_bonus_grad,
    loss_from_token_stats,
    selected_row_grad,
    separable_given_selection,
    token_loss_grad,
    token_row_grad,
    token_separable,
)
from grpo_kernels.objective.metrics import loss_metrics, masked_mean
from grpo_kernels.objective.segments import Segments
from grpo_kernels.objective.base import BatchGather, BatchSum, advantage_columns
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.objective.terms import (
    grpo_objective,
    kl_divergence,
    kl_k3,
    log_importance_ratio,
    policy_factors,
    policy_term,
    token_terms,
    weighted_loss,
)
from grpo_kernels.objective.weights import token_weights

__all__ = [
    "BatchGather", "BatchSum", "RowGrad", "Segments", "TokenBatch", "advantage_columns",
    "entropy_bonus_grad", "grpo_objective",
    "kl_divergence", "kl_k3", "log_importance_ratio", "loss_from_token_stats", "loss_metrics",
    "masked_mean", "policy_factors", "policy_term", "selected_row_grad",
    "separable_given_selection", "token_loss_grad", "token_row_grad",
    "token_separable", "token_terms", "token_weights", "weighted_loss",
]
