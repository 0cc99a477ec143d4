"""Distillation throughput: batched (the distill code path) against one prompt at a time.

python scripts/bench_distill.py [--prompts 48] [--unbatched 8] [--max-new-tokens 64]
                                [--batch-size 32 [64 ...]] [--max-length N] [--threads N]
                                [--out results.json]

Every run uses the same model, prompts (the embedded set), greedy decoding and max_new_tokens,
in one process; each batch size given is measured on the same prompts. The batch-1 baseline is
plain HF generate (its default dynamic cache). Tokens are counted up to and including the
end-of-turn token; padding after it is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import distill  # noqa: E402  (the distill script's own functions)

from heads.base import load_base  # noqa: E402
from train.config import DataConfig, load_recipe  # noqa: E402
from train.data import resolve_chat_template  # noqa: E402


def measure(items, generate, tokenizer, template, recipe, batch_size: int) -> dict:
    """Run `items` through distill.run_batch in length-sorted batches; tokens per second."""
    items = sorted(items, key=lambda i: -len(i.first_prompt_ids))
    start, tokens = time.perf_counter(), 0
    for b in range(0, len(items), batch_size):
        tokens += distill.run_batch(
            items[b : b + batch_size], generate, tokenizer, template, recipe
        )
    seconds = time.perf_counter() - start
    return {
        "prompts": len(items),
        "batch_size": batch_size,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=48, help="prompts for the batched run")
    parser.add_argument("--unbatched", type=int, default=8, help="prompts for the batch-1 run")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[DataConfig().batch_size])
    parser.add_argument(
        "--max-length",
        type=int,
        default=DataConfig().max_length,
        help="data.max_length: longer prompts are skipped, later turns that do not fit dropped "
        "(the CPU recipes use 320)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    recipe = load_recipe(
        None,
        [
            f"model.name_or_path={args.base}",
            f"data.limit={args.prompts}",
            f"data.max_new_tokens={args.max_new_tokens}",
            f"data.max_length={args.max_length}",
            "data.sources=embedded",
        ],
    )
    model, tokenizer = load_base(args.base)
    template = resolve_chat_template(tokenizer, None)
    eos_ids = distill.eos_token_ids(tokenizer, model.generation_config)
    generate = distill.transformers_generator(model, tokenizer, recipe, eos_ids)

    def fresh_items():  # a run fills in its items' answers: every run starts from new ones
        return distill.build_items(recipe, tokenizer, template)[0]

    # The baseline is plain HF generate, one prompt at a time, as a user runs it: its default
    # (dynamic) cache, not the static one of the batched path.
    plain = distill.transformers_generator(model, tokenizer, recipe, eos_ids, static_cache=False)
    distill.run_batch(fresh_items()[:2], generate, tokenizer, template, recipe)  # warm-ups
    distill.run_batch(fresh_items()[:1], plain, tokenizer, template, recipe)
    unbatched = measure(fresh_items()[: args.unbatched], plain, tokenizer, template, recipe, 1)
    print(f"unbatched: {unbatched}", flush=True)
    batched = []
    for batch_size in args.batch_size:
        batched.append(measure(fresh_items(), generate, tokenizer, template, recipe, batch_size))
        print(f"batched:   {batched[-1]}", flush=True)
    results = {
        "base": args.base,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "max_new_tokens": args.max_new_tokens,
        "max_length": args.max_length,
        "unbatched": unbatched,
        "batched": batched,
        "speedup": {
            b["batch_size"]: round(b["tokens_per_s"] / unbatched["tokens_per_s"], 2)
            for b in batched
        },
    }
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
