"""SmolLM2-135M-Instruct from its GGUF: perplexity on a fixed paragraph and greedy completions.

    python benchmarks/smollm2_demo.py [--compute float32|bfloat16] [--tokens 20]

The plain continuation uses repeated full forwards (the oracle the sampler is tested against);
the chat answer uses ``generate`` (KV cache). The outputs are quoted in docs/models.md.
"""

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_kernels.models.gguf_loader import load_gguf, smollm2_path
from grpo_kernels.models.tokenizer import TextTokenizer

PARAGRAPH = ("The history of science is the study of the development of science and scientific "
             "knowledge, including both the natural and social sciences. Science is a body of "
             "empirical, theoretical, and practical knowledge about the natural world, produced "
             "by scientists who emphasize the observation, explanation, and prediction of "
             "real-world phenomena.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compute", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--question", default="Why is the sky blue? Answer in two sentences.")
    p.add_argument("--answer-tokens", type=int, default=60)
    args = p.parse_args()
    path = smollm2_path()
    _, model = load_gguf(path, compute_dtype=jnp.dtype(args.compute))
    tok = TextTokenizer.from_gguf(path)
    forward = nnx.jit(lambda m, x: m(x))
    ids = jnp.asarray([tok.encode(PARAGRAPH)])
    logp = jax.nn.log_softmax(forward(model, ids)[0, :-1], axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(logp, ids[0, 1:, None], axis=-1))
    print(f"perplexity ({ids.shape[1]} tokens, {args.compute} compute): {float(jnp.exp(nll)):.2f}")
    cur = tok.encode(args.prompt)
    for _ in range(args.tokens):
        cur.append(int(jnp.argmax(forward(model, jnp.asarray([cur]))[0, -1])))
    print("greedy:", repr(tok.decode(cur)))
    from grpo_kernels.models.sampling import generate

    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.question}]))
    out = generate(model, [chat], max_new_tokens=args.answer_tokens, temperature=0.0,
                   eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    answer = out.ids[0][: int(out.mask[0].sum())]
    print("chat greedy:", repr(tok.decode(answer)))


if __name__ == "__main__":
    main()
