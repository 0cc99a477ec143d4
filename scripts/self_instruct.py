"""Self-instruct: the base writes new prompts, for more diverse self-distilled data.

python scripts/self_instruct.py RECIPE.yaml [self_instruct.num_prompts=2000 ...]
python scripts/self_instruct.py RECIPE.yaml self_instruct.method=magpie self_instruct.max_new_tokens=96
python scripts/distill.py RECIPE.yaml 'data.sources=[embedded,runs/self-instruct/prompts.jsonl]'

Reads the recipe's `model` and `self_instruct` sections (and `data.batch_size`; with `magpie`,
the chat template and system prompt of `data`). Two ways to write a request (`method`):

- `list`: the base is shown a numbered list of `examples_per_prompt` requests of one category,
  drawn from `seed_sources` (single-turn, one-line requests), as plain text without a chat
  template, and continues the list: its next line, sampled, is a new request. Categories take
  turns.
- `magpie` (Magpie, Xu et al. 2024): the base is shown its chat template up to where a user's
  message begins (after the recipe's system prompt) and nothing else; what it samples until EOS
  or the template's end of a user's message is a new request, of the kind its chat tuning saw.
  No seeds.

A request is kept when the base ended it within `max_new_tokens`, it has 3-80 words, and its
word-set Jaccard similarity to every seed and every kept prompt is at most `max_similarity`.
Kept prompts go to `output` as JSONL records `{"prompt", "category"}` (a prompt source for
`data.sources`; "magpie" is the category of magpie requests, and a file holds one method's),
rewritten atomically after every batch: rerunning continues a killed run, and a larger
`num_prompts` extends a finished one. Each batch samples under a seed of `self_instruct.seed`,
the number of prompts kept before it and the batches already run at that number, so the same
command writes the same file on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import re
import sys
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from heads.base import load_base
from train.answering import eos_token_ids
from train.config import Recipe, RecipeError, SelfInstructConfig, load_recipe
from train.console import warnings_as_lines
from train.data import ChatTemplateError, render_conversation
from train.distilled import asked_turns, write_atomic
from train.prompts import Prompt, PromptSourceError, jsonl_records, load_prompts

logger = logging.getLogger("self_instruct")

HEADER = "Requests that users sent to an AI assistant:\n"
MAGPIE = "magpie"  # the method, and the category of its requests
# Prompts shown to the base -> one (request written, ended within max_new_tokens) each.
Write = Callable[[list[str]], list[tuple[str, bool]]]
MAX_SEED_CHARS = 300


def category_of(prompt: Prompt) -> str:
    """ "embedded:math" for the embedded set; a file's name for a file (its line number cut);
    "hf:ORG/NAME:SPLIT" for a Hub dataset (its row number cut)."""
    return re.sub(r"(:\d+| row \d+)$", "", prompt.source)


def seed_pools(prompts: list[Prompt]) -> dict[str, list[str]]:
    """Category -> its single-turn, one-line requests (a numbered list needs one line each)."""
    pools: dict[str, list[str]] = {}
    for p in prompts:
        users = [m["content"].strip() for m in p.messages if m["role"] == "user"]
        if len(users) == 1 and "\n" not in users[0] and len(users[0]) <= MAX_SEED_CHARS:
            pools.setdefault(category_of(p), []).append(users[0])
    return {c: texts for c, texts in sorted(pools.items()) if texts}


def list_prompt(examples: list[str]) -> str:
    numbered = "".join(f"{i}. {text}\n" for i, text in enumerate(examples, 1))
    return f"{HEADER}{numbered}{len(examples) + 1}."


def user_turn(tokenizer, chat_template: str | None, system_prompt: str | None) -> tuple[str, str]:
    """(prefix, end): the chat template rendered up to where a user's message begins, which the
    base continues with a request of its own (magpie), and the text that ends a user's message
    (ChatML's `<|im_end|>`, Llama 2's `[/INST]`), where the request stops."""
    marker = "\u2063magpie-user-message\u2063"
    messages = asked_turns([{"role": "user", "content": marker}], system_prompt)
    try:
        text = render_conversation(messages, tokenizer, chat_template=chat_template)
    except ChatTemplateError as e:  # the template's own error, said for this use
        raise ChatTemplateError(
            f"the chat template cannot render a user's message: {e.__cause__ or e}"
        ) from e
    start = text.find(marker)
    after = text[start + len(marker) :].split() if text.count(marker) == 1 else []
    end = after[0] if after else ""
    if start <= 0 or not end:
        raise ChatTemplateError(
            "self_instruct.method=magpie needs a chat template that renders a user's message "
            "between some opening text and an end marker; use method=list with this template"
        )
    return text[:start], end


def clean(text: str, numbered: bool = True) -> str | None:
    """The request in a generated text, or None when it is not one. `numbered`: a list line,
    whose "8." and enclosing quotes are removed."""
    text = text.strip()
    if numbered:
        text = re.sub(r"^\d+\.(?!\d)\s*", "", text)  # "8. ..." -> "...", not "2.5 kg ..."
        if len(text) > 1 and text[0] == text[-1] == '"':  # a quoted request, not one that quotes
            text = text[1:-1].strip()
    n_words = len(text.split())
    return text if 3 <= n_words <= 80 else None


def word_set(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"\w+", text.lower()))


class NearDuplicates:
    """Word-set Jaccard similarity against every text added so far."""

    def __init__(self, threshold: float):
        self.threshold, self.sets = threshold, []

    def add(self, text: str) -> None:
        self.sets.append(word_set(text))

    def near(self, text: str) -> bool:
        words = word_set(text)
        return any(len(words & s) > self.threshold * len(words | s) for s in self.sets if words & s)


def transformers_writer(model, tokenizer, cfg: SelfInstructConfig, end: str | None = None) -> Write:
    """Batched sampling of one request per prompt: (text, ended), ended False when
    max_new_tokens cut it. A list line ends at a newline or EOS; a magpie request at EOS or at
    `end`, the text that ends a user's message (see `user_turn`)."""
    device = next(model.parameters()).device
    eos_ids = eos_token_ids(tokenizer, model.generation_config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    stop = end if cfg.method == MAGPIE else "\n"
    if not stop:
        raise ValueError("a magpie writer needs the text that ends a user's message")
    special = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]

    @torch.no_grad()
    def write(texts: list[str]) -> list[tuple[str, bool]]:
        # A magpie prefix is chat-template text, its BOS written in; a list is plain text, which
        # the tokenizer starts as the model read its training text (Llama 3's, Gemma's BOS)
        plain_text = cfg.method != MAGPIE
        rows = [tokenizer(t, add_special_tokens=plain_text)["input_ids"] for t in texts]
        T = max(map(len, rows))
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # left padded
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, T - len(r) :], mask[i, T - len(r) :] = torch.tensor(r), 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=cfg.max_new_tokens,
            do_sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=0,
            stop_strings=[stop],
            tokenizer=tokenizer,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            cache_implementation="static",  # a growing cache re-copies itself every step
        )
        written = []
        for row in out[:, T:].tolist():  # new tokens, up to the first EOS
            cut = next((i for i, t in enumerate(row) if t in eos_ids), None)
            text = tokenizer.decode(row[:cut], skip_special_tokens=False)
            head = text.split(stop)[0]
            for token in special:  # as skip_special_tokens would, once the stop is found
                head = head.replace(token, "")
            written.append((head, cut is not None or stop in text))
        return written

    return write


def read_kept(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    kept = []
    for where, record in jsonl_records(path):
        if isinstance(record, Exception):  # a line that is not UTF-8 or not JSON
            raise PromptSourceError(f"{where}: {record}")
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise PromptSourceError(
                f'{where}: not a {{"prompt": ...}} line as self_instruct writes them (edited '
                "by hand?): mend or remove the line, or write to another self_instruct.output"
            )
        kept.append(record)
    return kept


def settings_path(out: Path) -> Path:
    """Where the settings that wrote `out`'s prompts are kept: OUTPUT.settings.json."""
    return out.with_name(out.name + ".settings.json")


def writing_settings(recipe: Recipe) -> dict:
    """What shapes the prompts written (a rerun may raise num_prompts only)."""
    cfg = recipe.self_instruct
    settings = {
        "model": recipe.model.name_or_path,
        **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("num_prompts", "output")},
        "batch_size": recipe.data.batch_size,  # the batches' seeds follow it
    }
    if cfg.method == MAGPIE:  # what the base is shown
        settings.pop("seed_sources")
        settings.pop("examples_per_prompt")
        settings["chat_template"] = recipe.data.chat_template
        settings["system_prompt"] = recipe.data.system_prompt
    return settings


def check_same_settings(out: Path, settings: dict, written: bool) -> None:
    """Refuse to add to prompts written under other settings (those of a folder from before
    settings were recorded are taken as they are)."""
    path = settings_path(out)
    if not written or not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PromptSourceError(f"{path} cannot be read ({e}): delete it to go on") from e
    changed = [
        f"{k}: {recorded.get(k)!r} there, {v!r} now"
        for k, v in settings.items()
        if recorded.get(k) != v
    ]
    if changed:
        raise PromptSourceError(
            f"{out} holds prompts written under other settings ({'; '.join(changed)}): rerun "
            "with those (num_prompts may grow), or give another self_instruct.output"
        )


def self_instruct(recipe: Recipe, write: Write | None = None, tokenizer=None) -> dict:
    """Write (or continue) the prompt file; returns counts. `write` stands in for the model
    (with `tokenizer`, the base's, for magpie's chat template)."""
    cfg = recipe.self_instruct
    magpie = cfg.method == MAGPIE
    pools: dict[str, list[str]] = {}
    if not magpie:
        prompts, _ = load_prompts(cfg.seed_sources, seed=cfg.seed)
        pools = seed_pools(prompts)
        if not pools:
            raise PromptSourceError(
                f"no single-turn one-line requests of at most {MAX_SEED_CHARS} characters in "
                f"{cfg.seed_sources} to show the base"
            )
    out = Path(cfg.output)
    kept = read_kept(out)
    if any((r.get("category") == MAGPIE) != magpie for r in kept):
        raise PromptSourceError(
            f"{out} holds prompts written by the other self_instruct method; give this one its "
            "own self_instruct.output"
        )
    settings = writing_settings(recipe)
    check_same_settings(out, settings, bool(kept))
    prefix = end = None
    if write is None:
        dtype = None if recipe.model.dtype == "auto" else recipe.model.dtype
        model, tokenizer = load_base(
            recipe.model.name_or_path,
            dtype=dtype,
            device="cuda" if torch.cuda.is_available() else "cpu",
            attn_implementation=recipe.model.attn_implementation,
        )
    if magpie:
        if tokenizer is None:
            raise ValueError("a stand-in writer for magpie needs the base's tokenizer")
        prefix, end = user_turn(tokenizer, recipe.data.chat_template, recipe.data.system_prompt)
    if write is None:
        write = transformers_writer(model, tokenizer, cfg, end)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(settings_path(out), json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    seen = NearDuplicates(cfg.max_similarity)
    for text in [t for texts in pools.values() for t in texts] + [r["prompt"] for r in kept]:
        seen.add(text)
    categories = list(pools) or [MAGPIE]
    rejected: Counter[str] = Counter()
    batch_size = recipe.data.batch_size
    bar = tqdm(total=cfg.num_prompts, initial=min(len(kept), cfg.num_prompts), unit="prompt")
    tries = Counter()  # batches run at each number of prompts kept
    while len(kept) < cfg.num_prompts:
        # Seeded by what is already kept (and the batches run since one was): a rerun after a
        # kill shows the same examples and samples the same requests; a batch that kept
        # nothing is not repeated as it was.
        seed = f"{cfg.seed}-{len(kept)}-{tries[len(kept)]}"
        tries[len(kept)] += 1
        rng = random.Random(seed)
        torch.manual_seed(zlib.crc32(seed.encode()))
        cats = [categories[(len(kept) + i) % len(categories)] for i in range(batch_size)]
        if magpie:
            shown = [prefix] * batch_size
        else:
            shown = [
                list_prompt(rng.sample(pools[c], min(cfg.examples_per_prompt, len(pools[c]))))
                for c in cats
            ]
        before = len(kept)
        for cat, (line, ended) in zip(cats, write(shown)):
            text = clean(line, numbered=not magpie)
            if not ended:
                rejected["cut at max_new_tokens"] += 1
            elif text is None:
                rejected["length"] += 1
            elif seen.near(text):
                rejected["near duplicate"] += 1
            elif len(kept) < cfg.num_prompts:
                kept.append({"prompt": text, "category": cat})
                seen.add(text)
        write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        bar.update(len(kept) - before)
        bar.set_postfix(rejected=sum(rejected.values()))
        if sum(rejected.values()) > 50 * cfg.num_prompts:
            logger.warning("stopping: almost every line is rejected (%s)", dict(rejected))
            break
    bar.close()
    return {"kept": len(kept), "rejected": dict(rejected), "output": str(out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "recipe",
        help="recipe YAML (model, self_instruct, data.batch_size; magpie: data.chat_template, "
        "data.system_prompt)",
    )
    parser.add_argument("overrides", nargs="*", default=[], help="key=value or section.key=value")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        summary = self_instruct(load_recipe(args.recipe, args.overrides))
    except (RecipeError, PromptSourceError, ChatTemplateError, FileNotFoundError) as e:
        print(f"self_instruct failed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the file is rewritten whole after every batch
        print(
            "\nself_instruct interrupted: the prompts kept are in the file; the same command "
            "writes the rest",
            file=sys.stderr,
        )
        return 130
    rejected = ", ".join(f"{n} {why}" for why, n in sorted(summary["rejected"].items()))
    print(f"{summary['kept']} prompts in {summary['output']} (rejected: {rejected or 'none'})")
    return 0


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        raise SystemExit(main())
