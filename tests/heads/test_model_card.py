"""The model card's serving lines: each kind of heads gets the vLLM method, draft path and
token count, and the SGLang algorithm and draft path, that serve it as headstart drafts; what
the heads learned under (system prompt, GGUF base), in config.json and said by the card."""

import json

import pytest
import torch
from transformers import LlamaConfig

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads, load_heads
from heads.hub import model_card
from tests.conftest import TINY

BASE = LlamaConfig(**{**TINY, "num_hidden_layers": 8})  # aux layers 2, 4, 5: engines serve them


def _vllm(method: str, model: str, tokens: int) -> str:
    return (
        f'speculative_config={{"method": "{method}", "model": "{model}", '
        f'"num_speculative_tokens": {tokens}}}'
    )


def test_eagle3_card_serves_the_repo_in_both_engines():
    draft = EagleDraft(EagleConfig.from_base(BASE, version=3, draft_vocab_size=32))
    draft.set_vocab_map(torch.arange(0, 256, 8))
    card = model_card(draft.config, "me/d3")
    assert _vllm("eagle3", "me/d3", 5) in card
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path me/d3 " in card
    assert "export_heads" not in card


def test_eagle1_card_sends_sglang_through_its_export_and_the_export_vllm_back():
    config = EagleDraft(EagleConfig.from_base(BASE, version=1)).config
    card = model_card(config, "me/d1")
    assert _vllm("eagle", "me/d1", 5) in card
    # SGLang builds EAGLE-1 under its own architecture name: the card exports first
    assert "export_heads('me/d1', 'sglang', 'draft-sglang')" in card
    assert "--speculative-algorithm EAGLE --speculative-draft-model-path draft-sglang " in card
    # the card of that export: SGLang reads it as it is, vLLM its native layout again
    card = model_card(config, "me/d1-sglang", sglang_layout=True)
    assert 'export_heads("me/d1-sglang", "vllm", "draft-vllm")' in card
    assert _vllm("eagle", "draft-vllm", 5) in card
    assert "--speculative-algorithm EAGLE --speculative-draft-model-path me/d1-sglang " in card


def test_medusa_cards_draft_one_token_per_head_on_the_base_they_read():
    config = MedusaConfig.from_base(BASE, num_heads=2)
    config.base_model_name_or_path = "org/base"
    card = model_card(MedusaHeads(config).config, "me/m")
    assert 'LLM(model="org/base"' in card and _vllm("medusa", "me/m", 2) in card
    assert "SGLang does not serve Medusa heads" in card and "launch_server" not in card
    config.base_lora = "lora"  # Medusa-2: served on the base with the adapter merged
    card = model_card(config, "me/m2")
    assert 'LLM(model="BASE_WITH_LORA_MERGED"' in card and 'LLM(model="org/base"' not in card


def _front_matter(card: str) -> str:
    assert card.startswith("---\n")
    return card.split("---\n")[1]


@pytest.mark.parametrize(
    ("config", "tag"),
    [
        (MedusaConfig.from_base(BASE, num_heads=2), "medusa"),
        (EagleConfig.from_base(BASE, version=3, draft_vocab_size=256), "eagle"),
        (EagleConfig.from_base(BASE, version=1), "eagle"),
    ],
)
def test_the_cards_tags_name_the_kind_of_heads(config, tag):
    tags = [
        line.removeprefix("- ")
        for line in _front_matter(model_card(config, "me/x")).splitlines()
        if line.startswith("- ")
    ]
    assert tags == ["speculative-decoding", tag, "headstart"]


def test_a_base_folder_here_named_like_a_repo_is_not_the_cards_base_model(tmp_path, monkeypatch):
    # "org/base" has a repo id's form; a base loaded from the folder ./org/base is no Hub repo
    config = MedusaConfig.from_base(BASE, num_heads=2)
    config.base_model_name_or_path = "org/base"
    assert "base_model: org/base\n" in _front_matter(model_card(config, "me/m"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "base").mkdir(parents=True)
    assert "base_model" not in _front_matter(model_card(config, "me/m"))


def test_a_medusa2_card_loads_its_heads_on_the_base_with_their_adapter_merged():
    config = MedusaConfig.from_base(BASE, num_heads=2)
    config.base_model_name_or_path = "org/base"
    config.base_lora = "lora"
    card = model_card(config, "me/m2")
    assert (
        'base, tokenizer = load_base("org/base")\n'
        "from peft import PeftModel\n"
        'base = PeftModel.from_pretrained(base, "me/m2", subfolder="lora").merge_and_unload()\n'
        'heads = load_heads("me/m2", base=base)\n'
    ) in card
    config.base_lora = ""  # Medusa-1: the heads on the base as it is
    card = model_card(config, "me/m")
    assert (
        'base, tokenizer = load_base("org/base")\nheads = load_heads("me/m", base=base)\n' in card
    )
    assert "PeftModel" not in card


def test_the_card_says_which_gguf_the_heads_learned_on_and_how_to_load_the_embedded_one():
    config = MedusaConfig.from_base(BASE, num_heads=2)
    config.base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "GGUF" not in model_card(config, "me/m")
    config.training_base_gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    card = " ".join(model_card(config, "me/m").split())  # the card wraps its lines
    assert (
        "The heads learned on the base's weights as the GGUF file "
        "`SmolLM2-135M-Instruct.Q4_1.gguf` holds them, dequantised "
        '(headstart\'s `load_base("smollm2-135m-instruct")` loads that file): on other weights'
    ) in card
    config.training_base_gguf = "llama-3-8b.Q8_0.gguf"
    card = " ".join(model_card(config, "me/m").split())
    assert "GGUF file `llama-3-8b.Q8_0.gguf` holds them, dequantised: on other weights" in card
    assert 'load_base("smollm2' not in card


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_what_the_heads_learned_under_is_kept_in_config_json_only_when_set(tmp_path, kind):
    if kind == "medusa":
        heads = MedusaHeads(MedusaConfig.from_base(BASE, num_heads=2))
    else:
        heads = EagleDraft(EagleConfig.from_base(BASE, version=3, draft_vocab_size=32))
        heads.set_vocab_map(torch.arange(0, 256, 8))
    heads.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert not [key for key in config if key.startswith("training_")]
    heads.config.training_system_prompt = "Be brief."
    heads.config.training_base_gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    heads.save_pretrained(tmp_path / "set")
    again = load_heads(tmp_path / "set").config
    assert again.training_system_prompt == "Be brief." and again.training_chat_template is None
    assert again.training_base_gguf == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = json.loads((tmp_path / "set" / "config.json").read_text())
    (tmp_path / "set" / "config.json").write_text(json.dumps({**config, "training_base_gguf": 4}))
    with pytest.raises(ValueError, match="config.json: training_base_gguf is 4, expected str"):
        load_heads(tmp_path / "set")
