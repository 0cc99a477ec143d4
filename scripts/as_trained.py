"""--as-trained (chat.py, bench.py): the system prompt and chat template heads were trained
under, as their config.json records them (`training_system_prompt`, `training_chat_template`:
the recipe's data.system_prompt and data.chat_template, where it set them). Heads draft best
under the prompts they learned from."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_methods import BenchError

from heads.checkpoint import read_config

HELP = (
    "the system prompt and chat template the heads were trained under, as their config.json "
    "records them (the recipe's data.system_prompt and data.chat_template); --system-prompt and "
    "--chat-template, where given, win"
)
# (flag, config key, what is said when no heads record one)
PROMPTS = (
    ("system_prompt", "training_system_prompt", "no system prompt recorded"),
    ("chat_template", "training_chat_template", "no chat template recorded (the tokenizer's)"),
)


def check_flag(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.as_trained and not args.heads:
        parser.error("--as-trained takes the prompts the --heads were trained under: give --heads")


def read_trained(folder: Path) -> dict[str, str | None]:
    """The training prompts a heads folder records, by config key (None: not recorded)."""
    config = read_config(folder)
    found = {}
    for _, key, _ in PROMPTS:
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            raise BenchError(
                f"--heads: {folder / 'config.json'}: {key} is a {type(value).__name__}, not text"
            )
        found[key] = value
    return found


def same(key: str, a: str | None, b: str | None) -> bool:
    """Whether two recorded values are one: a template read from a file ends in the newline that
    Jinja drops (one, not more)."""
    if key == "training_chat_template" and a is not None and b is not None:
        return a.removesuffix("\n") == b.removesuffix("\n")
    return a == b


def _shown(key: str, value: str | None) -> str:
    if value is None:
        return "none"
    if key == "training_system_prompt":
        return json.dumps(value, ensure_ascii=False)
    return f"a template of {len(value)} characters"


def take_as_trained(args: argparse.Namespace, folders: list[Path]) -> str:
    """Fill --system-prompt and --chat-template, where not given, with what the heads `folders`
    record; returns a line saying what was taken. Heads that record different ones (or one of
    them none) are refused: one conversation is rendered one way."""
    trained = {folder: read_trained(folder) for folder in folders}
    taken = []
    for flag, key, none in PROMPTS:
        if getattr(args, flag) is not None:
            continue
        first, value = folders[0], trained[folders[0]][key]
        if other := [f for f in folders if not same(key, trained[f][key], value)]:
            raise BenchError(
                f"--as-trained: {first} records {_shown(key, value)} as its {key}, {other[0]} "
                f"{_shown(key, trained[other[0]][key])}: give --{flag.replace('_', '-')}"
            )
        setattr(args, flag, value)
        if value is None:
            taken.append(none)
        elif flag == "system_prompt":
            taken.append(f"the system prompt {_shown(key, value)}")
        else:
            taken.append("the chat template they record")
    return f"as trained: {'; '.join(taken)}" if taken else ""


def note_training_prompts(name: str, folder: Path, args, template: str) -> None:
    """Say where the heads learned under another system prompt or chat template than this chat
    has (their config records those their recipe set): they draft less well under others."""
    trained = read_trained(folder)
    system = trained["training_system_prompt"]
    if system is not None and system != args.system_prompt:
        print(
            f"note: {name} learned under the system prompt {_shown('training_system_prompt', system)}"
            ": --as-trained (or --system-prompt) gives it",
            file=sys.stderr,
        )
    recorded = trained["training_chat_template"]
    if recorded is not None and not same("training_chat_template", recorded, template):
        print(
            f"note: {name} learned under another chat template (training_chat_template of "
            f"{folder / 'config.json'}): --as-trained gives it",
            file=sys.stderr,
        )
