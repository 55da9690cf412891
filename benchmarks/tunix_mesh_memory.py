"""Per-device planned temporaries of a tunix GRPO iteration on a mesh: tunix's own against ours.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 benchmarks/tunix_mesh_memory.py
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 benchmarks/tunix_mesh_memory.py \\
        --hidden 2048 --mesh 8x1 --tokens 8192

Compile-only, on simulated CPU devices: a tunix Qwen3 with the head of Qwen3-8B (H = 4096,
untied) or Qwen3-1.7B (H = 2048, tied) and no decoder layers (as ``tunix_memory.py``: the head
and the loss, not attention), its parameters placed by their own partition specs over an
``fsdp x tp`` mesh and its activations constrained by its own ``ShardingConfig`` as on an
accelerator (tunix's ``shard`` is a no-op on CPU; here it constrains), the mesh entered as
tunix's RLCluster enters it. ``--rows`` sequences of ``--prompt`` + ``--tokens`` tokens, bf16.

Per device, ``memory_analysis().temp_size_in_bytes`` of: the actor update (``jit`` of
``value_and_grad`` of the policy loss w.r.t. the trained parameters, the untied input
embedding frozen as in ``tunix_memory.py``) with tunix's ``"grpo"``, our ``"grpo_kernels"`` and
``"grpo_kernels_fused"`` (which read the mesh and go through our shard_map ops); and the log-prob
pass (``compute_per_token_logps``) of tunix and ours (``patch_log_probs``'s function).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from grpo_kernels.rl.run_dir import write_json

SHAPES = {2048: ("Qwen3-1.7B", True), 4096: ("Qwen3-8B", False)}


def _activation_constraints() -> None:
    """tunix's Qwen3 ``shard`` as on an accelerator: constrain to the mesh in context."""
    import jax
    from jax.interpreters import pxla
    from jax.sharding import NamedSharding, PartitionSpec
    from tunix.models.qwen3 import model as qwen3

    def shard(x, s):
        mesh = pxla.thread_resources.env.physical_mesh
        return x if mesh.empty else jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, PartitionSpec(*s)))
    qwen3.shard = shard


def plan(hidden: int, vocab: int, rows: int, prompt: int, tokens: int, mesh) -> dict[str, int]:
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import common, function_registry
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    from grpo_kernels.integrations import tunix as ours

    tied = SHAPES.get(hidden, ("", True))[1]
    config = qwen3.ModelConfig(
        num_layers=0, vocab_size=vocab, embed_dim=hidden, hidden_dim=4 * hidden, num_heads=16,
        head_dim=128, num_kv_heads=8, rope_theta=1_000_000, norm_eps=1e-6,
        use_tied_embedding=tied, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0)))
    trained = nnx.Param if tied else nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embedder")))
    graphdef, params, rest = nnx.split(model, trained, ...)

    def placed(state):
        specs = nnx.get_partition_spec(state)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
            NamedSharding(mesh, s if s is not None else PartitionSpec()))), state, specs)
    params, rest = placed(params), placed(rest)
    rows_spec = NamedSharding(mesh, PartitionSpec("fsdp"))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rows_spec)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=rows_spec)  # noqa: E731
    example = common.TrainExample(
        prompt_ids=i32(rows, prompt), prompt_mask=i32(rows, prompt),
        completion_ids=i32(rows, tokens), completion_mask=i32(rows, tokens),
        advantages=f32(rows), ref_per_token_logps=f32(rows, tokens),
        old_per_token_logps=f32(rows, tokens))
    algo = GRPOConfig(num_generations=2, beta=0.04)
    algo.temperature = 1.0
    out = {}
    for name in ("grpo", "grpo_kernels", "grpo_kernels_fused"):
        fn = function_registry.get_policy_loss_fn(name)

        def loss(p, frozen, ex, fn=fn):
            return ours.differentiated(fn(nnx.merge(graphdef, p, frozen), ex, algo, 0, 1))
        with mesh:
            compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rest, example).compile()
        out[f"update {name}"] = compiled.memory_analysis().temp_size_in_bytes
    graph_all, state = nnx.split(model)
    state = placed(state)
    for name, fn in (("tunix", common.compute_per_token_logps),
                     ("ours", ours.log_probs_function())):
        step = jax.jit(functools.partial(lambda f, st, p, c: f(graph_all, st, p, c, 0, 1), fn))
        with mesh:
            compiled = step.lower(state, example.prompt_ids, example.completion_ids).compile()
        out[f"logps {name}"] = compiled.memory_analysis().temp_size_in_bytes
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096],
                   help="head widths H (2048: Qwen3-1.7B, tied; 4096: Qwen3-8B, untied)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="completion tokens T")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens P (default 128)")
    p.add_argument("--rows", type=int, default=4, help="sequences B (default 4)")
    p.add_argument("--mesh", default="4x2", help="fsdp x tp (default 4x2)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    try:
        fsdp, tp = (int(x) for x in args.mesh.split("x"))
    except ValueError:
        p.error(f"--mesh wants FSDPxTP, e.g. 4x2, got {args.mesh!r}")
    import jax
    from jax.sharding import AxisType

    if jax.device_count() < fsdp * tp:
        p.error(f"--mesh {args.mesh} needs {fsdp * tp} devices, found {jax.device_count()} "
                f"(set XLA_FLAGS=--xla_force_host_platform_device_count={fsdp * tp})")
    mesh = jax.make_mesh((fsdp, tp), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    _activation_constraints()
    jax.config.update("jax_numpy_dtype_promotion", "standard")
    rows = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            start = time.perf_counter()
            row = {"hidden": hidden, "tokens": tokens, "prompt": args.prompt, "rows": args.rows,
                   "vocab": args.vocab, "mesh": args.mesh, "per_device_temp_bytes":
                   plan(hidden, args.vocab, args.rows, args.prompt, tokens, mesh)}
            print(f"  planned H={hidden} T={tokens} in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)
            rows.append(row)
            t = row["per_device_temp_bytes"]
            print(json.dumps(row), flush=True)
            print(f"| {SHAPES.get(hidden, ('custom',))[0]} | {args.mesh} | {tokens:,} | "
                  + " | ".join(f"{k}: {v / 2**30:.2f} GiB" for k, v in t.items())
                  + f" | update fused / grpo {t['update grpo_kernels_fused'] / t['update grpo']:.3f}"
                  f" | logps ours / tunix {t['logps ours'] / t['logps tunix']:.3f} |",
                  flush=True)
    if args.json:  # whole or not at all: a crash leaves no half-written file
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
