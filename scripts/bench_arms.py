"""Which tree settings pay for these heads on this machine: each one fixed, timed side by side.

python scripts/bench_arms.py --heads DIR --prompts mt_bench.jsonl [--per-category 1]
    [--arms JSON] [--max-new-tokens 128] [--base smollm2-135m-instruct] [--out runs/bench-arms]

Per prompt, in turn, every setting decodes with `SpeculativeGenerator(base, heads,
adaptive=[setting])`: plain decoding through our loop (`null`, the reference), then each
drafter setting fixed, then the default adaptive generator (`"adaptive"`). Reported per
setting: tau, the base's and the drafting's milliseconds per step, tokens/s and its ratio to
plain decoding (overall, and the median of the per-prompt ratios), and whether every output is
plain decoding's. `--arms` is a JSON list of drafter options (Medusa `{"choices": "cpu-8"}`,
EAGLE `{"top_k": 4, "depth": 2, "total_tokens": 6}`) and may hold `"adaptive"`, or a list
of options for an adaptive generator over just those; the default is the drafter's own
`default_arms` for this device, each fixed, then adaptive over them. `scripts/bench.py` times
whole methods against HF `generate`; this script is for choosing the arms themselves (what
a level of a tree costs in drafting, what a wider level gains). Writes OUT/arms.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import bench_report  # noqa: E402  (scripts/ is not a package)
from bench import per_category, prompt_ids, read_prompts  # noqa: E402

from heads import load_base, load_heads  # noqa: E402
from inference import SpeculativeGenerator  # noqa: E402
from train.data import ChatTemplateError  # noqa: E402
from train.prompts import PromptSourceError  # noqa: E402


def label(arm) -> str:
    return "plain" if arm is None else arm if isinstance(arm, str) else json.dumps(arm)


def run_arms(base, heads, arms: list, ids: list[torch.Tensor], max_new_tokens: int) -> list[dict]:
    """Decode every prompt with every setting, interleaved per prompt; arms[0] must be None."""
    if not arms or arms[0] is not None:
        raise ValueError("the first setting must be null (plain decoding): the reference")
    for arm in arms:  # a setting the heads cannot take fails here, before any timing
        for options in arm if isinstance(arm, list) else [arm]:
            if isinstance(options, dict):
                SpeculativeGenerator(base, heads, **options)
    gens = []
    for arm in arms:
        if arm == "adaptive":
            gens.append(SpeculativeGenerator(base, heads, adaptive=True))
        else:
            gens.append(
                SpeculativeGenerator(base, heads, adaptive=arm if isinstance(arm, list) else [arm])
            )
    rows = [
        {
            "arm": a,
            "tokens": 0,
            "steps": 0,
            "base_s": 0.0,
            "draft_s": 0.0,
            "total_s": 0.0,
            "identical": 0,
            "rates": [],
        }
        for a in arms
    ]
    for x in tqdm(ids, desc="arms", unit="prompt"):
        reference = None
        for gen, row in zip(gens, rows):
            out = gen.generate(x, max_new_tokens=max_new_tokens)
            reference = out.sequences if reference is None else reference
            row["identical"] += int(torch.equal(out.sequences, reference))
            tokens = sum(out.accepted_lengths)
            row["tokens"] += tokens
            row["steps"] += out.num_steps
            for key in ("base", "draft", "total"):
                row[f"{key}_s"] += out.timings[key]
            row["rates"].append(tokens / out.timings["total"])
    plain = rows[0]
    for row in rows:
        steps = max(row["steps"], 1)
        row["tau"] = row["tokens"] / steps
        row["base_ms_per_step"] = 1000 * row["base_s"] / steps
        row["draft_ms_per_step"] = 1000 * row["draft_s"] / steps
        row["tokens_per_s"] = row["tokens"] / row["total_s"]
        row["vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
        row["vs_plain_median"] = statistics.median(
            r / p for r, p in zip(row["rates"], plain["rates"])
        )
        row["identical"] /= len(ids)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| setting | tau | base ms/step | draft ms/step | tok/s | vs plain (overall / median) | identical |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{label(r['arm'])}` | {r['tau']:.2f} | {r['base_ms_per_step']:.1f} | "
            f"{r['draft_ms_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x / "
            f"{r['vs_plain_median']:.2f}x | {100 * r['identical']:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--heads",
        required=True,
        metavar="DIR",
        help="Medusa heads or an EAGLE draft (folder or Hub id)",
    )
    add("--prompts", required=True, help="as scripts/bench.py: JSONL, embedded[:CAT], humaneval")
    add("--base", default="smollm2-135m-instruct")
    add("--arms", default=None, help="JSON list of settings (default: the drafter's own arms)")
    add("--per-category", type=int, default=1, help="the first K prompts of each category")
    add("--limit", type=int, default=None, help="the first K prompts (file order)")
    add("--max-new-tokens", type=int, default=128)
    add("--out", default="runs/bench-arms")
    args = parser.parse_args(argv)
    if args.arms is not None:
        try:
            arms = json.loads(args.arms)
        except json.JSONDecodeError as e:
            parser.error(f'--arms is not JSON ({e}); e.g. \'[{{"choices": "cpu-8"}}]\'')
        if not isinstance(arms, list) or not all(
            a is None or a == "adaptive" or isinstance(a, (dict, list)) for a in arms
        ):
            parser.error('--arms must be a JSON list of option objects, null or "adaptive"')
        args.arms = arms
    if args.max_new_tokens < 1 or args.per_category < 1 or (args.limit or 1) < 1:
        parser.error("--max-new-tokens, --per-category and --limit must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prompts = per_category(read_prompts(args.prompts, "first", args.limit), args.per_category)
        base, tokenizer = load_base(args.base)
        heads = load_heads(args.heads, base=base)
    except (PromptSourceError, ChatTemplateError, OSError, ValueError) as e:
        print(f"bench_arms failed: {e}", file=sys.stderr)
        return 2
    device = next(base.parameters()).device
    arms = args.arms
    if arms is None:
        own = SpeculativeGenerator(base, heads).drafter.default_arms(device)
        arms = [a for a in own if a is not None] + ["adaptive"]
    arms = [None] + [a for a in arms if a is not None]
    ids = [
        prompt_ids([*p.system, {"role": "user", "content": p.users[0]}], tokenizer).to(device)
        for p in prompts
    ]
    try:
        rows = run_arms(base, heads, arms, ids, args.max_new_tokens)
    except (ValueError, TypeError) as e:
        print(f"bench_arms failed: a setting these heads cannot take: {e}", file=sys.stderr)
        return 2
    for row in rows:
        del row["rates"]
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": bench_report.machine_info(),
        "base": args.base,
        "heads": args.heads,
        "prompts": {"source": args.prompts, "count": len(ids)},
        "max_new_tokens": args.max_new_tokens,
        "arms": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "arms.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(markdown(rows))
    print(f"wrote {out / 'arms.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
