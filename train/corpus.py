"""Text corpora for teacher-forced training: data that needs no generation.

One forward of the frozen base over existing text gives its features and its own next-token
distribution at every position (the soft labels the heads learn), at many times the tokens per
second of generating answers. EAGLE-1 trained on fixed, not regenerated, conversations and still
reached tau ~3.6, so such text is useful beside the self-distilled answers, which stay the best
match for what the base writes.

`training.text_corpus` lists sources:
- `embedded`: text that ships with every Python and the installed packages, so it works offline
  on a fresh machine: Python's language reference (`pydoc_data.topics`) and the long
  descriptions (READMEs) of the installed distributions. Technical English, markdown and code.
- a `.txt` / `.md` file, or a folder of them: one document per file.

Each document is cut into chunks of about `CHUNK_WORDS` words on paragraph boundaries. With a
chat template, a chunk becomes the assistant's answer to "Tell me about <title>." so the base's
features are those of its assistant turns, as at inference; without one, the chunk is plain
text. Every token of the chunk is a target either way.
"""

from __future__ import annotations

import importlib.metadata
import random
import re
from pathlib import Path

from train.prompts import Message

CHUNK_WORDS = 180  # ~250 tokens: close to the length of a distilled answer
EMBEDDED = "embedded"
Document = tuple[str, str]  # (title, text)
_RULE = re.compile(r"^\s*([*=~^#-])\1{2,}\s*$")  # a heading's underline


def _unwrap(text: str) -> list[str]:
    """Paragraphs of hard-wrapped text; indented blocks (code, grammar) keep their lines."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.strip("\n").splitlines() if not _RULE.match(line)]
        if not lines or not "".join(lines).strip():
            continue
        if any(line.startswith((" ", "\t")) for line in lines):
            paragraphs.append("\n".join(lines))
        else:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return paragraphs


def embedded_documents() -> list[Document]:
    """Python's language reference and the installed packages' descriptions (offline)."""
    docs: list[Document] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        docs.append((f"the Python topic '{name}'", topics[name]))
    seen = set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"]
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if name and name.lower() not in seen and len(body.split()) >= 50:
            seen.add(name.lower())
            docs.append((f"the {name} package", body))
    return docs


def file_documents(path: str | Path) -> list[Document]:
    """One document per `.txt` / `.md` file (a folder is read recursively, sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md"))
        if not files:
            raise FileNotFoundError(f"text corpus {path}: no .txt or .md files in it")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(
            f"text corpus {path!s}: no such file or folder (or use '{EMBEDDED}')"
        )
    return [
        (p.stem.replace("_", " ").replace("-", " "), p.read_text(encoding="utf-8")) for p in files
    ]


def chunk_documents(docs: list[Document], words: int = CHUNK_WORDS) -> list[Document]:
    """Cut documents into chunks of about `words` words on paragraph boundaries."""
    chunks: list[Document] = []
    for title, text in docs:
        current: list[str] = []
        count = 0
        for paragraph in _unwrap(text):
            current.append(paragraph)
            count += len(paragraph.split())
            if count >= words:
                chunks.append((title, "\n\n".join(current)))
                current, count = [], 0
        if count >= words // 4:  # a short tail alone teaches little
            chunks.append((title, "\n\n".join(current)))
    return chunks


def corpus_chunks(sources: list[str], seed: int = 0) -> list[Document]:
    """The chunks of every source, in a seeded shuffled order (so a token cap takes a mix)."""
    docs: list[Document] = []
    for source in sources:
        docs += embedded_documents() if source == EMBEDDED else file_documents(source)
    chunks = chunk_documents(docs)
    random.Random(seed).shuffle(chunks)
    return chunks


def as_conversation(chunk: Document) -> list[Message]:
    """A chunk as the assistant's answer to a request for it."""
    title, text = chunk
    return [
        {"role": "user", "content": f"Tell me about {title}."},
        {"role": "assistant", "content": text},
    ]
