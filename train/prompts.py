"""Prompt sources, normalised to conversations: lists of {"role", "content"} messages.

Sources (`data.sources` in a recipe):

- a `.jsonl` file, one record per line, or a `.json` file holding a list of records (or one);
- a folder: every `*.jsonl` in it, in name order (e.g. the shards `scripts/distill.py` writes);
- `hf:ORG/NAME[:CONFIG]:SPLIT`: a Hugging Face dataset through `datasets.load_dataset`;
- `embedded` or `embedded:CATEGORY[,CATEGORY]`: the offline default set, or some of its and the
  extra categories (see `embedded_prompts`); `embedded:all` is both, every category.

A record is one of: ShareGPT `{"conversations": [{"from": "human"|"gpt"|"system", "value"}]}`,
OpenAI `{"messages": [{"role", "content"}]}`, MT-bench / Spec-Bench `{"turns": [user, ...]}` or
`{"prompt": str}`. Roles become "system", "user" and "assistant"; assistant turns are kept where a
source has them. A malformed record is reported with its file and line number and either skipped
or raised (`on_error`).
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import random
import shlex
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from train.prompt_set import EMBEDDED_CATEGORIES, EXTRA_CATEGORIES, embedded_turns

logger = logging.getLogger(__name__)

Message = dict[str, str]
# "collect": skip malformed records without a warning, the caller reports them.
OnError = Literal["skip", "stop", "collect"]

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}
_OPENAI_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}


# FastChat's public MT-bench question file, which the README's benchmark commands read
MT_BENCH_URL = (
    "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/"
    "question.jsonl"
)
LABEL_KEYS = ("question_id", "id", "category")  # kept with a prompt (Prompt.labels)


class PromptSourceError(ValueError):
    """A prompt source that cannot be read, or a malformed record (with file and line)."""


@dataclass
class Prompt:
    """One conversation to answer or train on."""

    id: str  # content hash of `messages` (stable across runs and machines)
    messages: list[Message]
    source: str  # where it came from, e.g. "prompts.jsonl:12" or "embedded:coding"
    # the record's own `question_id` / `id` and `category` where it has them (benchmarks)
    labels: dict[str, Any] = field(default_factory=dict)


def conversation_id(messages: list[Message]) -> str:
    """A stable 16-hex-digit id from the roles and contents of `messages`."""
    canonical = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha1(canonical.encode("utf-8")).hexdigest()[:16]


RECORD_FORMS = (
    "each line of a .jsonl file (or each item of a .json list) is a JSON object such as "
    '{"prompt": "..."}, {"turns": ["..."]} (MT-bench, Spec-Bench), {"messages": [{"role": '
    '"user", "content": "..."}]} (OpenAI) or {"conversations": [{"from": "human", "value": '
    '"..."}]} (ShareGPT)'
)


def normalize_record(
    record: Any, empty_answers: bool = False, empty_system: bool = False
) -> list[Message]:
    """Turn one ShareGPT / OpenAI / MT-bench / `prompt` record into a list of messages.

    Leading assistant turns (some ShareGPT dumps start with one) are dropped. Raises ValueError
    naming the problem when the record has none of the known forms or a bad turn (empty text;
    `empty_answers` takes empty assistant turns: a base that ended its turn at once). An empty
    system turn is kept with `empty_system` (distill's, under data.system_prompt=""), else read
    as none (the template's default system prompt applies, as without one).
    """
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns = _as_list(record["conversations"], "conversations")
        messages = [
            _turn(t, "from", "value", _SHAREGPT_ROLES, i, empty_answers)
            for i, t in enumerate(turns)
        ]
    elif "messages" in record:
        turns = _as_list(record["messages"], "messages")
        messages = [
            _turn(t, "role", "content", _OPENAI_ROLES, i, empty_answers)
            for i, t in enumerate(turns)
        ]
    elif "turns" in record:
        turns = _as_list(record["turns"], "turns")
        messages = [
            {"role": "user", "content": _text(t, f"turns[{i}]")} for i, t in enumerate(turns)
        ]
    elif "prompt" in record:
        messages = [{"role": "user", "content": _text(record["prompt"], "prompt")}]
    else:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise ValueError(
            f"no 'conversations', 'messages', 'turns' or 'prompt' field (keys: {keys})"
        )
    system = [m for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    if any(m["role"] == "system" for m in messages[len(system) :]):
        raise ValueError("a system message may only come first")
    if not empty_system:
        system = [m for m in system if m["content"].strip()]
    while rest and rest[0]["role"] == "assistant":
        rest.pop(0)
    if not any(m["role"] == "user" for m in rest):
        raise ValueError("no user message")
    return system + rest


def _as_list(value: Any, name: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{name}' must be a non-empty list")
    return value


def _text(value: Any, where: str, empty: bool = False) -> str:
    if isinstance(value, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(value):
            raise ValueError(f"{where}: only text content parts are supported")
        value = "".join(p for p in parts if isinstance(p, str))
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {type(value).__name__}")
    if not value.strip() and not empty:
        raise ValueError(f"{where}: empty text")
    return value


def _turn(
    turn: Any, role_key: str, text_key: str, roles: dict[str, str], i: int, empty_answers: bool
) -> Message:
    if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
        raise ValueError(f"turn {i}: expected an object with '{role_key}' and '{text_key}'")
    role = roles.get(str(turn[role_key]).lower())
    if role is None:
        raise ValueError(
            f"turn {i}: unsupported role {turn[role_key]!r} (known: {', '.join(roles)})"
        )
    empty = role == "system" or (empty_answers and role == "assistant")  # see normalize_record
    return {"role": role, "content": _text(turn[text_key], f"turn {i}", empty)}


def read_source(spec: str, *, on_error: OnError = "skip") -> tuple[list[Prompt], list[str]]:
    """Read one source; returns (prompts, messages about skipped malformed records).

    Raises PromptSourceError for a missing or unreadable source, for a malformed record when
    `on_error="stop"`, and when the source yields no prompt at all (with `"collect"`, only when
    it has no malformed records either: the caller reports those).
    """
    if spec == "embedded" or spec.startswith("embedded:"):
        categories = spec.partition(":")[2].split(",") if ":" in spec else None
        if categories and "all" in categories:
            if len(categories) > 1:
                raise PromptSourceError(f"{spec}: 'all' stands alone: write embedded:all")
            categories = list(EMBEDDED_CATEGORIES + EXTRA_CATEGORIES)
        return embedded_prompts(categories), []
    if spec.startswith("hf:"):
        records = _hf_records(spec)
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(path.glob("*.jsonl"))
            if not files:
                raise PromptSourceError(f"{path}: folder has no .jsonl files")
            records = itertools.chain.from_iterable(jsonl_records(f) for f in files)
        elif path.is_file() and path.name.endswith(".json.gz"):
            raise PromptSourceError(
                f"{path}: gunzip it (.json is read as it is), or gzip JSON lines as .jsonl.gz"
            )
        elif path.is_file():
            records = _json_records(path) if path.suffix == ".json" else jsonl_records(path)
        elif spec in EMBEDDED_CATEGORIES + EXTRA_CATEGORIES:
            raise PromptSourceError(
                f"prompt source '{spec}' not found; it is an embedded category: write it as "
                f"embedded:{spec} (in a recipe's data.sources list, several categories are one "
                "source in quotes, which the list would otherwise split at the commas: "
                """'data.sources=["embedded:roleplay,reasoning"]')"""
            )
        else:
            # the README's commands read MT-bench's questions from a file the user downloads
            dirs = "" if path.parent.is_dir() else "--create-dirs "
            fetch = f"; save MT-bench's questions first: curl {dirs}-Lo {shlex.quote(spec)} "
            raise PromptSourceError(
                f"prompt source '{spec}' not found: expected a .jsonl/.jsonl.gz/.json file, a folder, "
                "'embedded', 'embedded:CATEGORY', 'embedded:all' or 'hf:ORG/NAME:SPLIT'"
                + (fetch + MT_BENCH_URL if path.name == "mt_bench.jsonl" else "")
            )
    prompts, skipped = [], []
    for where, record in records:
        try:
            if isinstance(record, Exception):  # a line that is not valid JSON
                raise record
            # an empty answer (a base that ended its turn at once, in another run's shards) is
            # no reason to lose the prompt: answers in a prompt source are regenerated
            messages = normalize_record(record, empty_answers=True)
        except ValueError as e:
            message = f"{where}: {e}"
            if on_error == "stop":
                raise PromptSourceError(message + " (set data.on_error=skip to skip it)") from e
            if on_error == "skip":
                logger.warning("skipping malformed record %s", message)
            skipped.append(message)
            continue
        labels = {k: record[k] for k in LABEL_KEYS if k in record}
        prompts.append(Prompt(conversation_id(messages), messages, where, labels))
    if not prompts and not (on_error == "collect" and skipped):
        detail = f" ({len(skipped)} malformed records skipped)" if skipped else ""
        raise PromptSourceError(f"prompt source '{spec}' is empty{detail}; {RECORD_FORMS}")
    return prompts, skipped


# How load_prompts orders the prompts before `limit`: by a seeded hash of each prompt, so that a
# prompt's place does not move when others are added or removed (a shuffle depends on the count:
# one prompt fewer, as another Python's stdlib gives, reordered them all). "shuffle": the order
# of distill runs begun before, which keep it.
PROMPT_ORDER = "prompt-hash"


def load_prompts(
    sources: list[str],
    *,
    limit: int | None = None,
    seed: int = 0,
    on_error: OnError = "skip",
    order: str = PROMPT_ORDER,
) -> tuple[list[Prompt], list[str]]:
    """Read every source, drop exact duplicates, order them (`order`, with `seed`) and keep
    `limit`: a larger limit, or more prompts in the sources, keeps the prompts chosen before
    but for the few that the added ones displace.

    Returns (prompts, messages about skipped malformed records). The result depends only on the
    sources' contents, `limit`, `seed` and `order`.
    """
    if order not in (PROMPT_ORDER, "shuffle"):
        raise ValueError(f"order={order!r}: {PROMPT_ORDER!r} or 'shuffle'")
    if not sources:
        raise PromptSourceError("no prompt sources given")
    prompts: list[Prompt] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for spec in sources:
        got, bad = read_source(spec, on_error=on_error)
        skipped += bad
        for prompt in got:
            if prompt.id not in seen:
                seen.add(prompt.id)
                prompts.append(prompt)
    if order == "shuffle":
        random.Random(seed).shuffle(prompts)
    else:
        prompts.sort(key=lambda p: hashlib.blake2b(f"{seed}:{p.id}".encode()).digest())
    return prompts[:limit] if limit is not None else prompts, skipped


def expand_sources(sources: list[str]) -> list[str]:
    """`embedded:all` spelled out as the two sources it stands for (as distill manifests record
    it, so that either spelling resumes the other's run); other sources as they are."""
    spelled_out = ["embedded", "embedded:" + ",".join(EXTRA_CATEGORIES)]
    return [s for spec in sources for s in (spelled_out if spec == "embedded:all" else [spec])]


def jsonl_records(path: Path):
    """Records of a .jsonl file (gzipped when it ends in .gz), each located by its line; a line
    that is not UTF-8 or not JSON is yielded as the error it is (skipped or stopped on by
    `on_error`), unreadable gzip data stops."""
    with open(path, "rb") as f:
        if f.read(2) == b"\x1f\x8b" and path.suffix != ".gz":
            raise PromptSourceError(f"{path} is gzipped: name it {path.name}.gz, or gunzip it")
    lineno = 0
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM: Notepad's
                except UnicodeDecodeError as e:
                    yield where, ValueError(f"not UTF-8 ({e.reason} at byte {e.start})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    yield where, ValueError(f"invalid JSON: {e.msg} (column {e.colno})")
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise PromptSourceError(f"{path}:{lineno + 1}: unreadable gzip data ({e})") from e


def _json_records(path: Path):
    """Records of a .json file; each located by the line its object starts on."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PromptSourceError(f"{path}:{line}: not UTF-8 ({e.reason}); save it as UTF-8") from e
    decoder = json.JSONDecoder()
    start = len(text) - len(text.lstrip())
    try:
        if not text[start:].startswith("["):
            yield f"{path}:{text.count(chr(10), 0, start) + 1}", json.loads(text)
            return
        i = start + 1
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text):  # cut off: records may be missing
                line = text.rstrip().count(chr(10)) + 1  # its last line
                raise PromptSourceError(f"{path}:{line}: the JSON list has no closing ']'")
            if text[i] == "]":
                if text[i + 1 :].strip():
                    line = text.count(chr(10), 0, i) + 1
                    raise PromptSourceError(f"{path}:{line}: text after the JSON list's ']'")
                return
            record, end = decoder.raw_decode(text, i)
            yield f"{path}:{text.count(chr(10), 0, i) + 1}", record
            i = end
    except json.JSONDecodeError as e:
        # One broken value makes the rest of a JSON file unreadable: always an error.
        raise PromptSourceError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e


def _hf_records(spec: str):
    """`hf:ORG/NAME[:CONFIG]:SPLIT` rows via datasets.load_dataset (needs the Hub or its cache)."""
    parts = spec[len("hf:") :].split(":")
    if len(parts) == 1:
        name, config, split = parts[0], None, "train"
    elif len(parts) == 2:
        name, config, split = parts[0], None, parts[1]
    elif len(parts) == 3:
        name, config, split = parts
    else:
        raise PromptSourceError(f"'{spec}': expected hf:ORG/NAME[:CONFIG]:SPLIT")
    from datasets import load_dataset

    try:
        dataset = load_dataset(name, config, split=split)
    except Exception as e:  # network, missing dataset or split: say which source failed
        raise PromptSourceError(f"'{spec}': could not load the dataset: {e}") from e
    for i, row in enumerate(dataset):
        yield f"{spec} row {i}", dict(row)


def embedded_prompts(categories: list[str] | None = None) -> list[Prompt]:
    """The offline default prompt set (about 3,300 prompts), optionally only some categories.

    Written for headstart: templates x topics in `train/prompt_data/*.json` for chat, writing,
    coding, math, translation, QA, extraction and summarization, plus prompts built from the
    Python standard library that ships with the interpreter (module docstrings to summarise,
    small public functions to explain). About 15% carry a follow-up user turn. Deterministic for
    a given Python version; no 8-word run shared with MT-bench's questions (Spec-Bench's first
    80) or HumanEval's (tested where their files are: MT-bench is not shipped; Spec-Bench's other
    questions were not checked).
    `EXTRA_CATEGORIES` (roleplay, reasoning, knowledge, compositions: 1,796 more prompts) are
    only given by name (or as the source `embedded:all`: the default set, then them).
    """
    known = EMBEDDED_CATEGORIES + EXTRA_CATEGORIES
    unknown = set(categories or ()) - set(known)
    if unknown:
        raise PromptSourceError(
            f"unknown embedded categories {sorted(unknown)}; known: {', '.join(known)} (or all)"
        )
    prompts, seen = [], set()
    for category, turns in embedded_turns():
        if category not in (categories or EMBEDDED_CATEGORIES):
            continue
        messages = [{"role": "user", "content": t} for t in turns]
        prompt = Prompt(conversation_id(messages), messages, f"embedded:{category}")
        if prompt.id not in seen:  # a few template combinations coincide
            seen.add(prompt.id)
            prompts.append(prompt)
    return prompts
