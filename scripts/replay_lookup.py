"""Replay n-gram lookup drafting over the base's own greedy answers: exact tau, no timing noise.

python scripts/replay_lookup.py --prompts FILE.jsonl|humaneval [--per-category K] [--limit K]
    [--corpus PATH] [--num-tokens 2,4,6] [--min-count 2] [--min-share 0.5]
    [--max-new-tokens 128] [--base M] [--out runs/replay-lookup]

The base answers each prompt once (HF greedy `generate`); each answer is then drafted step by
step as `SpeculativeGenerator` would with an n-gram drafter (a step gains the drafted tokens
that match the answer, plus the bonus token), with prompt lookup alone and, given `--corpus`
(e.g. the distill output folder), with the corpus table too. Greedy verification accepts
exactly that, so tau is what a timed run would report, without its noise: use this to choose
a corpus and its settings, then `scripts/bench.py` for the speed. Writes OUT/replay.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from bench import prompt_ids, read_prompts  # noqa: E402  (scripts/ is not a package)

from heads import load_base  # noqa: E402
from inference import NgramDrafter, NgramTable, plain_generation_config  # noqa: E402


def replay_tau(answers: list[tuple[list[int], list[int]]], drafter: NgramDrafter) -> float:
    """Tokens gained per step when `drafter` drafts each (prompt ids, answer ids) in turn."""
    steps = gained = 0
    for prompt, answer in answers:
        sequence = prompt + answer
        t = len(prompt)  # sequence[: t + 1] is known: its last token is the step's root
        while t < len(sequence) - 1:
            draft = drafter.lookup(torch.tensor(sequence[: t + 1]))
            accepted = 0
            for token, truth in zip(draft, sequence[t + 1 :]):
                if token != truth:
                    break
                accepted += 1
            steps += 1
            # the bonus token too, within the answer: past its end the generator keeps none
            gained += min(accepted + 1, len(sequence) - 1 - t)
            t += accepted + 1
    return gained / steps if steps else 1.0


def parse_chain_lengths(spec: str) -> list[int]:
    """`--num-tokens` as a list of chain lengths (each >= 1); exits with a usage error."""
    try:
        lengths = [int(n) for n in spec.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--num-tokens: expected comma-separated lengths >= 1, got '{spec}'")
    return lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--prompts", required=True, help="JSONL file, folder, embedded[:CAT] or humaneval")
    add("--base", default="smollm2-135m-instruct")
    add("--limit", type=int, default=None)
    add("--per-category", type=int, default=None)
    add("--max-new-tokens", type=int, default=128)
    add("--corpus", default=None, help="answers (JSONL file or folder) for the lookup table")
    add("--num-tokens", default="2,4,6", help="comma-separated chain lengths to replay")
    add("--min-count", type=int, default=2)
    add("--min-share", type=float, default=0.5)
    add("--out", default="runs/replay-lookup")
    args = parser.parse_args(argv)
    chain_lengths = parse_chain_lengths(args.num_tokens)
    counts = (args.limit, args.per_category, args.max_new_tokens)
    if min((n for n in counts if n is not None), default=1) < 1:
        parser.error("--limit, --per-category and --max-new-tokens must be >= 1")

    try:  # what can be wrong with the input, before the minutes of answers
        prompts = read_prompts(args.prompts, "first", args.limit, None, args.per_category)
        if not prompts:
            raise ValueError(f"no prompts selected from {args.prompts}")
        base, tokenizer = load_base(args.base)
        base.generation_config = plain_generation_config(base)  # greedy from its own logits
        table = None
        if args.corpus:
            table = NgramTable.from_jsonl(
                args.corpus,
                tokenizer,
                tokenizer.eos_token_id,
                min_count=args.min_count,
                min_share=args.min_share,
            )
    except (OSError, ValueError) as e:  # PromptSourceError is a ValueError
        print(f"replay_lookup failed: {e}", file=sys.stderr)
        return 2
    by_category: dict[str, list[tuple[list[int], list[int]]]] = {}
    for p in tqdm(prompts, desc="greedy answers", unit="prompt"):
        ids = prompt_ids([*p.system, {"role": "user", "content": p.users[0]}], tokenizer)
        with torch.no_grad():
            out = base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        answer = out[0, ids.shape[1] :].tolist()
        by_category.setdefault(p.category, []).append((ids[0].tolist(), answer))
    everything = [a for answers in by_category.values() for a in answers]

    results = {"prompts": args.prompts, "count": len(everything), "rows": []}
    if table is not None:
        results["corpus"] = {"path": args.corpus, **table.info()}
    print("| lookup | tokens | tau (all) | " + " | ".join(by_category) + " |")
    print("|---|---:|---:|" + "---:|" * len(by_category))
    lookups = [("prompt", None)] + ([("prompt+corpus", table)] if table is not None else [])
    for k in chain_lengths:
        for name, corpus in lookups:
            drafter = NgramDrafter(num_tokens=k, corpus=corpus)
            row = {"lookup": name, "num_tokens": k, "tau": replay_tau(everything, drafter)}
            row["by_category"] = {c: replay_tau(a, drafter) for c, a in by_category.items()}
            results["rows"].append(row)
            cells = " | ".join(f"{v:.2f}" for v in row["by_category"].values())
            print(f"| {name} | {k} | {row['tau']:.2f} | {cells} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out / 'replay.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
