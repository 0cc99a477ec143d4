import copy
import json

import pytest
import torch

from train.data import (
    IGNORE_INDEX,
    ChatTemplateError,
    build_examples,
    conversation_examples,
    load_distilled,
    pad_batch,
    read_distilled,
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


def test_a_template_that_ends_the_text_after_the_last_answer_keeps_one_example(
    smollm2_tokenizer,
):
    """Phi-3's way: the end-of-text token after the conversation when no generation prompt
    follows. Every answer is still in the context it was asked in: one example."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% else %}<|endoftext|>{% endif %}"
    )
    tok = smollm2_tokenizer
    [example] = conversation_examples(CONVERSATION, tok, chat_template=template)
    assert masked_runs(tok, example) == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]


def test_load_distilled_and_pad_batch(smollm2_tokenizer, tmp_path):
    records = [
        {
            "id": "a-0",
            "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}],
            "finished": True,
        },
        {
            "id": "b-0",
            "conversations": [
                {"from": "human", "value": "Count"},
                {"from": "gpt", "value": "1 2 3"},
            ],
            "finished": False,
        },
    ]
    (tmp_path / "shard-r000-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_distilled(tmp_path) == [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ]
    conversations = load_distilled(tmp_path, finished_only=False)
    assert len(conversations) == 2
    examples = build_examples(conversations, smollm2_tokenizer)
    batch = pad_batch(examples, pad_token_id=smollm2_tokenizer.pad_token_id)
    T = max(len(e["input_ids"]) for e in examples)
    assert batch["input_ids"].shape == (2, T)
    short = min(range(2), key=lambda i: len(examples[i]["input_ids"]))
    n = len(examples[short]["input_ids"])
    assert batch["attention_mask"][short].tolist() == [1] * n + [0] * (T - n)
    assert (
        torch.all(batch["labels"][short, n:] == IGNORE_INDEX)
        and batch["loss_mask"][short, n:].sum() == 0
    )
    with pytest.raises(FileNotFoundError, match="no .jsonl shards"):
        load_distilled(tmp_path / "absent")
    # A shard edited by hand into another encoding names its file and line.
    bad = tmp_path / "shard-r000-00001.jsonl"
    bad.write_bytes(
        json.dumps(records[0]).encode() + b"\n" + '{"id": "caf\xe9"}\n'.encode("latin-1")
    )
    with pytest.raises(ValueError, match=r"shard-r000-00001\.jsonl:2: .*utf-8"):
        load_distilled(tmp_path)


def test_training_says_when_the_answers_were_distilled_otherwise(smollm2_tokenizer, tmp_path):
    import hashlib

    from train.config import load_recipe
    from train.data import resolve_chat_template
    from train.distilled import MANIFEST, distilled_otherwise

    template = resolve_chat_template(smollm2_tokenizer)
    manifest = {  # as scripts/distill.py writes it
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "settings": {"base_model": "smollm2-135m-instruct", "system_prompt": None},
        "chat_template_sha1": hashlib.sha1(template.encode()).hexdigest(),
    }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    same = load_recipe(None, [f"data.output_dir={tmp_path}"])
    assert distilled_otherwise(tmp_path, same, smollm2_tokenizer) == []
    by_hub_id = load_recipe(None, ["model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert distilled_otherwise(tmp_path, by_hub_id, smollm2_tokenizer) == []
    other = load_recipe(
        None,
        [
            "model.name_or_path=meta-llama/Llama-3.1-8B-Instruct",
            "data.chat_template={{ messages[0]['content'] }}",
            "data.system_prompt=Be brief.",
        ],
    )
    notes = distilled_otherwise(tmp_path, other, smollm2_tokenizer)
    assert len(notes) == 3
    assert "base 'HuggingFaceTB/SmolLM2-135M-Instruct'" in notes[0] and "Llama-3.1" in notes[0]
    assert "another chat template" in notes[1] and "'Be brief.'" in notes[2]
    assert distilled_otherwise(tmp_path / "no-manifest", other, smollm2_tokenizer) == []
    # training says so as it reads the answers (and still trains: data from elsewhere is allowed)
    from tests.train.conftest import write_distilled
    from train.features import load_examples

    write_distilled(tmp_path)
    by_llama = load_recipe(
        None, ["model.name_or_path=meta-llama/Llama-3.1-8B-Instruct", f"data.output_dir={tmp_path}"]
    )
    with pytest.warns(UserWarning, match="distilled with base .* unless this is meant"):
        distilled, _ = load_examples(by_llama, smollm2_tokenizer)
    assert distilled


def test_training_says_it_reads_every_answer_whatever_data_limit_says(
    smollm2_tokenizer, tmp_path, capsys
):
    """data.limit / sources / num_samples choose what distill answers; a recipe that names
    others than the folder was distilled with is told that training reads all of it."""
    from tests.train.conftest import write_distilled
    from train.config import load_recipe
    from train.distilled import MANIFEST, selected_otherwise
    from train.features import load_examples

    write_distilled(tmp_path)
    settings = {"sources": ["embedded"], "limit": 768, "num_samples": 1}
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": settings}))
    same = load_recipe(None, [f"data.output_dir={tmp_path}", "data.limit=768"])
    assert selected_otherwise(tmp_path, same) == []
    load_examples(same, smollm2_tokenizer)
    assert "training reads all" not in capsys.readouterr().err
    # embedded:all is recorded spelled out: the same sources, in any order
    settings = {**settings, "sources": ["embedded:roleplay,reasoning,knowledge,compositions"]}
    settings["sources"].insert(0, "embedded")
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": {**settings, "limit": None}}))
    every = load_recipe(None, [f"data.output_dir={tmp_path}", "data.sources=[embedded:all]"])
    assert selected_otherwise(tmp_path, every) == []
    settings["sources"].reverse()
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": {**settings, "limit": None}}))
    assert selected_otherwise(tmp_path, every) == []
    settings = {"sources": ["embedded"], "limit": 768, "num_samples": 1}
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": settings}))
    fewer = load_recipe(None, [f"data.output_dir={tmp_path}", "data.limit=16"])
    assert selected_otherwise(tmp_path, fewer) == ["data.limit=16 (distilled with 768)"]
    distilled, _ = load_examples(fewer, smollm2_tokenizer)
    err = capsys.readouterr().err
    assert f"training reads all {len(distilled)} conversations" in err
    assert "data.limit=16 (distilled with 768)" in err and "training.max_steps" in err


def test_held_out_split_goes_by_prompt_and_keeps_its_sides_as_the_data_grows():
    from train.features import split_held_out

    def example(prompt: int, answer: int) -> dict:
        ids = [1, prompt, 2, answer, answer + 1]
        return {"input_ids": ids, "loss_mask": [0, 0, 0, 1, 1], "labels": ids}

    # 200 prompts answered twice each (data.num_samples=2): no prompt on both sides.
    examples = [example(p, a) for p in range(200) for a in (500, 600)]
    train, held = split_held_out(examples, 0.1, seed=0)
    assert len(held) == 40 and len(train) == 360
    assert not {e["input_ids"][1] for e in held} & {e["input_ids"][1] for e in train}
    # Distill extended with 100 more prompts: whole prompts, so 50 or 51 held out; all that
    # were held out stay so here, and few of those trained on come to be held out (those near
    # the cut: 6 here, where a seeded shuffle of the new count held out 29 of its 50).
    grown = examples + [example(p, 500) for p in range(200, 300)]
    train2, held2 = split_held_out(grown, 0.1, seed=0)
    assert 50 <= len(held2) <= 51
    held_now = {tuple(e["input_ids"]) for e in held2}
    assert len({tuple(e["input_ids"]) for e in held} - held_now) <= 4
    assert len({tuple(e["input_ids"]) for e in train} & held_now) <= 8
    # Another seed, another split; no held-out example when the fraction is 0.
    assert split_held_out(examples, 0.1, seed=1)[1] != held
    assert split_held_out(examples, 0.0, seed=0) == (examples, [])


def test_answers_to_one_prompt_share_its_key_whatever_their_first_token(smollm2_tokenizer):
    """SmolLM2's tokenizer merges an answer's leading "\n\n" with the template's "\n" after
    "assistant": the tokens before the first target differ, the prompt's key must not."""
    from train.features import _prompt_key, split_held_out

    answers = ["Roses are red.", "\n\nRoses are red.", " Roses", "\nRoses"]
    examples = []
    for p in range(40):
        for answer in answers:
            conversation = [
                {"role": "user", "content": f"Write poem number {p}."},
                {"role": "assistant", "content": answer},
            ]
            examples.append(tokenize_conversation(conversation, smollm2_tokenizer))
    merged = examples[1]
    first = merged["loss_mask"].index(1)
    assert (
        merged["input_ids"][:first] != examples[0]["input_ids"][: examples[0]["loss_mask"].index(1)]
    )
    assert len({_prompt_key(e, 0) for e in examples[:4]}) == 1
    # the usual case keeps the key it had: the tokens before the first target
    assert (
        examples[0]["prompt_ids"] == examples[0]["input_ids"][: examples[0]["loss_mask"].index(1)]
    )
    train, held = split_held_out(examples, 0.25, seed=0)
    assert len(held) == 40 and len(train) == 120
    assert not {tuple(e["prompt_ids"]) for e in held} & {tuple(e["prompt_ids"]) for e in train}


def test_an_answer_cut_at_max_new_tokens_has_no_end_of_turn_target(smollm2_tokenizer, tmp_path):
    from train.config import load_recipe
    from train.features import load_examples

    records = [
        {"conversations": [{"from": "human", "value": "Count"}, {"from": "gpt", "value": v}], **f}
        for v, f in (
            ("1 2 3 4 5", {"finished": True}),
            ("1 2 3", {"finished": False}),
            ("", {"finished": True}),  # the base ended its turn at once
        )
    ]
    (tmp_path / "shard-r000-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [f for _, f in read_distilled(tmp_path)] == [True, False, True]
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    recipe = load_recipe(None, [f"data.output_dir={tmp_path}"])
    done, cut, empty = load_examples(recipe, smollm2_tokenizer)[0]
    targets = [[t for t, m in zip(e["input_ids"], e["loss_mask"]) if m] for e in (done, cut, empty)]
    assert targets[2] == [end]  # an empty answer trains its end of turn
    # training.max_length under a prompt: its conversation is left out, and said
    short = load_recipe(None, [f"data.output_dir={tmp_path}", "training.max_length=8"])
    with pytest.raises(ValueError, match="3 of the 3 conversations .* raise training.max_length"):
        load_examples(short, smollm2_tokenizer)
    # The template closes both answers; only the finished one's marker is the base's own.
    assert targets[0][-1] == end and smollm2_tokenizer.decode(targets[0][:-1]) == "1 2 3 4 5"
    assert end in cut["input_ids"] and smollm2_tokenizer.decode(targets[1]) == "1 2 3"


def test_held_out_split_passes_over_a_prompt_with_too_many_answers():
    from train.features import split_held_out

    def example(prompt: int, answer: int) -> dict:
        ids = [1, prompt, 2, answer, answer + 1]
        return {"input_ids": ids, "loss_mask": [0, 0, 0, 1, 1], "labels": ids}

    many = [example(7, 500 + a) for a in range(50)]  # one prompt answered 50 times
    single = [example(100 + p, 500) for p in range(50)]
    for seed in range(5):
        train, held = split_held_out(many + single, 0.05, seed)
        assert len(held) == 5 and len(train) == 95
        assert all(e["input_ids"][1] != 7 for e in held)
    # Only prompts larger than the held-out share: the smallest one, never all of them.
    train, held = split_held_out(many + many[:1] + [example(8, 1)] * 20, 0.05, 0)
    assert [e["input_ids"][1] for e in held] == [8] * 20 and len(train) == 51
    assert split_held_out(many, 0.05, 0) == (many, [])  # one prompt: nothing to hold out
