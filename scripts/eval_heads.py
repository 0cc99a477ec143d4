"""Acceptance of trained heads on answers the base wrote, without timing anything.

    python scripts/eval_heads.py RUN/recipe.yaml RUN/heads [--data DISTILLED] [--categories FILE]
        [--out FILE.json] [section.key=value ...]

Runs the trainer's held-out evaluation (train/medusa.py or train/eagle.py, as the recipe says)
on trained heads: each head's or TTT step's top-1 against the base's greedy token (and whether
it is among a Medusa head's top 5 or an EAGLE-3 step's top 4, the CPU trees' width), `sim_tau`
(1 + leading correct steps, averaged over answer positions) and `walk_tau` (the same walked in
decode order: the tau a fixed chain of the heads' steps decodes at on these answers). It scores
as decoding runs, in the dtype the recipe loads the base in, without the recipe's training
autocast: a run trained under bf16 autocast reported its held-out figures a little differently.
Medusa-2 heads are scored as their run scored them, on the base with their LoRA adapter: their
acceptance on the adapted base's tokens, and `kl` against the base without it.

Without `--data` it scores the recipe's own held-out split (`training.eval_fraction` of
`data.output_dir`). With `--data` it scores every answer in that distill output, e.g. the base's
answers to the prompts your users send (greedy: `data.temperature=0`, as decoding runs):

    python scripts/distill.py RUN/recipe.yaml 'data.sources=[mt_bench.jsonl]' \\
        data.limit=null data.temperature=0 data.output_dir=runs/mtbench-distill
    python scripts/eval_heads.py RUN/recipe.yaml RUN/heads --data runs/mtbench-distill \\
        --categories mt_bench.jsonl

`--categories` (prompts with a "category" per record, or `embedded`) also scores each category:
an answer belongs to the category of the prompt whose first user turn it answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench import read_prompts  # noqa: E402  (scripts/ is not a package)
from bench_methods import BenchError  # noqa: E402

from heads import EagleDraft, MedusaHeads, load_heads  # noqa: E402
from heads.checkpoint import read_config, resolve_folder  # noqa: E402
from heads.lora import lora_merged  # noqa: E402
from train.config import RecipeError, load_recipe  # noqa: E402
from train.console import warnings_as_lines  # noqa: E402
from train.data import read_distilled  # noqa: E402
from train.eagle import EagleTrainee  # noqa: E402
from train.features import (  # noqa: E402
    ExampleDataset,
    precompute_features,
    split_held_out,
    tokenize_answers,
)
from train.medusa import MedusaTrainee  # noqa: E402
from train.prompts import Message, PromptSourceError  # noqa: E402
from train.run import evaluate, load_frozen_base  # noqa: E402

TRAINEES = {"medusa": (MedusaHeads, MedusaTrainee), "eagle": (EagleDraft, EagleTrainee)}


# Recipe settings that choose which prompts distill answers, not which answers are read.
DISTILL_SELECTION = ("sources", "limit", "num_samples")


def fail(message: str) -> SystemExit:
    print(f"error: {message}", file=sys.stderr)
    return SystemExit(2)


def first_user_turn(messages: list[Message]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "").strip()


def categories_of(spec: str) -> dict[str, str]:
    """First user turn -> category of each prompt in `spec` (a prompt file or `embedded`)."""
    found: dict[str, str] = {}
    for prompt in read_prompts(spec, "first"):
        turn = prompt.users[0].strip()
        # read_prompts calls a record without a category "all", the name of the whole set here
        category = "(no category)" if prompt.category == "all" else prompt.category
        if found.setdefault(turn, category) != category:
            raise BenchError(f"{spec}: {turn[:60]!r}... is in two categories")
    if set(found.values()) == {"(no category)"}:
        raise BenchError(f"{spec}: no record has a 'category'")
    return found


def with_adapter(base, folder: Path) -> tuple[object, bool]:
    """Medusa-2 heads' base as their run scored them: the LoRA adapter of their `folder` on it,
    unmerged (a peft model), so that their trainee reads the adapted base's states and greedy
    tokens and the original base's distribution for its KL term. Other heads, or a base that
    has the adapter merged already: `base` as it is. And whether the loss and KL can be scored
    (not on a merged base: no original distribution is left to compare with)."""
    config = read_config(folder)
    lora = config.get("base_lora")
    if not lora:
        return base, True
    if lora_merged(base, config.get("base_lora_probe")) is not False:
        print(
            f"eval_heads: the base has the LoRA adapter of the Medusa-2 heads {folder} merged "
            "already (or their probe cannot tell): their acceptance is scored, not eval/loss "
            "and eval/kl (no original base is left to compare with)",
            file=sys.stderr,
        )
        return base, False
    from peft import PeftModel

    print(
        f"eval_heads: the base with the LoRA adapter of the Medusa-2 heads {folder}, as their "
        "run scored them (their KL term against the base without it)",
        file=sys.stderr,
    )
    return PeftModel.from_pretrained(base, str(folder), subfolder=lora).eval(), True


def with_features(base, tokenizer, recipe, examples, aux_ids) -> ExampleDataset:
    """The examples and the base's features over them (one forward, in memory); a peft base
    (Medusa-2's): the examples alone, for the trainee's own forwards with and without it."""
    if hasattr(base, "peft_config"):
        return ExampleDataset(examples)
    features = precompute_features(
        base, examples, aux_ids, recipe.training.micro_batch_size, tokenizer.pad_token_id
    )
    return ExampleDataset(examples, features)


def by_category(dataset: ExampleDataset, labels: list[str]) -> dict[str, ExampleDataset]:
    """{"all": the dataset, label: its examples in the same order}: so "all" scores exactly
    as without categories."""
    groups = {"all": dataset}
    for label in dict.fromkeys(labels):
        rows = [i for i, x in enumerate(labels) if x == label]
        features = dataset.features
        groups[label] = ExampleDataset(
            [dataset.examples[i] for i in rows],
            None if features is None else [features[i] for i in rows],
        )
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe", help="the recipe the heads were trained with (RUN/recipe.yaml)")
    parser.add_argument("heads", help="heads folder or Hub repo id")
    parser.add_argument("--data", help="a distill output to score instead of the held-out split")
    parser.add_argument("--categories", help="prompts with a 'category' per record, or embedded")
    parser.add_argument("--out", help="also write the scores to this JSON file")
    parser.add_argument(
        "overrides", nargs="*", default=[], help="section.key=value recipe overrides"
    )
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    if args.categories and not args.data:
        raise fail("--categories groups the answers of --data; give --data too")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        # Read before the base loads: bad input stops at once.
        data = args.data or recipe.data.output_dir
        records = read_distilled(data)
        if not any(m["role"] == "assistant" for c, _ in records for m in c):
            raise ValueError(f"{data}: no assistant answers (scripts/distill.py writes them)")
        category = categories_of(args.categories) if args.categories else {}
        if category and not any(first_user_turn(c) in category for c, _ in records):
            raise BenchError(f"no answer in {args.data} answers a prompt of {args.categories}")
        given = load_recipe(args.recipe, []).data  # the settings the overrides changed
        chosen = [
            f"data.{key}={getattr(recipe.data, key)!r}"
            for key in DISTILL_SELECTION
            if getattr(recipe.data, key) != getattr(given, key)
        ]
        if chosen:  # as training reads them: every answer of the folder
            print(
                f"note: eval_heads scores every answer in {data}: {', '.join(chosen)} only "
                f"shape{'s' * (len(chosen) == 1)} what scripts/distill.py answers",
                file=sys.stderr,
            )
        if args.out and Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a folder: give the JSON file to write")
        folder = resolve_folder(args.heads)  # a missing folder or an unreachable Hub id: at once
    except (RecipeError, FileNotFoundError, ValueError, PromptSourceError, BenchError) as e:
        raise fail(str(e)) from None
    heads_class, trainee_class = TRAINEES[recipe.heads.type]
    accelerator = Accelerator()  # the device only: no trackers, no training autocast
    # The recipe's model.dtype as decoding loads it (auto: fp32 on a CPU), whatever dtype the
    # run trained its base in: the heads are scored as they will draft.
    base, tokenizer = load_frozen_base(recipe, accelerator)
    try:
        base, original_known = with_adapter(base, folder)
        heads = load_heads(folder, base)
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e)) from None
    if not isinstance(heads, heads_class):
        raise fail(
            f"{args.heads} does not hold {recipe.heads.type} heads, which {args.recipe} trains"
        )
    model = trainee_class(base, heads, recipe)
    aux_ids = getattr(model, "aux_ids", ())
    if not args.data:  # the trainer's split of the recipe's data
        examples = tokenize_answers(records, tokenizer, recipe)
        _, held_out = split_held_out(examples, recipe.training.eval_fraction, recipe.training.seed)
        if not held_out:
            raise fail(f"{args.recipe} holds no answer out (training.eval_fraction=0); use --data")
        datasets = {"held-out": with_features(base, tokenizer, recipe, held_out, aux_ids)}
    else:
        examples, labels = [], []
        for record in records:
            example = tokenize_answers([record], tokenizer, recipe)
            examples += example
            labels += [category.get(first_user_turn(record[0]), "(no category)")] * len(example)
        if not examples:
            raise fail(f"{args.data}: no answer token within training.max_length")
        dataset = with_features(base, tokenizer, recipe, examples, aux_ids)
        datasets = by_category(dataset, labels) if category else {"all": dataset}
    scores: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, dataset in datasets.items():
            metrics = evaluate(model, dataset, recipe, tokenizer.pad_token_id, base.device)
            if not original_known:
                metrics = {k: v for k, v in metrics.items() if k not in ("eval/loss", "eval/kl")}
            scores[name] = {"answers": len(dataset), **metrics}
    keys = [k for k in scores[next(iter(scores))] if k not in ("answers", "eval/loss")]
    print("| answers | n | " + " | ".join(k.removeprefix("eval/") for k in keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for name, row in scores.items():
        print(f"| {name} | {row['answers']} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(scores, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        try:
            raise SystemExit(main())
        except KeyboardInterrupt:  # the scores are printed at the end: nothing to keep
            print("\neval_heads interrupted: nothing written", file=sys.stderr)
            raise SystemExit(130) from None
