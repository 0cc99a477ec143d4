"""Which tree settings pay for these heads on this machine: each one fixed, timed side by side.

python scripts/bench_arms.py --heads DIR --prompts mt_bench.jsonl [--per-category 1] [--limit K]
    [--arms JSON] [--max-new-tokens 128] [--base smollm2-135m-instruct] [--device D]
    [--threads N] [--out runs/bench-arms] [--record]

Per prompt, in turn, every setting decodes with `SpeculativeGenerator(base, heads,
adaptive=[setting])`: plain decoding through our loop (the reference, always first), then each
drafter setting fixed. `--arms` is a JSON list whose items are drafter options (Medusa
`{"choices": "cpu-8"}`, EAGLE `{"top_k": 4, "depth": 2, "total_tokens": 6}`; `{}`: the drafter
as loaded, with its default settings), a list of options
(null for plain decoding) for an adaptive generator over just those, or `"adaptive"` for the
generator's default (adaptive over the drafter's own `default_arms`). Without `--arms`: each of
the drafter's `default_arms` for this device fixed, then `"adaptive"`. Reported per setting: tau,
the base's and the drafting's milliseconds per step (the prompt's prefill left out, since
2026-12-06; tables before counted it in, which weighed ~1 ms more on a step of tau 2 than on a
plain one at 128 tokens), tokens/s, its ratio to plain decoding
(median of the per-prompt ratios / overall) and whether every output is plain decoding's.
`scripts/bench.py` times whole methods against HF `generate`; this script is for choosing the
settings themselves (what a level of a tree costs in drafting, what a wider level gains).
Writes OUT/arms.json; with `--record`, also OUT/steps.json: every fixed setting's steps (tokens,
seconds, accepted path), on which `scripts/replay_policy.py` replays adaptive policies.
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
from bench import prompt_ids, read_prompts  # noqa: E402

from heads import load_base, load_heads  # noqa: E402
from heads.export import remove_made  # noqa: E402
from heads.lora import base_as_served  # noqa: E402
from inference import SpeculativeGenerator  # noqa: E402
from inference.adaptive import AdaptivePolicy  # noqa: E402
from inference.drafters import make_drafter  # noqa: E402
from train.console import warnings_as_lines  # noqa: E402
from train.data import ChatTemplateError  # noqa: E402
from train.prompts import PromptSourceError  # noqa: E402

Arm = dict | list | str | None  # options, adaptive over a list of options, "adaptive", plain


def format_arm(arm: Arm) -> str:
    if arm is None:
        return "plain"
    return arm if isinstance(arm, str) else json.dumps(arm)


def check_arms(base, heads, arms: list[Arm]) -> None:
    """Raise ValueError naming the first setting these heads cannot take (before any timing),
    in the form --arms gave it: the drafter's own check, which the generator makes too."""
    drafter = make_drafter(base, heads)
    for arm in arms:
        for options in arm if isinstance(arm, list) else [arm]:
            if isinstance(options, dict) and options:  # {}: the drafter as configured
                try:
                    drafter.check_options(**options)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"setting {format_arm(options)}: {e}") from e


def build_generator(base, heads, arm: Arm) -> SpeculativeGenerator:
    if arm == "adaptive":
        return SpeculativeGenerator(base, heads, adaptive=True)
    return SpeculativeGenerator(base, heads, adaptive=arm if isinstance(arm, list) else [arm])


def time_arms(
    base,
    heads,
    arms: list[Arm],
    ids: list[torch.Tensor],
    max_new_tokens: int,
    record: dict | None = None,
) -> list[dict]:
    """Decode every prompt with every setting, interleaved per prompt; arms[0] is plain (None).

    `record`, when given, receives every fixed setting's steps for `scripts/replay_policy.py`:
    "arms" (the fixed settings) and "prompts" (per prompt, per setting, its steps as [position,
    tokens, seconds, drafted, accepted, static]; drafted / accepted are paths of ranks on a
    greedy step, a static tree's nodes or (static false) a dynamic tree's root ranking, else
    null / []) and "lengths" (per prompt, the tokens the generation kept: a last step may gain
    more than max_new_tokens leaves)."""
    if not arms or arms[0] is not None:
        raise ValueError("the first setting must be null (plain decoding): the reference")
    gens = [build_generator(base, heads, arm) for arm in arms]
    for gen in gens:  # untimed: first-call allocations and lazy inits, then a fresh policy
        gen.generate(ids[0], max_new_tokens=min(16, max_new_tokens))
        gen.policy = None
    logs: dict[int, list] = {}  # fixed setting -> its steps of the current prompt
    if record is not None:
        for i, arm in enumerate(arms):
            if arm is None or isinstance(arm, dict):
                gens[i].policy = AdaptivePolicy.from_options(gens[i].arms)  # kept by generate
                logs[i] = _record_steps(gens[i].policy)
        record.update(arms=[arms[i] for i in logs], prompts=[], lengths=[])
    rows = [
        {"arm": arm, "tokens": 0, "steps": 0, "base_s": 0.0, "draft_s": 0.0, "total_s": 0.0}
        for arm in arms
    ]
    same = [0] * len(arms)
    rates: list[list[float]] = [[] for _ in arms]  # tokens/s per prompt
    for x in tqdm(ids, desc="arms", unit="prompt"):
        reference = kept = None
        for i, (gen, row) in enumerate(zip(gens, rows)):
            out = gen.generate(x, max_new_tokens=max_new_tokens)
            reference = out.sequences if reference is None else reference
            same[i] += int(torch.equal(out.sequences, reference))
            tokens = sum(out.accepted_lengths)  # the tokens kept (a last step may gain more)
            kept = tokens if kept is None else kept
            row["tokens"] += tokens
            row["steps"] += out.num_steps
            # a step's cost: the prompt's prefill (and the drafter's pass over it) left out,
            # which would weigh more on the arms of fewer steps
            row["base_s"] += out.timings["base"] - out.timings["prefill_base"]
            row["draft_s"] += out.timings["draft"] - out.timings["prefill_draft"]
            row["total_s"] += out.timings["total"]
            rates[i].append(tokens / out.timings["total"] if out.timings["total"] else 0.0)
        if record is not None:
            record["prompts"].append([list(log) for log in logs.values()])
            record["lengths"].append(kept)  # plain decoding's, which every setting matches
            for log in logs.values():
                log.clear()
    plain_rate = rows[0]["tokens"] / rows[0]["total_s"] if rows[0]["total_s"] else 0.0
    for row, rate, n_same in zip(rows, rates, same):
        steps = max(row["steps"], 1)
        row["tau"] = row["tokens"] / steps
        row["base_ms_per_step"] = 1000 * row["base_s"] / steps
        row["draft_ms_per_step"] = 1000 * row["draft_s"] / steps
        row["tokens_per_s"] = row["tokens"] / row["total_s"] if row["total_s"] else 0.0
        # Ratios only where plain decoding made tokens (a prompt answered by EOS at once: none).
        ratios = [r / p for r, p in zip(rate, rates[0]) if p > 0]
        row["vs_plain_median"] = statistics.median(ratios) if ratios else None
        row["vs_plain"] = row["tokens_per_s"] / plain_rate if plain_rate else None
        row["identical"] = n_same / len(ids)
        row["prompts"] = len(ids)
    return rows


def _record_steps(policy: AdaptivePolicy) -> list[list]:
    """Make `policy` append each step it is told of to the returned list, as [position, tokens,
    seconds, drafted, accepted, static, proposed] (position: tokens of the generation's steps
    before it; proposed: whether the step drafted anything)."""
    steps: list[list] = []
    update = policy.update

    def record(
        index, tokens, seconds, drafted=None, accepted=(), static=True, proposed=True
    ) -> None:
        position = steps[-1][0] + steps[-1][1] if steps else 0
        steps.append([position, tokens, seconds, drafted, list(accepted), static, proposed])
        update(index, tokens, seconds, drafted, accepted, static, proposed)

    policy.update = record
    return steps


def render_markdown(rows: list[dict]) -> str:
    def ratio(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    lines = [
        "| setting | tau | base ms/step | draft ms/step | tok/s "
        "| vs plain (median / overall) | identical |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{format_arm(r['arm'])}` | {r['tau']:.2f} | {r['base_ms_per_step']:.1f} | "
            f"{r['draft_ms_per_step']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{ratio(r['vs_plain_median'])} / {ratio(r['vs_plain'])} | "
            f"{bench_report.identical_share(r['identical'], r['prompts'])} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--heads", required=True, metavar="DIR", help="Medusa heads or an EAGLE draft")
    add("--prompts", required=True, help="as scripts/bench.py: JSONL, embedded[:CAT], humaneval")
    add("--base", default="smollm2-135m-instruct")
    add("--arms", default=None, help="JSON list of settings (default: the drafter's own)")
    add("--per-category", type=int, default=None, help="the first K prompts of each category")
    add("--limit", type=int, default=None, help="the first K prompts (of --per-category's sample)")
    add("--max-new-tokens", type=int, default=128)
    add("--device", default=None, help="default: cuda when available, else cpu")
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--out", default="runs/bench-arms")
    add(
        "--record",
        action="store_true",
        help="also write OUT/steps.json, every fixed setting's steps, for scripts/replay_policy.py",
    )
    args = parser.parse_args(argv)
    if args.arms is not None:
        try:
            arms = json.loads(args.arms)
        except json.JSONDecodeError as e:
            parser.error(f'--arms is not JSON ({e}); e.g. \'[{{"choices": "cpu-8"}}]\'')

        def is_options(a) -> bool:
            return a is None or isinstance(a, dict)

        if not isinstance(arms, list) or not all(
            is_options(a) or a == "adaptive" or (isinstance(a, list) and all(map(is_options, a)))
            for a in arms
        ):
            parser.error(
                '--arms must be a JSON list of option objects, null, "adaptive" or lists of '
                "option objects and null"
            )
        args.arms = arms
    counts = (args.limit, args.per_category, args.threads)
    if args.max_new_tokens < 2 or any(c is not None and c < 1 for c in counts):
        parser.error("--max-new-tokens must be >= 2; --limit, --per-category, --threads >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    made: list[Path] = []
    try:
        prompts = read_prompts(args.prompts, "first", args.limit, None, args.per_category)
        out, made = bench_report.make_out(args.out)
        base, tokenizer = load_base(args.base, device=args.device)
        # Medusa-2: its adapter merged
        base, adapter_of = base_as_served(base, [args.heads], "bench_arms")
        heads = load_heads(args.heads, base=base)
        device = next(base.parameters()).device
        arms = args.arms
        if arms is None:
            own = make_drafter(base, heads).default_arms(device)
            arms = [*own, "adaptive"]
        arms = [None] + [a for a in arms if a is not None]
        check_arms(base, heads, arms)
        ids = [
            prompt_ids([*p.system, {"role": "user", "content": p.users[0]}], tokenizer).to(device)
            for p in prompts
        ]
        room = base.config.max_position_embeddings - args.max_new_tokens
        for p, x in zip(prompts, ids):
            if x.shape[1] > room:
                print(
                    f"prompt {p.id}: skipped (its {x.shape[1]} tokens and --max-new-tokens pass "
                    f"the base's context of {base.config.max_position_embeddings})",
                    file=sys.stderr,
                )
        if not ids:
            raise ValueError(f"no prompts selected from {args.prompts}")
        ids = [x for x in ids if x.shape[1] <= room]
        if not ids:
            raise ValueError(
                f"every prompt passes the base's context with --max-new-tokens "
                f"{args.max_new_tokens}; lower it"
            )
    except (PromptSourceError, ChatTemplateError, OSError, ValueError) as e:
        remove_made(made)
        print(f"bench_arms failed: {e}", file=sys.stderr)
        return 2
    print(f"{len(ids)} prompts, {len(arms)} settings (plain decoding first)", file=sys.stderr)
    record = {} if args.record else None
    rows = time_arms(base, heads, arms, ids, args.max_new_tokens, record)
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": bench_report.machine_info(),
        "base": args.base,
        "base_adapter_of": adapter_of,
        "heads": args.heads,
        "prompts": {"source": args.prompts, "count": len(ids)},
        "max_new_tokens": args.max_new_tokens,
        "arms": rows,
    }
    (out / "arms.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if record is not None:
        (out / "steps.json").write_text(json.dumps(record) + "\n", encoding="utf-8")
    print(render_markdown(rows))
    print(
        f"wrote {out / 'arms.json'}" + (f" and {out / 'steps.json'}" if record is not None else "")
    )
    return 0


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        raise SystemExit(main())
