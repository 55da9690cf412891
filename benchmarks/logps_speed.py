"""Time of the forward-only log-prob ops against the plain programs they replace, one process.

    python3 benchmarks/logps_speed.py                     # both ops at the issue's shapes
    python3 benchmarks/logps_speed.py --op hidden --rows 2048 --hidden 512 --vocab 32768
    python3 benchmarks/logps_speed.py --easydel /tmp/easydel   # + EasyDeL 0.3.0's chunked ops
    python3 benchmarks/logps_speed.py --op hidden --top-k 50 --top-p 0.95   # + truncated

``--op logits`` (``[B, T, V]`` logits, ``--dtype``): ``grpo_kernels.token_logps`` (impl
``--impls``) against the plain float32 ``log_softmax`` and gather that a trainer writes
(``jax.nn.log_softmax`` then ``take_along_axis``; tunix's ``selective_log_softmax`` is the same
program: a float32 copy, a logsumexp and a gather). ``--op hidden`` (``[N, H]`` hidden states,
an ``[H, V]`` head): ``grpo_kernels.token_logps_from_hidden`` against one ``[N, H] x [H, V]``
matmul (float32 accumulation: the floor of any log-prob pass through the head) and against the
matmul followed by the plain log-softmax. Every contender is jitted and timed in this process,
in turn, by the median of ``--iters`` calls after ``--warmup``; the ratios are to the first
contender (the plain program). Inputs are random (logits of standard deviation about 2).

Peers, where present: tunix's own ``selective_log_softmax`` (``--op logits``, when google-tunix
is installed), and with ``--easydel DIR`` (an unpacked ``easydel`` 0.3.0 wheel: ``pip download
--no-deps easydel==0.3.0`` then ``unzip``) EasyDeL's chunked log-prob functions from
``easydel/trainers/_logprob_utils.py``, loaded alone (they need only ``jax`` and
``jaxtyping``, not the rest of EasyDeL): ``compute_token_logps_and_entropies_chunked`` on the
logits, ``compute_per_token_logps_and_entropies_from_hidden_states`` on the hidden states
(through a stand-in model whose ``compute_lm_logits`` is the same matmul), with the chunk sizes
``--easydel-vocab-chunk`` and ``--easydel-token-chunk`` (EasyDeL's own defaults leave chunking
off).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

from grpo_kernels.proof.timing import median_ms
from grpo_kernels.rl.run_dir import write_json


def plain_logps(z, ids):
    """The float32 log-softmax and gather a trainer writes."""
    logsm = jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logsm, ids[..., None], axis=-1)[..., 0]


def easydel_logprob_utils(root: str):
    """EasyDeL's ``trainers/_logprob_utils.py`` under ``root``, imported as a lone module."""
    path = pathlib.Path(root) / "easydel" / "trainers" / "_logprob_utils.py"
    if not path.is_file():
        raise SystemExit(f"--easydel: no {path} (unzip the easydel 0.3.0 wheel into {root})")
    spec = importlib.util.spec_from_file_location("easydel_logprob_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Head:
    """A stand-in for an EasyDeL model: ``compute_lm_logits`` is the head's matmul."""

    def __init__(self, w):
        self.w = w

    def compute_lm_logits(self, h):
        return jnp.einsum("bnh,hv->bnv", h, self.w, preferred_element_type=jnp.float32)


def contenders(args) -> tuple[dict, tuple]:
    """``({name: jitted fn}, args)`` of ``--op``."""
    from grpo_kernels import token_logps, token_logps_from_hidden

    dtype = jnp.dtype(args.dtype)
    k = jax.random.split(jax.random.key(0), 3)
    impls = [s for s in args.impls.split(",") if s]
    if args.op == "logits":
        z = (2 * jax.random.normal(k[0], (args.batch, args.time, args.vocab))).astype(dtype)
        ids = jax.random.randint(k[1], (args.batch, args.time), 0, args.vocab)
        fns = {"plain log_softmax + gather": jax.jit(plain_logps)}
        try:
            from tunix.rl.common import selective_log_softmax
            fns["tunix selective_log_softmax"] = jax.jit(selective_log_softmax)
        except ImportError:
            pass
        if args.easydel:
            chunked = easydel_logprob_utils(args.easydel).compute_token_logps_and_entropies_chunked
            fns[f"easydel chunked (vocab {args.easydel_vocab_chunk})"] = jax.jit(
                lambda z, ids: chunked(z, ids, return_entropy=False,
                                       chunk_size=args.easydel_vocab_chunk)[0])
        for impl in impls:
            for name, kw in _truncations(args):
                fns[f"token_logps {impl}{name}"] = jax.jit(
                    lambda z, ids, impl=impl, kw=kw: token_logps(z, ids, impl=impl, **kw))
        return fns, (z, ids)
    h = jax.random.normal(k[0], (1, args.rows, args.hidden)).astype(dtype)
    w = (2 * jax.random.normal(k[1], (args.hidden, args.vocab)) / args.hidden ** 0.5
         ).astype(dtype)
    ids = jax.random.randint(k[2], (1, args.rows), 0, args.vocab)
    matmul = jax.jit(lambda h, w, ids: jnp.einsum("bnh,hv->bnv", h, w,
                                                  preferred_element_type=jnp.float32))
    fns = {"one matmul": matmul,
           "matmul + plain log_softmax": jax.jit(lambda h, w, ids: plain_logps(
               jnp.einsum("bnh,hv->bnv", h, w, preferred_element_type=jnp.float32), ids))}
    if args.easydel:
        from_hidden = easydel_logprob_utils(
            args.easydel).compute_per_token_logps_and_entropies_from_hidden_states
        fns[f"easydel from hidden (tokens {args.easydel_token_chunk}, vocab "
            f"{args.easydel_vocab_chunk})"] = jax.jit(lambda h, w, ids: from_hidden(
                _Head(w), h, ids, token_chunk_size=args.easydel_token_chunk,
                vocab_chunk_size=args.easydel_vocab_chunk, return_entropy=False)[0])
    for impl in impls:
        for name, kw in _truncations(args):
            fns[f"token_logps_from_hidden {impl}{name}"] = jax.jit(
                lambda h, w, ids, impl=impl, kw=kw: token_logps_from_hidden(h, w, ids,
                                                                            impl=impl, **kw))
    return fns, (h, w, ids)


def _truncations(args) -> list[tuple[str, dict]]:
    """Our contenders' options: none, and with ``--top-k/--top-p/--min-p`` also those (the
    log-probs of the sampler's truncated distribution)."""
    kw = {k: v for k, v in (("top_k", args.top_k), ("top_p", args.top_p),
                            ("min_p", args.min_p)) if v is not None}
    out = [("", {})]
    if kw:
        out.append((" " + ", ".join(f"{k}={v}" for k, v in kw.items()), kw))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--op", choices=["logits", "hidden", "both"], default="both")
    p.add_argument("--batch", type=int, default=4, help="--op logits: B (default 4)")
    p.add_argument("--time", type=int, default=1024, help="--op logits: T (default 1024)")
    p.add_argument("--rows", type=int, default=2048, help="--op hidden: N (default 2048)")
    p.add_argument("--hidden", type=int, default=512, help="--op hidden: H (default 512)")
    p.add_argument("--vocab", type=int, default=32768, help="V (default 32768)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--impls", default="xla", help="our implementations, comma-separated "
                   "(default: xla)")
    p.add_argument("--easydel", metavar="DIR",
                   help="also time EasyDeL 0.3.0's chunked log-prob functions from the wheel "
                   "unpacked in DIR")
    p.add_argument("--easydel-vocab-chunk", type=int, default=8192,
                   help="EasyDeL's vocabulary chunk (default 8192)")
    p.add_argument("--easydel-token-chunk", type=int, default=512,
                   help="EasyDeL's token chunk from hidden states (default 512)")
    p.add_argument("--top-k", type=int, help="also time ours with this top_k (and the "
                   "other truncation options given)")
    p.add_argument("--top-p", type=float, help="also time ours with this top_p")
    p.add_argument("--min-p", type=float, help="also time ours with this min_p")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    for name in ("batch", "time", "rows", "hidden", "vocab", "iters", "easydel_vocab_chunk",
                 "easydel_token_chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    from grpo_kernels.ops.core.truncation import Truncation
    try:
        Truncation(args.top_k, args.top_p, args.min_p)
    except ValueError as e:
        p.error(f"--top-k/--top-p/--min-p: {e}")
    rows = []
    for op in (["logits", "hidden"] if args.op == "both" else [args.op]):
        args.op = op
        fns, inputs = contenders(args)
        base, want = None, None
        for name, fn in fns.items():
            ms = median_ms(lambda: fn(*inputs), args.iters, args.warmup)
            base = base or ms
            got = fn(*inputs)
            if got.ndim == 2 and want is None:  # the first log-prob contender: the plain one
                want = got
            diff = None if got.ndim != 2 else float(jnp.max(jnp.abs(got - want)))
            row = {"op": op, "contender": name, "median_ms": ms, "ratio": ms / base,
                   "max_abs_diff_to_plain": diff,
                   "dtype": args.dtype, "vocab": args.vocab, "backend": jax.default_backend(),
                   **({"batch": args.batch, "time": args.time} if op == "logits" else
                      {"rows": args.rows, "hidden": args.hidden})}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| op | contender | median ms | ratio to the first | max abs diff to plain |\n"
          "|---|---|---|---|---|")
    for r in rows:
        diff = r["max_abs_diff_to_plain"]
        print(f"| {r['op']} | {r['contender']} | {r['median_ms']:.2f} | {r['ratio']:.3f} | "
              + ("-" if diff is None else f"{diff:.1e}") + " |")
    if args.json:  # whole or not at all: a crash leaves no half-written file
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
