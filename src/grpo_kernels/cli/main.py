"""The ``grpo-kernels`` command."""

from __future__ import annotations

import argparse
import sys

from grpo_kernels import __version__
from grpo_kernels.cli import bench, bench_lm_head, gradcheck, proof, train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpo-kernels",
        description="Fast, memory-light GRPO policy losses for JAX: gradcheck, benchmarks, "
                    "the accelerator proof, GRPO training and A/B runs.",
    )
    p.add_argument("--version", action="version", version=f"grpo-kernels {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    gradcheck.add_parser(sub)
    bench.add_parser(sub)
    bench_lm_head.add_parser(sub)
    proof.add_parser(sub)
    train.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:
        print(f"grpo-kernels {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
