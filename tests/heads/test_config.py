"""heads/config.py, the configs' common part: types of optional and float keys, a folder holding
the old and the new key, GGUF spellings of a base, Medusa-2 heads on a merged base of another
name, the format a Medusa folder is written in."""

from __future__ import annotations  # dataclass field types as strings, as check_types reads them

import copy
import json
import warnings
from dataclasses import dataclass

import pytest

from heads import MedusaConfig, MedusaHeads, load_heads
from heads.config import HeadsConfig, same_base


def test_an_int_is_a_float_in_json():
    @dataclass
    class Scaled(HeadsConfig):
        scale: float = 1.0

    assert Scaled.from_dict({"scale": 2}).scale == 2
    with pytest.raises(ValueError, match="config.json: scale is '2', expected float"):
        Scaled.from_dict({"scale": "2"})


def test_an_optional_key_of_the_wrong_type_is_a_clear_error(tiny_llama, tmp_path):
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "truncated_vocab_size": "128"}))
    with pytest.raises(
        ValueError, match=r"config.json: truncated_vocab_size is '128', expected int \| None"
    ):
        load_heads(tmp_path)


def test_a_folder_holding_the_old_and_the_new_layer_key_is_read_by_the_new(tiny_llama, tmp_path):
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "base_num_hidden_layers": 3}))
    assert load_heads(tmp_path, base=tiny_llama).config.base_hidden_layers == 2


@pytest.mark.parametrize(
    "spelling",
    [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "/models/smollm2-135m-instruct-IQ4_XS.gguf",
        "SmolLM2-135M-Instruct-iq2_m",
        "smollm2-135m-instruct.bf16.gguf",
    ],
)
def test_gguf_files_of_a_base_name_that_base(spelling):
    assert same_base(spelling, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not same_base(spelling, "HuggingFaceTB/SmolLM2-135M")


def test_medusa2_heads_are_not_warned_about_the_name_of_their_merged_base(tiny_llama):
    """Medusa-2 heads are served on their base with the adapter merged, saved under any name."""
    merged = copy.deepcopy(tiny_llama.config)
    merged.name_or_path = "me/merged-medusa2"
    medusa2 = MedusaConfig.from_base(tiny_llama.config, num_heads=2, base_lora="lora")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        medusa2.check_base(merged)
    plain = MedusaConfig.from_base(tiny_llama.config, num_heads=2)
    with pytest.warns(
        UserWarning, match="trained on 'tiny-llama-0' and the given base is 'me/merged"
    ):
        plain.check_base(merged)


def test_a_medusa_folder_of_format_1_is_written_in_todays(tiny_llama, tmp_path):
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(
        tmp_path / "m"
    )
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "headstart_format": 1}))
    load_heads(tmp_path / "m").save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["headstart_format"] == 2
