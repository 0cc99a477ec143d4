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

import ast
import functools
import gzip
import hashlib
import itertools
import json
import logging
import math
import random
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

Message = dict[str, str]
OnError = Literal["skip", "stop"]

EMBEDDED_CATEGORIES = (
    "chat",
    "writing",
    "coding",
    "math",
    "translation",
    "summarization",
    "qa",
    "extraction",
)
# Not in `embedded` (the demo's data and figures were measured without them); by name only,
# or with every other category as `embedded:all` (the full CPU recipes' data).
EXTRA_CATEGORIES = ("roleplay", "reasoning", "knowledge", "compositions")
_DATA_DIR = Path(__file__).with_name("prompt_data")
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
# Share of embedded prompts that get a second user turn (answered in context by distill).
_FOLLOWUP_RATE = 0.15


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


def normalize_record(record: Any, empty_answers: bool = False) -> list[Message]:
    """Turn one ShareGPT / OpenAI / MT-bench / `prompt` record into a list of messages.

    Leading assistant turns (some ShareGPT dumps start with one) are dropped. Raises ValueError
    naming the problem when the record has none of the known forms or a bad turn (empty text;
    `empty_answers` takes empty assistant turns: a base that ended its turn at once).
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
    empty = empty_answers and role == "assistant"
    return {"role": role, "content": _text(turn[text_key], f"turn {i}", empty)}


def read_source(spec: str, *, on_error: OnError = "skip") -> tuple[list[Prompt], list[str]]:
    """Read one source; returns (prompts, messages about skipped malformed records).

    Raises PromptSourceError for a missing or unreadable source, for a malformed record when
    `on_error="stop"`, and when the source yields no prompt at all.
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
        else:
            raise PromptSourceError(
                f"prompt source '{spec}' not found: expected a .jsonl/.jsonl.gz/.json file, a folder, "
                "'embedded' or 'hf:ORG/NAME:SPLIT'"
            )
    prompts, skipped = [], []
    for where, record in records:
        try:
            if isinstance(record, Exception):  # a line that is not valid JSON
                raise record
            messages = normalize_record(record)
        except ValueError as e:
            message = f"{where}: {e}"
            if on_error == "stop":
                raise PromptSourceError(message + " (set data.on_error=skip to skip it)") from e
            logger.warning("skipping malformed record %s", message)
            skipped.append(message)
            continue
        labels = {k: record[k] for k in LABEL_KEYS if k in record}
        prompts.append(Prompt(conversation_id(messages), messages, where, labels))
    if not prompts:
        detail = f" ({len(skipped)} malformed records skipped)" if skipped else ""
        raise PromptSourceError(f"prompt source '{spec}' is empty{detail}")
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
                    line = raw.decode("utf-8")
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
        text = data.decode("utf-8")
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
            if i >= len(text) or text[i] == "]":
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
    a given Python version; disjoint from MT-bench, Spec-Bench and HumanEval (tested).
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
    for category, turns in _embedded_turns():
        if category not in (categories or EMBEDDED_CATEGORIES):
            continue
        messages = [{"role": "user", "content": t} for t in turns]
        prompt = Prompt(conversation_id(messages), messages, f"embedded:{category}")
        if prompt.id not in seen:  # a few template combinations coincide
            seen.add(prompt.id)
            prompts.append(prompt)
    return prompts


@functools.lru_cache(maxsize=1)
def _embedded_turns() -> tuple[tuple[str, tuple[str, ...]], ...]:
    out: list[tuple[str, tuple[str, ...]]] = []
    stdlib = _stdlib_prompts()
    for category in EMBEDDED_CATEGORIES + EXTRA_CATEGORIES:
        spec = json.loads((_DATA_DIR / f"{category}.json").read_text(encoding="utf-8"))
        texts = [t for g in spec["groups"] for t in _expand_group(g, category)]
        texts += [text for cat, text in stdlib if cat == category]
        rng = random.Random(f"headstart-followups-{category}")
        followups = spec.get("followups", [])
        for text in texts:
            if followups and rng.random() < _FOLLOWUP_RATE:
                out.append((category, (text, rng.choice(followups))))
            else:
                out.append((category, (text,)))
    return tuple(out)


def _expand_group(group: dict[str, Any], category: str) -> list[str]:
    """All template x slot combinations, or `count` of them drawn with a fixed seed."""
    templates: list[str] = group["templates"]
    slots = {name: _slot_values(values) for name, values in group.get("slots", {}).items()}
    names = list(slots)
    sizes = [len(templates)] + [len(slots[n]) for n in names]
    total = math.prod(sizes)
    count = group.get("count", total)
    if count >= total:
        picks = range(total)
    else:
        seed = f"headstart-{category}-{templates[0]}"
        picks = sorted(random.Random(seed).sample(range(total), count))
    texts = []
    for index in picks:
        digits = []  # mixed-radix decode of index: (template, slot 1, slot 2, ...)
        for size in reversed(sizes):
            index, digit = divmod(index, size)
            digits.append(digit)
        template_i, *slot_is = reversed(digits)
        values = {n: slots[n][i] for n, i in zip(names, slot_is)}
        # Slot-less templates are literal text (code samples contain braces).
        template = templates[template_i]
        texts.append(template.format(**values) if names else template)
    return texts


def _slot_values(values: list[str] | str) -> list[str]:
    if isinstance(values, str) and values.startswith("@"):  # a shared list: "@texts"
        return json.loads((_DATA_DIR / f"{values[1:]}.json").read_text(encoding="utf-8"))
    return values


_MODULE_TEMPLATES = (
    "Summarise this documentation of the Python `{name}` module in two or three sentences:\n\n{doc}",
    "Explain in plain English what the Python module `{name}` is for, based on its documentation:"
    "\n\n{doc}",
    "Give me three bullet points that summarise this text:\n\n{doc}",
    "I'm new to Python. Read this module description and tell me when I would use it.\n\n{doc}",
)
_FUNCTION_TEMPLATES = (
    "What does this function from Python's `{module}` module do?\n\n```python\n{code}\n```",
    "Explain this Python code step by step:\n\n```python\n{code}\n```",
    "Suggest a few unit tests for this function:\n\n```python\n{code}\n```",
    "Could this function be made simpler or more readable? Show an improved version and explain "
    "the changes.\n\n```python\n{code}\n```",
    "Are there any inputs for which this function might fail or behave surprisingly?\n\n"
    "```python\n{code}\n```",
)
_CLASS_TEMPLATE = (
    "Here is the documentation of the Python class `{name}`. Summarise what it is for and how "
    "to use it.\n\n{doc}"
)
_MAX_STDLIB_FUNCTIONS = 320  # keeps code explanation from crowding out the other categories
_DOCSTRING_TEMPLATE = "Write a clear docstring for this Python function:\n\n```python\n{code}\n```"


def _stdlib_prompts() -> list[tuple[str, str]]:
    """(category, prompt) pairs from the standard library's own sources, if they are present."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith(("_", "test")) or path.stat().st_size > 200_000:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        rng = random.Random(f"headstart-stdlib-{path.stem}")
        doc = ast.get_docstring(tree)
        if doc and len(doc) >= 200:
            template = rng.choice(_MODULE_TEMPLATES)
            out.append(("summarization", template.format(name=path.stem, doc=_clip(doc, 2000))))
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                class_doc = ast.get_docstring(node)
                if class_doc and len(class_doc) >= 300:
                    text = _CLASS_TEMPLATE.format(
                        name=f"{path.stem}.{node.name}", doc=_clip(class_doc, 2000)
                    )
                    out.append(("summarization", text))
                continue
            if not isinstance(node, ast.FunctionDef) or node.name.startswith(("_", "test", "main")):
                continue
            if not 6 <= node.end_lineno - node.lineno + 1 <= 30 or node.decorator_list:
                continue
            code = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            body0 = node.body[0]
            has_doc = ast.get_docstring(node) is not None
            if has_doc and rng.random() < 0.2 and len(node.body) > 1:
                # Drop the docstring's lines and ask for one.
                cut = set(range(body0.lineno, body0.end_lineno + 1))
                kept = [
                    ln
                    for i, ln in enumerate(lines[node.lineno - 1 : node.end_lineno], node.lineno)
                    if i not in cut
                ]
                out.append(("coding", _DOCSTRING_TEMPLATE.format(code="\n".join(kept))))
            else:
                template = rng.choice(_FUNCTION_TEMPLATES)
                out.append(("coding", template.format(module=path.stem, code=code)))
    code = [item for item in out if item[0] == "coding"]
    if len(code) > _MAX_STDLIB_FUNCTIONS:
        keep = set(
            random.Random("headstart-stdlib").sample(range(len(code)), _MAX_STDLIB_FUNCTIONS)
        )
        dropped = {id(item) for i, item in enumerate(code) if i not in keep}
        out = [item for item in out if id(item) not in dropped]
    return out


def _clip(text: str, max_chars: int) -> str:
    """Cut at a paragraph boundary below `max_chars` (or hard-cut one long paragraph)."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    return text[: cut if cut > 0 else max_chars].rstrip()
