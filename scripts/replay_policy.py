"""Replay the adaptive policy on recorded steps: how close it comes to the best fixed setting.

python scripts/bench_arms.py --heads DIR --prompts mt_bench.jsonl --per-category 2 --record \
    --arms '[{"choices": "chain-2"}, {"choices": [[0], [1], [2], [3], [0, 0]]}]'
python scripts/replay_policy.py runs/bench-arms/steps.json [--subset 0,1,2 ...] [--orders 10]
    [--busy 1.5]

One bench run cannot tell two policies apart: their difference is a few percent, and so is the
noise between two runs of one setting. A replay holds the text and the machine still. The record
holds, per prompt, every fixed setting's steps (tokens, seconds, and on greedy steps the paths
measured and the one accepted: a static tree's nodes, a dynamic tree's root ranking; 5-field
records, made before commit eeb0b09, hold static trees' only; since 2026-12-07 a 7th field says
whether the step drafted anything, older records' steps count as drafted). A policy decodes
each prompt again: at each step the setting it chooses gives its recorded step that covers the
current position (a step that began earlier counts its tokens from here on and its whole time, which
penalises switching, and feeds no paths), so text that one setting drafts well pays every
setting that tries there; tokens a last step gained past the generation's end (max_new_tokens,
EOS) are not counted. Rates count the steps' time only (no prefill or catch-up), unlike the
tokens/s of arms.json. Prompts run in `--orders` shuffled orders (the policy kept across
prompts, as in a generator's life); reported per subset of the settings (indices into the
record's settings; the default is all of them): each setting's rate fixed and each policy's mean
rate over the orders, as a fraction of the best fixed setting in the subset. `--busy F` replays
again with the second prompt of each order F times slower for every setting, as when another
process takes a share of the cores for a while: how soon a policy recovers from measurements
made then.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from inference.adaptive import AdaptivePolicy

# name: (the policy for the settings' options, whether it is told a dynamic tree's paths)
POLICIES: dict[str, tuple[Callable[[list], AdaptivePolicy], bool]] = {
    "per-arm averages": (lambda options: AdaptivePolicy.from_options(options, pooled=False), True),
    "shared path rates of static trees' steps only": (AdaptivePolicy.from_options, False),
    "shared path rates (default)": (AdaptivePolicy.from_options, True),
    "shared path rates, arms that never gained not backed off (before 2026-12-07)": (
        lambda options: AdaptivePolicy.from_options(options, idle_after=sys.maxsize),
        True,
    ),
    "shared path rates, seconds a short average (time_smoothing 0.25)": (
        lambda options: AdaptivePolicy.from_options(options, time_smoothing=0.25),
        True,
    ),
}


def lengths(record: dict) -> list[int]:
    """Tokens each prompt's generation kept. A step's tokens are recorded as the step gained
    them, and a generation's last step may gain more than max_new_tokens (or an EOS) leaves:
    records made since 2026-12-06 hold the kept length; for older ones, the fewest tokens any
    setting recorded (exact where one of them is plain decoding, which gains one at a time)."""
    if "lengths" in record:
        return list(record["lengths"])
    return [min(sum(s[1] for s in steps) for steps in per_arm) for per_arm in record["prompts"]]


def fixed_rate(record: dict, arm: int) -> float:
    """Tokens per second of setting `arm` fixed over every recorded prompt (the tokens kept)."""
    tokens = seconds = 0.0
    for per_arm, length in zip(record["prompts"], lengths(record)):
        tokens += min(sum(s[1] for s in per_arm[arm]), length)
        seconds += sum(s[2] for s in per_arm[arm])
    return tokens / seconds if seconds else 0.0


def replay(
    record: dict,
    policy: AdaptivePolicy,
    subset: list[int],
    order: list[int],
    dynamic_paths: bool = True,
    busy: float = 1.0,
) -> float:
    """Tokens per second of `policy` (over the settings `subset`) decoding prompts `order`;
    `dynamic_paths=False` withholds the paths a dynamic tree's steps measured; every step of the
    second prompt takes `busy` times its recorded seconds."""
    policy.greedy = True
    tokens = seconds = 0.0
    kept = lengths(record)
    for position_in_order, p in enumerate(order):
        slow = busy if position_in_order == 1 else 1.0
        per_arm = [record["prompts"][p][i] for i in subset]
        starts = [[s[0] for s in steps] for steps in per_arm]
        # a setting whose output parted from plain decoding's (bf16 on a GPU) may end sooner
        end = min(kept[p], *(sum(s[1] for s in steps) for steps in per_arm))
        position = 0
        while position < end:
            k = policy.choose()
            j = bisect.bisect_right(starts[k], position) - 1
            start, n, s, drafted, accepted, *rest = per_arm[k][j]
            static = rest[0] if rest else True  # 5-field records: static trees only
            proposed = rest[1] if len(rest) > 1 else True  # 6-field records: heads, which draft
            paths = None
            if start == position and drafted is not None and (static or dynamic_paths):
                paths = [tuple(c) for c in drafted]
            # A step that began earlier: its tokens from here on, its whole time; its paths say
            # nothing of a step beginning here. The policy is told what the step gained (as the
            # generator tells it); the rate counts only the tokens the generation keeps.
            n = max(1, n - (position - start))
            kept_n = min(n, end - position)
            s *= slow
            accepted = tuple(accepted) if paths is not None else ()
            policy.update(k, n, s, paths, accepted, static, proposed=proposed and start == position)
            position += kept_n
            tokens += kept_n
            seconds += s
    return tokens / seconds if seconds else 0.0


def compare(record: dict, subset: list[int], orders: int, busy: float = 1.0) -> dict:
    """Each setting's fixed rate and each policy's mean replayed rate, over the subset (with
    the second prompt of each order `busy` times slower)."""
    count = len(record["prompts"])
    shuffles = [random.Random(seed).sample(range(count), count) for seed in range(orders)]
    options = [record["arms"][i] for i in subset]
    fixed = {  # a policy of one arm runs that setting throughout
        i: statistics.mean(
            replay(record, AdaptivePolicy.from_options([o]), [i], order, True, busy)
            for order in shuffles
        )
        if busy != 1.0
        else fixed_rate(record, i)
        for i, o in zip(subset, options)
    }
    best = max(fixed.values())
    policies = {
        name: statistics.mean(
            replay(record, make(options), subset, o, told, busy) for o in shuffles
        )
        for name, (make, told) in POLICIES.items()
    }
    return {"fixed": fixed, "best": best, "policies": policies}


def _name(options) -> str:
    """A setting as bench_arms names it: plain decoding, or its options."""
    return "plain" if options is None else json.dumps(options)


def render(record: dict, subset: list[int], result: dict) -> str:
    best = result["best"] or float("inf")  # no tokens recorded: every share 0
    lines = [f"settings {subset}:"]
    for i, rate in result["fixed"].items():
        lines.append(f"  fixed {_name(record['arms'][i])}: {rate:.2f} tok/s ({rate / best:.3f})")
    for name, rate in result["policies"].items():
        lines.append(f"  adaptive, {name}: {rate:.2f} tok/s ({rate / best:.3f} of the best)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("record", help="steps.json of `scripts/bench_arms.py --record`")
    parser.add_argument(
        "--subset", action="append", default=None, help="settings by index, e.g. 0,2,3 (repeatable)"
    )
    parser.add_argument("--orders", type=int, default=10, help="shuffled prompt orders")
    parser.add_argument(
        "--busy",
        type=float,
        default=None,
        help="also replay with each order's second prompt this many times slower (e.g. 1.5)",
    )
    args = parser.parse_args(argv)
    if args.orders < 1:
        parser.error("--orders must be >= 1")
    if args.busy is not None and args.busy <= 0:
        parser.error("--busy must be > 0 (1: as recorded)")
    try:
        record = json.loads(Path(args.record).read_text(encoding="utf-8"))
        n = len(record["arms"])
        if not record["prompts"]:
            raise ValueError("it holds no prompts")
        if len(record.get("lengths", record["prompts"])) != len(record["prompts"]):
            raise ValueError("its lengths and prompts differ in number")
        if any(len(per_arm) != n for per_arm in record["prompts"]):
            raise ValueError(f"a prompt holds the steps of other than its {n} settings")
        if any(len(s) < 5 for per_arm in record["prompts"] for steps in per_arm for s in steps):
            raise ValueError("a step holds fewer than 5 fields")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(
            f"replay_policy failed: {args.record} is not a record of `scripts/bench_arms.py "
            f"--record` ({e})",
            file=sys.stderr,
        )
        return 2
    subsets = [list(range(n))]
    if args.subset:
        try:
            subsets = [[int(i) for i in s.split(",")] for s in args.subset]
        except ValueError:
            parser.error("--subset takes indices separated by commas, e.g. 0,2,3")
        if any(not 0 <= i < n for s in subsets for i in s):
            parser.error(f"--subset indices must be in 0..{n - 1} (the record's settings)")
    for subset in subsets:
        print(render(record, subset, compare(record, subset, args.orders)))
        if args.busy is not None:
            print(f"  with the second prompt {args.busy:g}x slower:")
            print(render(record, subset, compare(record, subset, args.orders, args.busy)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
