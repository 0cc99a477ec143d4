"""The self-distilled data on disk: ShareGPT JSONL shards written atomically, and the manifest
that records the generation settings a run may be resumed (or extended) with."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from heads.config import same_base
from train.data import resolve_chat_template, with_system_prompt
from train.prompts import Message, conversation_id, expand_sources

MANIFEST = "manifest.json"
FORMAT = "headstart-distill-1"


class DistillError(RuntimeError):
    """A run that cannot start or continue (changed recipe, unreadable shard, ...)."""


def asked_turns(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """The turns distill asks the base: system and user ones, with the recipe's system prompt
    (the base writes every answer anew)."""
    return with_system_prompt([m for m in messages if m["role"] != "assistant"], system_prompt)


def prompt_id(messages: list[Message], system_prompt: str | None) -> str:
    """The id distill gives a prompt (see `record_id`)."""
    return conversation_id(asked_turns(messages, system_prompt))


def record_id(prompt: str, sample: int) -> str:
    """The id of a prompt's `sample`-th record: PROMPT_ID-SAMPLE."""
    return f"{prompt}-{sample}"


def answered_prompts(out_dir: Path) -> tuple[set[str], str | None]:
    """The prompt ids a distill output holds records of, and the system prompt its recipe added
    (what `prompt_id` needs to recognise them in a prompt source)."""
    if not (out_dir / MANIFEST).is_file():
        raise DistillError(f"{out_dir} is not a distill output (no {MANIFEST})")
    settings = recorded_settings(out_dir)
    ids = {i.rpartition("-")[0] for i in read_done_ids(out_dir)}
    return ids, settings.get("system_prompt")


def read_done_ids(out_dir: Path) -> set[str]:
    """Ids of every record already in a shard (any rank)."""
    done: set[str] = set()
    for path in sorted(out_dir.glob("shard-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    done.add(json.loads(line)["id"])
                except (ValueError, KeyError, TypeError) as e:
                    raise DistillError(f"{path}:{lineno}: unreadable record ({e})") from e
    return done


def recorded_manifest(out_dir: Path) -> dict[str, Any]:
    """`out_dir`'s manifest ({} when there is none)."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        return manifest
    except ValueError as e:
        raise DistillError(
            f"{path} is damaged ({e}): restore it (it records the settings of the answers "
            "written there), or use another data.output_dir"
        ) from e


def recorded_settings(out_dir: Path) -> dict[str, Any]:
    """The settings in `out_dir`'s manifest ({} when there is none)."""
    return recorded_manifest(out_dir).get("settings") or {}


def template_sha1(template: str) -> str:
    """The fingerprint of a chat template that a distill manifest records."""
    return hashlib.sha1(template.encode()).hexdigest()


def check_template(out_dir: Path, sha1: str) -> None:
    """Refuse to add answers under another chat template than the ones there were written in
    (the tokenizer's template changed, or data.chat_template's file): the training examples
    would be rendered in one template and half their answers written in another."""
    was = recorded_manifest(out_dir).get("chat_template_sha1")
    if was and was != sha1 and read_done_ids(out_dir):
        raise DistillError(
            f"{out_dir} holds answers written under another chat template (sha1 {was[:12]} "
            f"there, {sha1[:12]} now: the tokenizer's template or data.chat_template's "
            "file changed). Use another data.output_dir, or restore that template to resume."
        )


def check_manifest(out_dir: Path, settings: dict[str, Any]) -> None:
    """Refuse to continue a run made with other generation settings."""
    old = recorded_settings(out_dir)
    if not old:
        return
    diffs = [
        f"{key}: {old.get(key)!r} in the manifest, {settings.get(key)!r} now"
        for key in sorted(set(old) | set(settings))
        if old.get(key) != settings.get(key)
        and not (key == "limit" and _extends(old, settings))
        and not (key == "sources" and _adds_sources(old, settings))
        and not (key == "num_samples" and _adds_samples(old, settings))
    ]
    if diffs:
        raise DistillError(
            f"{out_dir} holds a run made with other settings ({'; '.join(diffs)}). "
            "Use another data.output_dir, or restore the settings to resume it."
        )


def _extends(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """A larger (or no) limit extends a run: the shuffled prompts under a limit are a prefix."""
    was, now = old.get("limit"), new.get("limit")
    return now is None or (was is not None and now >= was)


def _adds_sources(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """More sources extend a run that now takes every prompt (no limit): the records written are
    kept by their ids, and only the prompts not yet answered are generated."""
    return new.get("limit") is None and set(old.get("sources") or []) <= set(new.get("sources"))


def _adds_samples(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """More answers per prompt extend a run: a prompt's records are PROMPT_ID-0, -1, ..., so the
    ones written stay and only the new samples are generated."""
    return new.get("num_samples", 1) >= old.get("num_samples", 1)


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Buffers records and writes them as numbered shards of this rank."""

    def __init__(self, out_dir: Path, rank: int, records_per_shard: int):
        self.out_dir, self.rank, self.size = out_dir, rank, records_per_shard
        self.buffer: list[dict[str, Any]] = []
        existing = [
            int(p.stem.rsplit("-", 1)[1]) for p in out_dir.glob(f"shard-r{rank:03d}-*.jsonl")
        ]
        self.next_index = max(existing, default=-1) + 1

    def add(self, record: dict[str, Any]) -> None:
        self.buffer.append(record)
        if len(self.buffer) >= self.size:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.buffer)
        write_atomic(self.out_dir / f"shard-r{self.rank:03d}-{self.next_index:05d}.jsonl", lines)
        self.next_index += 1
        self.buffer = []


def distilled_otherwise(out_dir: str | Path, recipe, tokenizer) -> list[str]:
    """How the answers in `out_dir` were made otherwise than `recipe` trains for: by another
    base, under another chat template or system prompt (empty when alike or without a manifest).
    """
    try:
        manifest = recorded_manifest(Path(out_dir))
    except (OSError, DistillError):  # unreadable: distill's own check says so
        return []
    settings = manifest.get("settings") or {}
    notes = []
    named = recipe.model.name_or_path
    recorded = [n for n in (settings.get("base_model"), manifest.get("base_model")) if n]
    if recorded and not any(same_base(named, n) for n in recorded):
        notes.append(f"base {manifest.get('base_model')!r} (this recipe trains for {named!r})")
    template = resolve_chat_template(tokenizer, recipe.data.chat_template)
    sha1 = manifest.get("chat_template_sha1")
    if sha1 and sha1 != template_sha1(template):
        notes.append("another chat template than the recipe's data.chat_template")
    if "system_prompt" in settings and settings["system_prompt"] != recipe.data.system_prompt:
        notes.append(
            f"system prompt {settings['system_prompt']!r} (this recipe: "
            f"{recipe.data.system_prompt!r})"
        )
    return notes


def selected_otherwise(out_dir: str | Path, recipe) -> list[str]:
    """The recipe's `data.sources`, `data.limit` and `data.num_samples` where they differ from
    those `out_dir`'s answers were distilled with: they choose what distill answers, and
    training reads every answer in the folder whatever they say."""
    try:
        settings = recorded_settings(Path(out_dir))
    except (OSError, DistillError):
        return []
    named = {
        "sources": expand_sources(recipe.data.sources),  # as the manifest spells them
        "limit": recipe.data.limit,
        "num_samples": recipe.data.num_samples,
    }

    def compared(key: str, value):  # sources in any order
        return sorted(map(str, value)) if key == "sources" and isinstance(value, list) else value

    return [
        f"data.{key}={getattr(recipe.data, key)!r} (distilled with {settings[key]!r})"
        for key, value in named.items()
        if key in settings and compared(key, settings[key]) != compared(key, value)
    ]


def summarize_shards(out_dir: Path) -> dict[str, int]:
    """Counts of the records in `out_dir`'s shards, for its manifest."""
    records = unfinished = dropped = 0
    for path in sorted(out_dir.glob("shard-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                records += 1
                unfinished += not record["finished"]
                dropped += record.get("dropped_turns", 0)
    return {"records_written": records, "unfinished": unfinished, "turns_dropped_too_long": dropped}
