"""The embedded prompt set: headstart's offline default prompts, built from the templates and
topics in `train/prompt_data/*.json` and from the Python standard library that ships with the
interpreter. `train.prompts.embedded_prompts` gives them as prompts (source `embedded`)."""

from __future__ import annotations

import ast
import functools
import json
import math
import random
import sysconfig
from pathlib import Path
from typing import Any

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
# Share of embedded prompts that get a second user turn (answered in context by distill).
_FOLLOWUP_RATE = 0.15


@functools.lru_cache(maxsize=1)
def embedded_turns() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(category, user turns) of every embedded prompt, every category, in a fixed order."""
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
