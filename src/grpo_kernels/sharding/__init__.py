"""Multi-device GRPO losses: ``shard_map`` over batch axes and a vocabulary axis.

Pallas calls are not partitioned by XLA, so every implementation runs per device inside an
explicit ``shard_map``; see ``docs/sharding.md`` for mesh recipes and communication volumes.
"""

from grpo_kernels.sharding.logps import sharded_token_logps, sharded_token_logps_from_hidden
from grpo_kernels.sharding.loss import sharded_grpo_loss, sharded_grpo_loss_from_hidden
from grpo_kernels.sharding.spec import ShardingSpec, mesh_from_shape

__all__ = ["ShardingSpec", "mesh_from_shape", "sharded_grpo_loss",
           "sharded_grpo_loss_from_hidden", "sharded_token_logps",
           "sharded_token_logps_from_hidden"]
