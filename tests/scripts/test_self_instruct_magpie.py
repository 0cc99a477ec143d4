"""scripts/self_instruct.py with method=magpie: the base shown its chat template up to a user's
message writes the message."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import self_instruct as si  # noqa: E402  (scripts/ is not a package)

from tests.conftest import make_tiny_llama  # noqa: E402
from tests.scripts.test_self_instruct import Writer, recipe  # noqa: E402
from train.config import load_recipe  # noqa: E402
from train.data import ChatTemplateError  # noqa: E402
from train.prompts import PromptSourceError, load_prompts  # noqa: E402


def test_magpie_prefix_is_the_template_up_to_the_users_message(smollm2_tokenizer):
    prefix, end = si.user_turn(smollm2_tokenizer, None, None)
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_start|>user\n")
    assert end == "<|im_end|>"
    pirate, _ = si.user_turn(smollm2_tokenizer, None, "You are a pirate.")
    assert pirate == "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\n"
    # Llama 2's form: the user's message ends at [/INST], which is no EOS token.
    inst = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    bos = smollm2_tokenizer.bos_token
    assert si.user_turn(smollm2_tokenizer, inst, None) == (f"{bos}[INST] ", "[/INST]")
    # A template with nothing before the user's message leaves the base nothing to continue;
    # one that refuses a system turn is a clear error too.
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="method=list"):
        si.user_turn(smollm2_tokenizer, bare, None)
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="cannot render a user's message: no system"):
        si.user_turn(smollm2_tokenizer, strict, "Be brief.")


def test_magpie_shows_the_prefix_alone_and_filters_what_comes_back(tmp_path, smollm2_tokenizer):
    r = recipe(tmp_path, "self_instruct.method=magpie", "self_instruct.num_prompts=3")
    writer = Writer(
        [
            ('Can you help me plan a small garden?\nI have two square metres, "sunny".', True),
            ("can you help me plan a small garden? I have two square metres sunny", True),
            ("I am writing a story about a dragon who", False),  # cut
            ("Hi", True),  # too short
            ("What should I pack for a week of hiking?", True),
            ("Explain why the sky is blue to a child.", True),
            ("A request that is not needed.", True),  # past num_prompts
            ("Another request that is not needed.", True),
        ]
    )
    summary = si.self_instruct(r, write=writer, tokenizer=smollm2_tokenizer)
    assert summary == {
        "kept": 3,
        "rejected": {"near duplicate": 1, "cut at max_new_tokens": 1, "length": 1},
        "output": str(tmp_path / "out" / "prompts.jsonl"),
    }
    prefix, _ = si.user_turn(smollm2_tokenizer, None, None)
    assert writer.seen == [prefix] * 8  # no seeds, no list: the template alone, twice a batch of 4
    out = tmp_path / "out" / "prompts.jsonl"
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert kept[0] == {  # several lines, and its quotes, kept
        "prompt": 'Can you help me plan a small garden?\nI have two square metres, "sunny".',
        "category": "magpie",
    }
    assert [k["prompt"] for k in kept[1:]] == [
        "What should I pack for a week of hiking?",
        "Explain why the sky is blue to a child.",
    ]
    prompts, _ = load_prompts([str(out)])
    assert sorted(p.messages[0]["content"] for p in prompts) == sorted(k["prompt"] for k in kept)

    # The file is magpie's: the list method refuses to extend it (and the reverse).
    more = recipe(tmp_path, "self_instruct.num_prompts=4")
    with pytest.raises(PromptSourceError, match="other self_instruct method"):
        si.self_instruct(more, write=Writer([]))
    listed = recipe(
        tmp_path, "self_instruct.num_prompts=1", f"self_instruct.output={tmp_path / 'l'}"
    )
    si.self_instruct(listed, write=Writer([("Write a short poem about the sea.", True)] * 4))
    magpie_there = recipe(
        tmp_path, "self_instruct.method=magpie", f"self_instruct.output={tmp_path / 'l'}"
    )
    with pytest.raises(PromptSourceError, match="other self_instruct method"):
        si.self_instruct(magpie_there, write=Writer([]), tokenizer=smollm2_tokenizer)


def test_magpie_writer_stops_at_end_of_turn_and_runs_are_reproducible(tmp_path, smollm2_tokenizer):
    model = make_tiny_llama(seed=1, vocab_size=len(smollm2_tokenizer))
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = smollm2_tokenizer.convert_tokens_to_ids("Ċ")
    # Uniform over the vocabulary but for the end of turn and the newline, each ~20% likely.
    head = torch.nn.Linear(model.config.hidden_size, len(smollm2_tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[[im_end, newline]] = 9.8
    model.lm_head = head.requires_grad_(False)
    overrides = ["self_instruct.method=magpie", "self_instruct.max_new_tokens=8"]
    cfg = recipe(tmp_path, *overrides).self_instruct
    prefix, end = si.user_turn(smollm2_tokenizer, None, None)
    write = si.transformers_writer(model, smollm2_tokenizer, cfg, end)
    torch.manual_seed(0)
    out = write([prefix] * 48)
    assert len(out) == 48 and {ended for _, ended in out} == {True, False}
    assert any("\n" in text for text, ended in out if ended)  # a newline does not end a request
    for text, ended in out:  # an ended request left room for its end of turn
        n_tokens = len(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"])
        assert n_tokens <= 7 or not ended

    def run(name):
        r = recipe(
            tmp_path,
            *overrides,
            "self_instruct.num_prompts=3",
            "self_instruct.max_similarity=1",
            f"self_instruct.output={tmp_path / name}",
        )
        return si.self_instruct(r, write=write, tokenizer=smollm2_tokenizer)["kept"], (
            tmp_path / name
        ).read_text()

    first = run("a.jsonl")
    assert first[0] == 3
    assert run("b.jsonl") == first  # the same seeds, the same requests


def test_a_list_prompt_starts_as_plain_text_does_a_magpie_prefix_as_written(smollm2_tokenizer):
    # a base whose tokenizer starts text with BOS (Llama 3, Gemma) reads the list with it; a
    # magpie prefix is chat-template text that writes its BOS itself
    import copy

    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")  # standing in for a BOS token
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    model = make_tiny_llama(seed=1, vocab_size=len(tokenizer))
    seen = []

    def generate(input_ids, **kwargs):
        seen.append(input_ids[0].tolist())
        return input_ids

    model.generate = generate
    for method, starts_with_bos in (("list", True), ("magpie", False)):
        cfg = load_recipe(None, [f"self_instruct.method={method}"]).self_instruct
        write = si.transformers_writer(model, tokenizer, cfg, end="<|im_end|>")
        write(["Requests that users sent to an AI assistant:\n1. Say hi.\n2."])
        assert (seen[-1][0] == bos) is starts_with_bos, method


@pytest.mark.parametrize(
    "template",
    [  # the user's message first: nothing to continue; rendered twice: no single end
        "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}",
        "<s>{% for m in messages %}[INST] {{ m['content'] }} [/INST] {{ m['content'] }}"
        "{% endfor %}",
    ],
)
def test_magpie_refuses_a_template_without_one_user_message_after_some_text(
    smollm2_tokenizer, template
):
    with pytest.raises(ChatTemplateError, match="method=list"):
        si.user_turn(smollm2_tokenizer, template, None)
