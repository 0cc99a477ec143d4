"""The end-to-end demo on the embedded SmolLM2-135M-Instruct, on any machine (no GPU, no Hub):
self-distill, train Medusa heads and an EAGLE-3 draft layer, benchmark both against the plain
model, and write a report. Re-running reuses what is finished: distill answers only the prompts
it has not, and each training resumes from its last checkpoint (a finished one only writes its
heads again; more epochs in the recipe train on; a recipe that would not continue that run, or
other answers, is refused naming the difference). The benchmark always runs.

    python scripts/demo.py [--prompts FILE.jsonl|humaneval] [--per-category K] [--max-new-tokens N] [--out runs/demo]

Stages run as subprocesses (each with its own progress bar):
1. scripts/distill.py recipes/smollm2-135m-medusa.yaml (the EAGLE recipe shares its data)
2. train/eagle.py recipes/smollm2-135m-eagle.yaml, its base features kept in a cache
3. train/medusa.py recipes/smollm2-135m-medusa.yaml on that cache (the base does not run again:
   a cache with EAGLE-3's aux layers serves Medusa, not the other way round)
4. scripts/bench.py over the prompts (MT-bench when found, else HumanEval): HF greedy, HF prompt
   lookup, our n-gram drafter (prompt lookup, and also in a table of the distilled answers),
   each heads folder alone and with that lookup -> OUT/REPORT.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEDUSA = ROOT / "recipes/smollm2-135m-medusa.yaml"
EAGLE = ROOT / "recipes/smollm2-135m-eagle.yaml"
DISTILLED = "runs/smollm2-distill"  # both recipes' data.output_dir: the lookup's corpus
FEATURES = "runs/smollm2-features"  # the base's features of that data, for both trainings
# MT-bench's questions are public data that headstart does not ship: the file that
# HEADSTART_MT_BENCH names, else a copy in the repository.
MT_BENCH_CANDIDATES = ["mt_bench.jsonl"]


def run_stage(name: str, args: list[str], timings: dict[str, float], folder: str = "") -> None:
    """Run one stage; `folder`: where it writes, named if it fails (it may hold another run)."""
    print(f"\n=== {name}: {' '.join(args)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=ROOT)
    timings[name] = time.perf_counter() - start
    if result.returncode != 0:
        refused = result.returncode == 2 and folder  # bad input: another run's folder, say
        raise SystemExit(
            f"demo: stage '{name}' failed (exit {result.returncode}; its message is above). "
            + (
                f"If {folder} holds a run of your own with other settings, move it away: the "
                "demo writes there with its recipe's settings. "
                if refused
                else ""
            )
            + "Rerunning the same command (make demo, or scripts/demo.py with its flags) resumes "
            "where it stopped."
        )


def default_prompts() -> str:
    named = os.environ.get("HEADSTART_MT_BENCH")
    if named:  # a path named but not there is an error, not a quiet fallback
        if not Path(named).expanduser().is_file():
            raise FileNotFoundError(
                f"HEADSTART_MT_BENCH={named}: no such file (relative paths are read from "
                "where the demo runs); save MT-bench's question file there (README), or unset it"
            )
        return str(Path(named).expanduser().resolve())
    for candidate in MT_BENCH_CANDIDATES:
        if candidate and (ROOT / candidate).is_file():
            return str((ROOT / candidate).resolve())
    return "humaneval"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="benchmark prompts (default: MT-bench if found, else humaneval)",
    )
    parser.add_argument(
        "--per-category",
        type=int,
        default=None,
        help="benchmark prompts per category (default: about 16 in all, at least 2 of each: 2 of "
        "each of MT-bench's 8 categories; 16 of HumanEval or of a file without categories)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="the report's folder (default: runs/demo)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or (args.per_category is not None and args.per_category < 1):
        parser.error("--max-new-tokens and --per-category must be >= 1")
    # The stages run in the repository; a path given here is read from where the demo was run.
    out = Path(args.out).resolve() if args.out else ROOT / "runs/demo"
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file: give a folder for the report")
    from train.config import RecipeError, check_writable

    try:  # said now, not after the stages' half hour
        check_writable("--out", out)
    except RecipeError as e:
        parser.error(str(e))
    if args.prompts and Path(args.prompts).exists():
        args.prompts = str(Path(args.prompts).resolve())
    try:
        prompts = args.prompts or default_prompts()
    except FileNotFoundError as e:
        parser.error(str(e))
    if prompts == "humaneval" and not args.prompts:
        print(
            "demo: no mt_bench.jsonl in the repository (nor HEADSTART_MT_BENCH=FILE): benchmarking "
            "HumanEval's first problems instead (the README says where to get MT-bench's file)",
            file=sys.stderr,
        )
    categories = check_prompts(parser, prompts)  # before the stages' half hour, not after it
    context = base_context()
    if args.max_new_tokens >= context:
        parser.error(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the base's "
            f"context ({context} positions)"
        )
    timings: dict[str, float] = {}

    run_stage("distill", ["scripts/distill.py", str(MEDUSA)], timings, DISTILLED)
    # Training runs again even where heads exist: it resumes from the run's last checkpoint, so
    # that heads of an edited recipe or of other answers are never reused as they were.
    for name, script, recipe, folder in (
        ("train eagle-3", "train/eagle.py", EAGLE, "runs/smollm2-eagle"),
        ("train medusa", "train/medusa.py", MEDUSA, "runs/smollm2-medusa"),
    ):
        # Medusa on a cache only when it has EAGLE-3's aux layers (made by the stage above), so
        # that a later EAGLE-3 run is never refused a cache of "hidden" only.
        with_cache = recipe == EAGLE or (ROOT / FEATURES / "features.json").is_file()
        cache = [f"training.feature_cache={FEATURES}"] if with_cache else []
        folders = f"{folder} or {FEATURES}" if with_cache else folder
        run_stage(name, [script, str(recipe), *cache], timings, folders)

    # about 16 prompts: 2 of each of MT-bench's 8 categories, 16 of HumanEval's or a file's one
    per_category = args.per_category or max(2, round(16 / categories))
    bench_out = out / "bench"
    out.mkdir(parents=True, exist_ok=True)  # once the stages before have run: not left empty
    run_stage(
        "benchmark",
        [
            "scripts/bench.py",
            "--base",
            "smollm2-135m-instruct",
            "--heads",
            "runs/smollm2-medusa/heads",
            "runs/smollm2-eagle/heads",
            "--methods",
            "baseline,hf-lookup,ngram,ngram+corpus,heads,heads+ngram+corpus",
            "--lookup-corpus",
            DISTILLED,
            "--prompts",
            prompts,
            "--per-category",
            str(per_category),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--out",
            str(bench_out),
        ],
        timings,
    )
    write_report(out, bench_out, timings, prompts)
    print(f"\nreport: {out / 'REPORT.md'}")
    print(
        "chat with the heads: python scripts/chat.py --heads runs/smollm2-eagle/heads "
        f"--lookup-corpus {DISTILLED} --compare"
    )
    return 0


def base_context() -> int:
    """The embedded base's context in positions (its first load converts it, as distill would)."""
    from heads.base import EMBEDDED_NAME, load_base_config

    return load_base_config(EMBEDDED_NAME).max_position_embeddings


def check_prompts(parser: argparse.ArgumentParser, prompts: str) -> int:
    """Read the benchmark's prompts as bench.py will (a missing or malformed file is an error);
    returns how many categories they hold."""
    from bench import read_prompts  # imports torch: only once the flags are known good
    from bench_methods import BenchError

    from train.prompts import PromptSourceError

    try:
        return len({p.category for p in read_prompts(prompts, "first")})
    except (BenchError, PromptSourceError, OSError) as e:
        parser.error(f"--prompts {prompts}: {e}")


def write_report(out: Path, bench_out: Path, timings: dict[str, float], prompts: str) -> None:
    lines = [
        "# headstart demo report",
        "",
        f"Prompts: `{prompts}`",
        "",
        "## Stage wall times (this run)",
        "",
    ]
    lines += [f"- {name}: {seconds / 60:.1f} min" for name, seconds in timings.items()]
    lines.append(f"- in all: {sum(timings.values()) / 60:.1f} min")
    lines += ["", "## Held-out training metrics", ""]
    for name in ("smollm2-medusa", "smollm2-eagle"):
        path = ROOT / "runs" / name / "heads" / "training_metrics.json"
        if path.is_file():
            metrics = json.loads(path.read_text())
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    lines += ["", "## Benchmark", "", (bench_out / "results.md").read_text()]
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
