"""Distillation throughput: batched (the distill code path) against one prompt at a time.

python scripts/bench_distill.py [--prompts 48] [--unbatched 8] [--max-new-tokens 64]
                                [--batch-size 32 [64 ...]] [--processes 1 [2 ...]]
                                [--chunk-tokens 16 [0 ...]] [--dtype float32|bfloat16]
                                [--max-length N] [--threads N] [--out results.json]

Every run uses the same model, prompts (the embedded set), greedy decoding and max_new_tokens;
each batch size and process count given is measured on the same prompts. The batch-1 baseline
is plain HF generate (its default dynamic cache) in this process with all its threads. With
`--processes N` the batched run is split as `torchrun --nproc_per_node N scripts/distill.py`
splits it: N processes with threads / N threads each, each a strided share of the
length-sorted prompts, started together; tokens/s is all their tokens over the wall time from
the common start to the last one's end. `--chunk-tokens` gives the new tokens per generate call
of the batched path, after which rows that ended leave the batch (0: one call per batch, every
row running until the longest answer ends). Tokens are counted up to and including the
end-of-turn token; padding after it is not counted. `--dtype` is the base's (default fp32, as
greedy answers are distilled on a CPU; `bfloat16` as sampled ones are on a CPU with bf16
instructions, `train.precision.answering_dtype`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import distill  # noqa: E402  (the distill script's own functions)

from heads.base import load_base  # noqa: E402
from train.answering import CHUNK_TOKENS, eos_token_ids, transformers_generator  # noqa: E402
from train.config import DataConfig, load_recipe  # noqa: E402
from train.data import resolve_chat_template  # noqa: E402


def measure(items, generate, tokenizer, template, recipe, batch_size: int) -> dict:
    """Run `items` through distill.run_batch in length-sorted batches; tokens per second."""
    items = sorted(items, key=lambda i: -len(i.first_prompt_ids))
    start, tokens = time.monotonic(), 0
    for b in range(0, len(items), batch_size):
        tokens += distill.run_batch(
            items[b : b + batch_size], generate, tokenizer, template, recipe
        )
    end = time.monotonic()
    return {
        "prompts": len(items),
        "batch_size": batch_size,
        "tokens": tokens,
        "seconds": round(end - start, 2),
        "tokens_per_s": round(tokens / (end - start), 1),
        "start": start,
        "end": end,
    }


def without_clock(run: dict) -> dict:
    """A `measure` record without its clock readings (they only join processes' timings)."""
    return {k: v for k, v in run.items() if k not in ("start", "end")}


def build(args: argparse.Namespace):
    """(recipe, model, tokenizer, template, eos ids) as distill.py builds them."""
    recipe = load_recipe(
        None,
        [
            f"model.name_or_path={args.base}",
            f"model.dtype={args.dtype}",
            f"data.limit={args.prompts}",
            f"data.max_new_tokens={args.max_new_tokens}",
            f"data.max_length={args.max_length}",
            "data.sources=embedded",
        ],
    )
    model, tokenizer = load_base(args.base, dtype=recipe.model.dtype)
    template = resolve_chat_template(tokenizer, None)
    eos_ids = eos_token_ids(tokenizer, model.generation_config, template)
    return recipe, model, tokenizer, template, eos_ids


def fresh_items(recipe, tokenizer, template):
    """The prompts' work items in file order. A run fills in its items' answers: every run
    starts from new ones."""
    return distill.build_items(recipe, tokenizer, template)[0]


def worker(
    rank: int, world: int, threads: int, args, batch_size: int, chunk: int, barrier, results
) -> None:
    """One of `world` processes of a multi-process batched run (see the module docstring).
    Puts its `measure` record on `results`, or None when it fails (after breaking the barrier,
    so that no other process waits for it)."""
    try:
        torch.set_num_threads(threads)
        recipe, model, tokenizer, template, eos_ids = build(args)
        generate = transformers_generator(model, tokenizer, recipe, eos_ids, chunk_tokens=chunk)
        common = (tokenizer, template, recipe)
        distill.run_batch(fresh_items(recipe, tokenizer, template)[:2], generate, *common)
        items = fresh_items(recipe, tokenizer, template)
        # distill.py's split: length-sorted, then strided.
        items = sorted(items, key=lambda i: -len(i.first_prompt_ids))[rank::world]
        barrier.wait()  # every process loaded and warmed up: start together
        results.put(measure(items, generate, *common, batch_size))
    except BaseException:
        barrier.abort()
        results.put(None)
        raise


def measure_processes(args, batch_size: int, processes: int, chunk: int) -> dict:
    """The batched run split over `processes` processes started together; aggregate tok/s."""
    threads = max(1, torch.get_num_threads() // processes)
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(
            target=worker,
            args=(r, processes, threads, args, batch_size, chunk, barrier, results),
        )
        for r in range(processes)
    ]
    for w in workers:
        w.start()
    parts = []
    while len(parts) < processes:  # every worker puts one record, None when it fails
        try:
            parts.append(results.get(timeout=10))
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):  # killed before it could put
                parts.append(None)
                break
    if None in parts:
        for w in workers:
            w.terminate()
    for w in workers:
        w.join()
    if None in parts or any(w.exitcode != 0 for w in workers):
        raise RuntimeError("a worker process failed: see its output above")
    tokens = sum(p["tokens"] for p in parts)
    seconds = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    return {
        "prompts": sum(p["prompts"] for p in parts),
        "batch_size": batch_size,
        "chunk_tokens": chunk,
        "processes": processes,
        "threads_per_process": threads,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def run_name(run: dict) -> str:
    return f"batch {run['batch_size']}, chunk {run['chunk_tokens']}, {run['processes']} process(es)"


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
        "--processes",
        type=int,
        nargs="+",
        default=[1],
        help="process counts for the batched runs (torchrun's data-parallel split)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        nargs="+",
        default=[CHUNK_TOKENS],
        help="new tokens per generate call of the batched runs; 0: one call per batch",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=DataConfig().max_length,
        help="data.max_length: longer prompts are skipped, later turns that do not fit dropped "
        "(the CPU recipes use 320)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the base's dtype (bf16: as sampled answers are distilled on a CPU with bf16 "
        "instructions)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    counts = (args.prompts, args.unbatched, args.max_new_tokens, *args.batch_size, *args.processes)
    if min(counts) < 1:
        parser.error(
            "--prompts, --unbatched, --max-new-tokens, --batch-size and --processes must be >= 1"
        )
    if min(args.chunk_tokens) < 0:
        parser.error("--chunk-tokens must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    recipe, model, tokenizer, template, eos_ids = build(args)
    # The baseline is plain HF generate, one prompt at a time, as a user runs it: its default
    # (dynamic) cache, not the static one of the batched path.
    plain = transformers_generator(model, tokenizer, recipe, eos_ids, static_cache=False)
    common = (tokenizer, template, recipe)
    warm = transformers_generator(
        model, tokenizer, recipe, eos_ids, chunk_tokens=args.chunk_tokens[0]
    )
    distill.run_batch(fresh_items(recipe, tokenizer, template)[:2], warm, *common)  # warm-ups
    distill.run_batch(fresh_items(recipe, tokenizer, template)[:1], plain, *common)
    firsts = fresh_items(recipe, tokenizer, template)[: args.unbatched]
    unbatched = without_clock(measure(firsts, plain, *common, 1))
    print(f"unbatched: {unbatched}", flush=True)
    batched = []
    for batch_size, chunk, processes in itertools.product(
        args.batch_size, args.chunk_tokens, args.processes
    ):
        if processes == 1:
            items = fresh_items(recipe, tokenizer, template)
            generate = transformers_generator(model, tokenizer, recipe, eos_ids, chunk_tokens=chunk)
            run = without_clock(measure(items, generate, *common, batch_size))
            run.update(chunk_tokens=chunk, processes=1, threads_per_process=torch.get_num_threads())
        else:
            run = measure_processes(args, batch_size, processes, chunk)
        batched.append(run)
        print(f"batched:   {run}", flush=True)
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
            run_name(b): round(b["tokens_per_s"] / unbatched["tokens_per_s"], 2) for b in batched
        },
    }
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
