"""Tokenising conversations for training: chat-template rendering and assistant-only loss masks.

A conversation is rendered with the tokenizer's chat template (or the recipe's
`data.chat_template`), exactly as at serving time. The loss covers the tokens the model itself
produces when it answers: each assistant message's text and the end-of-turn token that closes
it (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...). Template scaffolding (role headers, the
system prompt, the newline after end-of-turn) and user text get no loss.

Assistant spans are found in characters, then mapped to tokens through the fast tokenizer's
offsets: for assistant turn i, the rendering of turns [0, i) with the generation prompt is a
prefix of the full text and the assistant text starts right after it; the turn ends at the first
special (added) token after the text. This works for any prefix-consistent template without
`{% generation %}` markers. A template that renders an answer in another context than it was
asked in (rewriting earlier turns, or writing text between the generation prompt and the
answer) gives one example per answer instead, each in the context distill asked it in.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from train.prompts import Message, jsonl_records, normalize_record

IGNORE_INDEX = -100  # labels value that cross-entropy ignores


class ChatTemplateError(ValueError):
    """No chat template, or one whose assistant turns cannot be located."""


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, override: str | None = None) -> str:
    """The Jinja template to use: `override` (a template string or a path to a file) or the
    tokenizer's own. A tokenizer without one and no override is an error."""
    if override:
        path = Path(override).expanduser()
        if "{" in override:
            return override
        if path.is_file():
            return path.read_text(encoding="utf-8")
        raise ChatTemplateError(
            f"chat_template={override!r}: no such file, and not a Jinja template (no '{{'): "
            "give a template file's path or the template itself"
        )
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(
            f"tokenizer '{name}' has no chat template; give one (a Jinja string or the path "
            "of a .jinja file) in the recipe as data.chat_template, to scripts/bench.py or "
            "scripts/chat.py as --chat-template"
        )
    return template


def with_system_prompt(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """`messages` with its system turn replaced by `system_prompt` (None keeps them as they are;
    without a system turn the template applies its own default, if it has one)."""
    if system_prompt is None:
        return list(messages)
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": system_prompt}, *rest]


def render_conversation(
    messages: list[Message],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The conversation as text, through the chat template (override or the tokenizer's); a
    template that does not parse, or raises on these messages (Gemma's on a system turn), is a
    ChatTemplateError."""
    template = resolve_chat_template(tokenizer, chat_template)
    roles = ", ".join(m["role"] for m in messages)
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
        )
    except TemplateError as e:
        raise ChatTemplateError(
            f"the chat template cannot render a conversation of turns [{roles}]: {e}"
        ) from e


def _turn_end_markers(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    markers = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    markers.update(t for t in (tokenizer.eos_token,) if t)
    return sorted((m for m in markers if m), key=len, reverse=True)


class TurnContextError(ChatTemplateError):
    """The template renders an answer in another context than it was asked in: it rewrites
    earlier turns (reasoning templates dropping old thinking) or writes text between the
    generation prompt and the answer (Qwen3's empty thinking block)."""


def _turn_parts(
    messages: list[Message],
    i: int,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str | None,
    markers: list[str],
) -> tuple[str, str, str, str]:
    """Assistant turn i as the template renders the conversation up to it: (prompt, gap,
    answer, end). `prompt` is turns [0, i) with the generation prompt (what the base was asked
    with), `gap` what the template writes between it and the answer, `answer` the answer as
    rendered and `end` the text after it up to its end-of-turn marker ("" without one)."""
    prompt = render_conversation(
        messages[:i], tokenizer, chat_template=chat_template, add_generation_prompt=True
    )
    upto = render_conversation(messages[: i + 1], tokenizer, chat_template=chat_template)
    if not upto.startswith(prompt):
        raise TurnContextError(
            f"assistant turn {i}: rendering the turns before it with the generation prompt is "
            "not a prefix of rendering it with them"
        )
    # The answer as written (its leading or trailing whitespace is the base's own tokens),
    # else as templates that trim it render it
    content = messages[i]["content"]
    if not upto.startswith(content, len(prompt)):
        content = content.strip()
    start = upto.find(content, len(prompt))
    if start < 0:
        raise TurnContextError(f"assistant turn {i}: the template renders its text otherwise")
    end = start + len(content)
    tail = upto[end:]
    hits = [(tail.find(m), m) for m in markers if m in tail]
    closing = ""
    if hits:
        pos, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
        closing = tail[: pos + len(marker)]
    return prompt, upto[len(prompt) : start], content, closing


def assistant_spans(
    messages: list[Message],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    end_markers: bool = True,
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages`; return (text, [(start, end) character span of each assistant answer]).

    A span covers the assistant text as rendered and, with `end_markers`, the end-of-turn marker
    that follows it. A TurnContextError when the rendering puts an answer in another context
    than its generation prompt (`conversation_examples` then takes each answer alone).
    """
    text = render_conversation(messages, tokenizer, chat_template=chat_template)
    markers = _turn_end_markers(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, gap, answer, closing = _turn_parts(messages, i, tokenizer, chat_template, markers)
        if not text.startswith(prompt + gap + answer + closing):
            raise TurnContextError(
                f"assistant turn {i}: the chat template is not prefix-consistent (it renders "
                "the turns before it otherwise once it is followed by more)"
            )
        if gap.strip():
            raise TurnContextError(
                f"assistant turn {i}: the chat template writes {gap!r} between the generation "
                "prompt and the answer, which the base did not see when it answered"
            )
        start = len(prompt) + len(gap)
        spans.append((start, start + len(answer) + (len(closing) if end_markers else 0)))
    return text, spans


def _closing_text(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    """What the template writes after an answer up to its end-of-turn marker, from a short
    exchange ("" when it writes no marker)."""
    probe: list[Message] = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
    ]
    markers = _turn_end_markers(tokenizer)
    return _turn_parts(probe, 1, tokenizer, chat_template, markers)[-1]


def turn_end_token_id(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None):
    """The special token the chat template closes an assistant turn with (`<|im_end|>`,
    `<|eot_id|>`, ...), found by rendering a short exchange; None when the template closes it
    with no special token. A base whose EOS ids leave this token out would write past its turn."""
    closing = _closing_text(tokenizer, chat_template)
    if not closing:
        return None
    token = tokenizer(closing, add_special_tokens=False)["input_ids"][-1]
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token)
    return token if added is not None and added.special else None  # not, say, an added "\n"


def tokenize_conversation(
    messages: list[Message],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    system_prompt: str | None = None,
    max_length: int | None = None,
    finished: bool = True,
) -> dict[str, list[int]]:
    """Token ids and the assistant-only loss mask of one conversation.

    `finished=False` (an answer cut at distill's max_new_tokens) leaves the end-of-turn markers
    out of the mask: the template closes the cut answer, but the base never wrote that marker
    there. (A record says only that one of its answers was cut: every turn's marker is left out.)

    Returns `input_ids`, `loss_mask` (1 on tokens the model produced as the assistant: answer
    text and end-of-turn token), `labels` (`input_ids` where the mask is 1, else -100; not
    shifted, as transformers' causal LM losses expect) and `prompt_ids` (the text before the
    first answer, tokenised alone: what identifies the prompt, whatever the answer's first
    token merges with). `max_length` truncates on a token boundary. Needs a fast tokenizer
    (character offsets).
    """
    if not tokenizer.is_fast:
        raise ChatTemplateError("loss masks need a fast tokenizer (return_offsets_mapping)")
    messages = with_system_prompt(messages, system_prompt)
    text, spans = assistant_spans(
        messages, tokenizer, chat_template=chat_template, end_markers=finished
    )
    # The template writes BOS itself where the model wants one.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    loss_mask = [
        int(any(s < span_end and e > span_start for span_start, span_end in spans))
        for s, e in encoding["offset_mapping"]
    ]
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    labels = [t if m else IGNORE_INDEX for t, m in zip(input_ids, loss_mask)]
    # An answer's first token may merge with the template's last (SmolLM2: an answer starting
    # "\n\n" after "assistant\n"), so the tokens before the first target are not the prompt's.
    prompt = text[: spans[0][0]] if spans else text
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "labels": labels,
        "prompt_ids": prompt_ids,
    }


def tokenize_turns(
    messages: list[Message],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    system_prompt: str | None = None,
    max_length: int | None = None,
    finished: bool = True,
) -> list[dict[str, list[int]]]:
    """One example per assistant answer, in the context distill asked it in: the turns before
    it rendered with the generation prompt, then the answer's own tokens and (when `finished`)
    the template's end-of-turn marker. For templates that render an answer otherwise once the
    conversation goes on (`TurnContextError`); the fields are `tokenize_conversation`'s, and
    every answer of a conversation has the first answer's `prompt_ids`."""
    messages = with_system_prompt(messages, system_prompt)
    closing = _closing_text(tokenizer, chat_template) if finished else ""
    closing_ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    examples, first_prompt = [], None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_conversation(
            messages[:i], tokenizer, chat_template=chat_template, add_generation_prompt=True
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        first_prompt = first_prompt or list(prompt_ids)
        input_ids = [*prompt_ids, *answer_ids, *closing_ids][:max_length]
        loss_mask = ([0] * len(prompt_ids) + [1] * (len(answer_ids) + len(closing_ids)))[
            :max_length
        ]
        labels = [t if m else IGNORE_INDEX for t, m in zip(input_ids, loss_mask)]
        examples.append(
            {
                "input_ids": input_ids,
                "loss_mask": loss_mask,
                "labels": labels,
                "prompt_ids": first_prompt,
            }
        )
    return examples


def conversation_examples(
    messages: list[Message],
    tokenizer: PreTrainedTokenizerBase,
    **options,
) -> list[dict[str, list[int]]]:
    """The conversation as one example (`tokenize_conversation`), or one per answer
    (`tokenize_turns`) where the template renders an answer in another context than it was
    asked in (Qwen3's thinking block): either way each answer is trained on in the context the
    base wrote it in."""
    try:
        return [tokenize_conversation(messages, tokenizer, **options)]
    except TurnContextError:
        return tokenize_turns(messages, tokenizer, **options)


def build_examples(
    conversations: list[list[Message]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    system_prompt: str | None = None,
    max_length: int | None = None,
    finished: Sequence[bool] | None = None,
) -> list[dict[str, list[int]]]:
    """`conversation_examples` over many (`finished[i]`: conversation i's answers ran to their
    end, as `read_distilled` says; all by default); drops examples left with no loss token."""
    examples = []
    for i, messages in enumerate(conversations):
        examples += [
            example
            for example in conversation_examples(
                messages,
                tokenizer,
                chat_template=chat_template,
                system_prompt=system_prompt,
                max_length=max_length,
                finished=True if finished is None else finished[i],
            )
            if any(example["loss_mask"])
        ]
    return examples


def load_distilled(output_dir: str | Path, *, finished_only: bool = True) -> list[list[Message]]:
    """The conversations `scripts/distill.py` wrote to `output_dir` (shard order).

    `finished_only` drops answers cut off by max_new_tokens (they never show the model stopping).
    """
    records = read_distilled(output_dir)
    return [messages for messages, finished in records if finished or not finished_only]


def read_distilled(output_dir: str | Path) -> list[tuple[list[Message], bool]]:
    """(conversation, finished) of every record `scripts/distill.py` wrote to `output_dir`, in
    shard order; `finished` is False where an answer was cut at max_new_tokens."""
    files = sorted(Path(output_dir).glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{output_dir}: no .jsonl shards (run scripts/distill.py first)")
    conversations = []
    for where, record in itertools.chain.from_iterable(jsonl_records(f) for f in files):
        try:
            if isinstance(record, Exception):  # a line that is not UTF-8 or not JSON
                raise record
            # an answer ended at once; an empty system turn, distill's data.system_prompt=""
            messages = normalize_record(record, empty_answers=True, empty_system=True)
            conversations.append((messages, bool(record.get("finished", True))))
        except ValueError as e:
            raise ValueError(
                f"{where}: {e} (distill writes its shards as utf-8 JSON lines: edited by hand?)"
            ) from e
    return conversations


def pad_batch(examples: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples into tensors: input_ids, attention_mask, loss_mask, labels (B, T)."""
    T = max(len(e["input_ids"]) for e in examples)
    batch: dict[str, list[list[int]]] = {
        k: [] for k in ("input_ids", "attention_mask", "loss_mask", "labels")
    }
    for e in examples:
        n = T - len(e["input_ids"])
        batch["input_ids"].append(e["input_ids"] + [pad_token_id] * n)
        batch["attention_mask"].append([1] * len(e["input_ids"]) + [0] * n)
        batch["loss_mask"].append(e["loss_mask"] + [0] * n)
        batch["labels"].append(e["labels"] + [IGNORE_INDEX] * n)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
