"""Reading distill's folders for training (answers, manifest notes, cut answers) and the
held-out split by prompt."""

import json

import pytest
import torch

from train.config import load_recipe
from train.data import (
    IGNORE_INDEX,
    build_examples,
    load_distilled,
    pad_batch,
    read_distilled,
    resolve_chat_template,
    tokenize_conversation,
)
from train.features import load_examples


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


def test_a_conversation_left_out_is_counted_where_each_answer_is_an_example(
    smollm2_tokenizer, tmp_path, capsys
):
    """A template that renders an answer otherwise once the conversation goes on (Qwen3's
    thinking block) gives an example per answer: the note counts conversations, not examples."""
    from tests.train.test_data import THINKING_TEMPLATE
    from train.config import load_recipe
    from train.features import load_examples

    def turns(*texts):
        roles = ["human", "gpt"] * len(texts)
        return {"conversations": [{"from": r, "value": t} for r, t in zip(roles, texts)]}

    records = [turns("Hi", "Hello.", "Bye", "Goodbye."), turns("word " * 200, "Yes.")]
    (tmp_path / "shard-r000-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = load_recipe(
        None,
        [
            f"data.output_dir={tmp_path}",
            "training.max_length=64",
            f"data.chat_template={THINKING_TEMPLATE}",
        ],
    )
    distilled, _ = load_examples(recipe, smollm2_tokenizer)
    assert len(distilled) == 2  # the first conversation's two answers
    assert "note: 1 of the 2 conversations" in capsys.readouterr().err


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


HI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def write_shard(folder, records) -> None:
    (folder / "shard-r000-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_record_without_finished_counts_as_finished(tmp_path):
    """Shards written before distill recorded `finished`: every answer ran to its end."""
    write_shard(
        tmp_path,
        [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}],
    )
    assert read_distilled(tmp_path) == [(HI, True)]
    assert load_distilled(tmp_path) == [HI]


def test_shards_that_hold_no_answers_are_an_error_before_training(smollm2_tokenizer, tmp_path):
    (tmp_path / "shard-r000-00000.jsonl").write_text("")  # a distill killed before its first
    recipe = load_recipe(None, [f"data.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="shards hold no answers; run scripts/distill.py"):
        load_examples(recipe, smollm2_tokenizer)


def test_training_examples_carry_the_recipes_system_prompt(smollm2_tokenizer, tmp_path):
    write_shard(
        tmp_path,
        [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}],
    )
    recipe = load_recipe(None, [f"data.output_dir={tmp_path}", "data.system_prompt=Be brief."])
    [example], _ = load_examples(recipe, smollm2_tokenizer)
    assert smollm2_tokenizer.decode(example["input_ids"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )


def test_an_empty_system_prompt_distilled_with_the_answers_trains(smollm2_tokenizer, tmp_path):
    """data.system_prompt="" (none, and not the template's default either): distill records an
    empty system turn, which training reads as one."""
    turns = [{"from": "system", "value": ""}, {"from": "human", "value": "Hi"}]
    write_shard(tmp_path, [{"conversations": [*turns, {"from": "gpt", "value": "Hello."}]}])
    recipe = load_recipe(None, [f"data.output_dir={tmp_path}", "data.system_prompt="])
    [example], _ = load_examples(recipe, smollm2_tokenizer)
    assert smollm2_tokenizer.decode(example["input_ids"]) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
