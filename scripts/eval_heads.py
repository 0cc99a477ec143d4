"""Acceptance of trained heads on answers the base wrote, without timing anything.

    python scripts/eval_heads.py RUN/recipe.yaml RUN/heads [--data DISTILLED] [--categories FILE]
        [--out FILE.json] [section.key=value ...]

Runs the trainer's held-out evaluation (train/medusa.py or train/eagle.py, whichever the recipe
names) on trained heads: each head's or TTT step's top-1 against the base's greedy token,
`sim_tau` (1 + leading correct steps, averaged over answer positions) and `walk_tau` (the same
walked in decode order: the tau a fixed chain of the heads' steps decodes at on these answers).

Without `--data` it scores the recipe's own held-out split (`training.eval_fraction` of
`data.output_dir`, the numbers the run reported). With `--data` it scores every answer in that
distill output, e.g. the base's answers to the prompts your users send:

    python scripts/distill.py RUN/recipe.yaml 'data.sources=[mt_bench.jsonl]' \\
        data.limit=null data.output_dir=runs/mtbench-distill
    python scripts/eval_heads.py RUN/recipe.yaml RUN/heads --data runs/mtbench-distill \\
        --categories mt_bench.jsonl

`--categories` (a prompt file whose records have a "category") also scores each category: an
answer belongs to the category of the record whose first user turn it answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from heads import load_heads  # noqa: E402
from heads.medusa import MedusaHeads  # noqa: E402
from train.config import RecipeError, load_recipe  # noqa: E402
from train.data import build_examples, load_distilled  # noqa: E402
from train.features import ExampleDataset, precompute_features  # noqa: E402
from train.prompts import PromptSourceError, normalize_record  # noqa: E402
from train.run import evaluate, load_frozen_base, make_accelerator, prepare_data  # noqa: E402


def fail(message: str) -> SystemExit:
    print(f"error: {message}", file=sys.stderr)
    return SystemExit(2)


def categories_of(path: str) -> dict[str, str]:
    """First user turn -> category, from a prompt file whose records have a "category"."""
    found = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "category" not in record:
                    raise ValueError("no 'category' in this record")
                found[first_user_turn(normalize_record(record))] = record["category"]
            except ValueError as e:
                raise fail(f"{path}:{lineno}: {e}") from None
    return found


def first_user_turn(messages: list[dict[str, str]]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "").strip()


def featurized(base, tokenizer, recipe, conversations, labels, aux_ids):
    """{"all": every answer in file order, label: its answers} as datasets with the base's
    features (one forward over all of them, in memory). Each category keeps the file order, so
    "all" is scored exactly as without categories."""
    examples, kept = [], []
    for conversation, label in zip(conversations, labels):
        example = build_examples(
            [conversation],
            tokenizer,
            chat_template=recipe.data.chat_template,
            system_prompt=recipe.data.system_prompt,
            max_length=recipe.training.max_length,
        )  # [] when nothing of the answer fits in max_length
        examples += example
        kept += [label] * len(example)
    features = precompute_features(
        base, examples, aux_ids, recipe.training.micro_batch_size, tokenizer.pad_token_id
    )
    datasets = {"all": ExampleDataset(examples, features)}
    for label in dict.fromkeys(x for x in kept if x is not None):
        rows = [i for i, x in enumerate(kept) if x == label]
        datasets[label] = ExampleDataset([examples[i] for i in rows], [features[i] for i in rows])
    return datasets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe", help="the recipe the heads were trained with (RUN/recipe.yaml)")
    parser.add_argument("heads", help="heads folder or Hub repo id")
    parser.add_argument("--data", help="a distill output to score instead of the held-out split")
    parser.add_argument("--categories", help="prompt JSONL with a 'category' per record")
    parser.add_argument("--out", help="also write the scores to this JSON file")
    parser.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    args = parser.parse_args(argv)
    if args.categories and not args.data:
        raise fail("--categories groups the answers of --data; give --data too")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except (RecipeError, FileNotFoundError) as e:
        raise fail(str(e)) from None
    heads = load_heads(args.heads)
    kind = "medusa" if isinstance(heads, MedusaHeads) else "eagle"
    if recipe.heads.type != kind:
        raise fail(f"{args.heads} holds {kind} heads but {args.recipe} trains {recipe.heads.type}")
    if kind == "medusa":
        from train.medusa import MedusaTrainee as Trainee

        aux_ids: list[int] = []
    else:
        from train.eagle import EagleTrainee as Trainee

        aux_ids = list(heads.config.aux_layer_ids) if heads.config.version == 3 else []
    accelerator = make_accelerator(recipe)
    base, tokenizer = load_frozen_base(recipe, accelerator)
    heads = load_heads(args.heads, base)
    model = Trainee(base, heads, recipe)
    scores: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        if not args.data:
            _, held_out = prepare_data(recipe, base, tokenizer, accelerator, aux_ids)
            scores["held-out"] = {
                "answers": len(held_out),
                **evaluate(model, held_out, recipe, tokenizer.pad_token_id, base.device),
            }
        else:
            try:
                conversations = load_distilled(args.data, finished_only=False)
                labels: list[str | None] = [None] * len(conversations)
                if args.categories:
                    category = categories_of(args.categories)
                    labels = [category.get(first_user_turn(c), "(none)") for c in conversations]
            except (FileNotFoundError, ValueError, PromptSourceError) as e:
                raise fail(str(e)) from None
            datasets = featurized(base, tokenizer, recipe, conversations, labels, aux_ids)
            if not len(datasets["all"]):
                raise fail(f"{args.data}: no answer with assistant tokens within max_length")
            for name, dataset in datasets.items():
                scores[name] = {
                    "answers": len(dataset),
                    **evaluate(model, dataset, recipe, tokenizer.pad_token_id, base.device),
                }
    keys = [k for k in next(iter(scores.values())) if k not in ("answers", "eval/loss")]
    print("| answers | n | " + " | ".join(k.removeprefix("eval/") for k in keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for name, row in scores.items():
        print(f"| {name} | {row['answers']} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(scores, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
