"""Tokenising conversations: chat-template rendering, assistant-only loss masks, and answers
trained one by one where a template renders them otherwise once the conversation goes on."""

import copy
from types import SimpleNamespace

import pytest

from train.data import (
    IGNORE_INDEX,
    ChatTemplateError,
    build_examples,
    conversation_examples,
    render_conversation,
    resolve_chat_template,
    tokenize_conversation,
    turn_end_token_id,
)

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]

# Llama-3 instruct layout (header tokens, `<|eot_id|>` ends a turn, content trimmed).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Gemma layout: no system role, assistant is "model", `<end_of_turn>` then a newline.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def masked_runs(tokenizer, example) -> list[str]:
    """Decoded text of each maximal run of loss-masked tokens."""
    runs, current = [], []
    for token, masked in zip(example["input_ids"], example["loss_mask"]):
        if masked:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def gemma_tokenizer(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<bos>", "<start_of_turn>", "<end_of_turn>"]}
    )
    tokenizer.bos_token, tokenizer.eos_token = "<bos>", "<eos>"
    tokenizer.chat_template = GEMMA_TEMPLATE
    return tokenizer


def test_chatml_smollm2_golden(smollm2_tokenizer):
    tok = smollm2_tokenizer
    example = tokenize_conversation(CONVERSATION, tok)
    assert tok.decode(example["input_ids"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        "2+2 is 4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
        "It is 6.<|im_end|>\n"
    )
    assert masked_runs(tok, example) == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]
    assert example["labels"] == [
        t if m else IGNORE_INDEX for t, m in zip(example["input_ids"], example["loss_mask"])
    ]
    # Explicit system prompt: rendered, never in the loss.
    example = tokenize_conversation(CONVERSATION, tok, system_prompt="Answer in digits.")
    assert tok.decode(example["input_ids"]).startswith(
        "<|im_start|>system\nAnswer in digits.<|im_end|>\n"
    )
    assert masked_runs(tok, example) == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]


def test_llama3_golden(llama3_tokenizer):
    tok = llama3_tokenizer
    example = tokenize_conversation(CONVERSATION, tok, system_prompt="Be brief.")
    assert tok.decode(example["input_ids"]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n2+2 is 4.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 6.<|eot_id|>"
    )
    assert masked_runs(tok, example) == ["2+2 is 4.<|eot_id|>", "It is 6.<|eot_id|>"]
    # The template trims: padded content is found and its rendered (trimmed) text is masked.
    padded = [CONVERSATION[0], {"role": "assistant", "content": "  4.  "}]
    assert masked_runs(tok, tokenize_conversation(padded, tok)) == ["4.<|eot_id|>"]


def test_gemma_golden_without_system_prompt(gemma_tokenizer):
    tok = gemma_tokenizer
    example = tokenize_conversation(CONVERSATION, tok)
    assert tok.decode(example["input_ids"]) == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
        "2+2 is 4.<end_of_turn>\n<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\nIt is 6.<end_of_turn>\n"
    )
    assert masked_runs(tok, example) == ["2+2 is 4.<end_of_turn>", "It is 6.<end_of_turn>"]


def test_turn_end_token_is_read_from_the_template(
    smollm2_tokenizer, llama3_tokenizer, gemma_tokenizer
):
    for tok, marker in [
        (smollm2_tokenizer, "<|im_end|>"),
        (llama3_tokenizer, "<|eot_id|>"),
        (gemma_tokenizer, "<end_of_turn>"),  # followed by a newline, which is not the marker
    ]:
        assert turn_end_token_id(tok) == tok.convert_tokens_to_ids(marker)
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    # An added token that is not special (here closing the turn) is no end-of-turn token
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_tokens(["<not-special>"])
    closes = plain.replace("\n", "<not-special>")
    assert "<not-special>" in closes
    assert (
        turn_end_token_id(tok, closes + "{% if add_generation_prompt %}assistant: {% endif %}")
        is None
    )
    assert (
        turn_end_token_id(
            smollm2_tokenizer, plain + "{% if add_generation_prompt %}assistant: {% endif %}"
        )
        is None
    )


def test_empty_answer_masks_only_the_end_of_turn(smollm2_tokenizer):
    conversation = [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ]
    example = tokenize_conversation(conversation, smollm2_tokenizer)
    assert masked_runs(smollm2_tokenizer, example) == ["<|im_end|>"]


def test_whitespace_around_an_answer_is_a_target(smollm2_tokenizer):
    """The base wrote it (a cut answer often ends in a newline): not left out of the mask."""
    for answer in ("Hello.\n\n", "\nHello."):
        conversation = [
            {"role": "user", "content": "Greet me."},
            {"role": "assistant", "content": answer},
        ]
        example = tokenize_conversation(conversation, smollm2_tokenizer, finished=False)
        targets = [t for t, m in zip(example["input_ids"], example["loss_mask"]) if m]
        assert smollm2_tokenizer.decode(targets).endswith(answer)


def test_truncation_cuts_on_a_token_boundary(smollm2_tokenizer):
    tok = smollm2_tokenizer
    full = tokenize_conversation(CONVERSATION, tok)
    text = tok.decode(full["input_ids"])
    for max_length in (5, 37, len(full["input_ids"]) - 3):
        cut = tokenize_conversation(CONVERSATION, tok, max_length=max_length)
        assert len(cut["input_ids"]) == max_length
        assert cut["input_ids"] == full["input_ids"][:max_length]
        assert cut["loss_mask"] == full["loss_mask"][:max_length]
        assert text.startswith(tok.decode(cut["input_ids"]))
    assert tokenize_conversation(CONVERSATION, tok, max_length=10_000) == full
    # Cut before the first answer: no loss token left, so build_examples drops it.
    assert build_examples([CONVERSATION], tok, max_length=5) == []
    assert build_examples([CONVERSATION], tok) == [full]


def test_missing_chat_template_is_a_clear_error(smollm2_tokenizer, tmp_path):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template.*data.chat_template"):
        tokenize_conversation(CONVERSATION, tok)
    # The recipe's template (a string or a file) makes it work.
    path = tmp_path / "template.jinja"
    path.write_text(smollm2_tokenizer.chat_template)
    expected = tokenize_conversation(CONVERSATION, smollm2_tokenizer)
    assert tokenize_conversation(CONVERSATION, tok, chat_template=str(path)) == expected
    assert (
        tokenize_conversation(CONVERSATION, tok, chat_template=smollm2_tokenizer.chat_template)
        == expected
    )
    assert resolve_chat_template(tok, str(path)) == smollm2_tokenizer.chat_template
    # A path that is not there is not taken for the template itself
    with pytest.raises(ChatTemplateError, match="no such file, and not a Jinja template"):
        resolve_chat_template(tok, str(tmp_path / "chatml.jinja"))


def test_generation_prompt_is_the_prefix_of_the_answer(smollm2_tokenizer):
    prompt = render_conversation(CONVERSATION[:1], smollm2_tokenizer, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert render_conversation(CONVERSATION[:2], smollm2_tokenizer).startswith(prompt)


# Qwen3's way (written for this test): the last answer gets an empty thinking block that the
# base never saw after its generation prompt; earlier answers are rendered without it.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_that_rewrites_history_trains_each_answer_alone(smollm2_tokenizer):
    # Drops earlier assistant turns (like reasoning templates do): not prefix-consistent.
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = smollm2_tokenizer
    with pytest.raises(ChatTemplateError, match="not prefix-consistent"):
        tokenize_conversation(CONVERSATION, tok, chat_template=template)
    first, second = conversation_examples(CONVERSATION, tok, chat_template=template)
    # each in the context distill asked it in: the template's rendering with the generation prompt
    asked = render_conversation(
        CONVERSATION[:3], tok, chat_template=template, add_generation_prompt=True
    )
    assert "2+2 is 4." not in asked
    assert (
        second["input_ids"]
        == tok(asked + "It is 6.<|im_end|>", add_special_tokens=False)["input_ids"]
    )
    assert masked_runs(tok, first) == ["2+2 is 4.<|im_end|>"]
    assert masked_runs(tok, second) == ["It is 6.<|im_end|>"]
    assert first["prompt_ids"] == second["prompt_ids"]  # one prompt: one side of the split


@pytest.mark.parametrize("finished", [True, False])
def test_text_a_template_writes_before_the_answer_is_not_trained_on(smollm2_tokenizer, finished):
    tok = smollm2_tokenizer
    with pytest.raises(ChatTemplateError, match="between the generation prompt and the answer"):
        tokenize_conversation(CONVERSATION[:2], tok, chat_template=THINKING_TEMPLATE)
    examples = build_examples(
        [CONVERSATION], tok, chat_template=THINKING_TEMPLATE, finished=[finished]
    )
    assert len(examples) == 2
    end = "<|im_end|>" if finished else ""
    for example, i, answer in zip(examples, (1, 3), ("2+2 is 4.", "It is 6.")):
        asked = render_conversation(
            CONVERSATION[:i], tok, chat_template=THINKING_TEMPLATE, add_generation_prompt=True
        )
        assert tok.decode(example["input_ids"]) == asked + answer + end
        assert "<think>" not in tok.decode(example["input_ids"])
        assert masked_runs(tok, example) == [answer + end]
        assert (
            example["prompt_ids"]
            == tok(
                render_conversation(
                    CONVERSATION[:1],
                    tok,
                    chat_template=THINKING_TEMPLATE,
                    add_generation_prompt=True,
                ),
                add_special_tokens=False,
            )["input_ids"]
        )
    # the end-of-turn marker distill stops at is still read from the template
    assert turn_end_token_id(tok, THINKING_TEMPLATE) == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize(
    "template, rendered",
    [
        (  # Phi-3's way: the end-of-text token after the conversation when no generation
            # prompt follows
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% else %}<|endoftext|>{% endif %}",
            "It is 6.<|im_end|>\n<|endoftext|>",
        ),
        (  # one more newline before an answer than its generation prompt has
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{{ '\\n' }}{% endif %}{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "assistant\n\n2+2 is 4.",
        ),
    ],
    ids=["end-of-text-after", "newline-before-answer"],
)
def test_text_a_template_writes_around_answers_is_no_target(smollm2_tokenizer, template, rendered):
    """Every answer is still in the context it was asked in: one example, and what the template
    adds around the answers (the base never wrote it) gets no loss."""
    tok = smollm2_tokenizer
    [example] = conversation_examples(CONVERSATION, tok, chat_template=template)
    assert masked_runs(tok, example) == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]
    assert rendered in tok.decode(example["input_ids"])


def test_an_empty_system_prompt_is_an_empty_system_turn_not_the_default(smollm2_tokenizer):
    tok = smollm2_tokenizer
    example = tokenize_conversation(CONVERSATION[:2], tok, system_prompt="")
    assert tok.decode(example["input_ids"]) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n2+2 is 4.<|im_end|>\n"
    )


def test_a_template_that_raises_on_the_turns_is_a_chat_template_error(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    with pytest.raises(ChatTemplateError, match=r"turns \[system, user, assistant\].*System role"):
        tokenize_conversation(
            CONVERSATION[:2], tok, chat_template=GEMMA_TEMPLATE, system_prompt="Be brief."
        )


def test_an_eos_that_is_a_plain_vocabulary_token_closes_the_turn_and_is_a_target(
    smollm2_tokenizer,
):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.eos_token = "END"  # in the vocabulary, not an added token
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}END{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    example = tokenize_conversation(CONVERSATION[:2], tok, chat_template=template)
    assert masked_runs(tok, example) == ["2+2 is 4.END"]


def test_a_slow_tokenizer_is_refused_for_loss_masks(smollm2_tokenizer):
    slow = SimpleNamespace(is_fast=False, chat_template=smollm2_tokenizer.chat_template)
    with pytest.raises(ChatTemplateError, match="need a fast tokenizer"):
        tokenize_conversation(CONVERSATION, slow)


def test_the_prompt_of_a_conversation_is_its_text_before_the_first_answer(smollm2_tokenizer):
    """Two samples of one two-turn prompt differ in their first answer: the same prompt, so
    the same side of the held-out split."""
    from train.features import _prompt_key

    tok = smollm2_tokenizer
    other = [CONVERSATION[0], {"role": "assistant", "content": "Four."}, *CONVERSATION[2:]]
    first, second = (tokenize_conversation(c, tok) for c in (CONVERSATION, other))
    asked = render_conversation(CONVERSATION[:1], tok, add_generation_prompt=True)
    assert first["prompt_ids"] == tok(asked, add_special_tokens=False)["input_ids"]
    assert second["prompt_ids"] == first["prompt_ids"]
    assert _prompt_key(first, 0) == _prompt_key(second, 0)
