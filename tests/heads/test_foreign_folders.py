"""Heads folders written by other tools, read as the engines read them: vLLM's Medusa under the
reference keys, other trainers' EAGLE-3 (aux ids in either meaning, no base record, the whole
vocabulary), EAGLE's reference EAGLE-1."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads, load_heads
from tests.conftest import make_tiny_llama
from tests.heads.test_checkpoint import _all_heads, _eagle, _medusa


def test_medusa_in_vllm_names_under_the_reference_keys_loads_as_vllm_reads_it(tiny_llama, tmp_path):
    """vLLM reads `medusa_num_heads` / `medusa_num_layers` as num_heads / num_hidden_layers,
    drops a `medusa_heads.` prefix from tensor names and builds no bias unless the config says:
    such folders load here, sized by their config or (naming only the reference keys) by their
    tensors; the reference's own tensor layout still goes to its reader."""
    heads = _medusa(tiny_llama)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn_like(p))
    heads.save_pretrained(tmp_path / "own")
    hidden = torch.randn(1, 4, 64)
    expected = heads.eval()(hidden)
    tensors = load_file(tmp_path / "own/model.safetensors")
    cfg = json.loads((tmp_path / "own/config.json").read_text())
    cfg["medusa_num_heads"], cfg["medusa_num_layers"] = (
        cfg.pop("num_heads"),
        cfg.pop("num_hidden_layers"),
    )
    del cfg["medusa_fc_bias"]
    for name, config in {
        "typed": cfg,
        "listed": {
            "medusa_num_heads": 3,
            "medusa_num_layers": 2,
            "base_model_name_or_path": "tiny-llama-0",
        },
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file({f"medusa_heads.{k}": v for k, v in tensors.items()}, folder / "w.safetensors")
        loaded = load_heads(folder, base=tiny_llama)
        assert (loaded.config.num_heads, loaded.config.num_hidden_layers) == (3, 2), name
        assert loaded.config.medusa_fc_bias, name  # the file's biases
        torch.testing.assert_close(loaded(hidden), expected, rtol=0, atol=0)
    no_bias = {k: v for k, v in tensors.items() if not k.endswith(".bias")}
    save_file(no_bias, tmp_path / "typed/w.safetensors")
    assert not load_heads(tmp_path / "typed").config.medusa_fc_bias  # vLLM's default: none
    cfg["num_heads"] = 2  # and medusa_num_heads 3
    (tmp_path / "typed/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_heads=2 but medusa_num_heads=3"):
        load_heads(tmp_path / "typed")
    save_file({"weird.weight": torch.zeros(2, 2)}, tmp_path / "listed/w.safetensors")
    with pytest.raises(ValueError, match="neither Medusa layout"):
        load_heads(tmp_path / "listed")


def test_aux_layer_ids_are_read_in_the_meaning_of_whoever_wrote_them(tmp_path):
    """headstart's and vLLM's id i (the state entering layer i) is SGLang's and SpecForge's
    i - 1 (the output of layer i - 1). A config naming them only in eagle_config, as SpecForge
    writes it, loads one higher; one of headstart format 1, which wrote vLLM's meaning there
    too, as it is; the top-level key, vLLM's, always as it is."""
    deeper = make_tiny_llama(num_hidden_layers=8)
    _eagle(deeper, 3).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert load_heads(tmp_path).config.aux_layer_ids == [2, 4, 5]
    top = cfg.pop("eagle_aux_hidden_state_layer_ids")
    assert (top, cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == ([2, 4, 5], [1, 3, 4])
    specforge = {k: v for k, v in cfg.items() if k != "headstart_format"}
    format1 = {
        **cfg,
        "headstart_format": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": top},
    }
    vllm_only = {**specforge, "eagle_config": {}, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    # keys that disagree: the top-level one is what vLLM reads, and wins
    both = {**specforge, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    both["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    cases = [
        (specforge, [2, 4, 5]),
        (format1, [2, 4, 5]),
        (vllm_only, [1, 3, 4]),
        (both, [2, 4, 5]),
    ]
    for written, expected in cases:
        (tmp_path / "config.json").write_text(json.dumps(written))
        assert load_heads(tmp_path, base=deeper).config.aux_layer_ids == expected, written
        resaved = tmp_path / "resaved"
        load_heads(tmp_path, base=deeper).save_pretrained(resaved)  # written in format 2
        again = json.loads((resaved / "config.json").read_text())
        assert again["headstart_format"] == 2
        assert again["eagle_aux_hidden_state_layer_ids"] == expected
        assert again["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
            i - 1 for i in expected
        ]
    old_export = {**format1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    old_export["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # format 1's sglang export
    (tmp_path / "config.json").write_text(json.dumps(old_export))
    with pytest.warns(UserWarning, match="default layers minus one.*format 1"):
        assert load_heads(tmp_path, base=deeper).config.aux_layer_ids == [1, 3, 4]
    for variant in ("norm_before_residual", "norm_before_fc"):  # as some converters write
        (tmp_path / "config.json").write_text(json.dumps({**specforge, variant: True}))
        with pytest.raises(ValueError, match=f"{variant}: a variant headstart does not"):
            load_heads(tmp_path, base=deeper)  # refused, not misread
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "headstart_format": 3}))
    with pytest.raises(ValueError, match="newer headstart.*upgrade"):
        load_heads(tmp_path)
    from heads.checkpoint import read_heads_folder  # what training.init_heads reads

    with pytest.raises(ValueError, match="newer headstart.*upgrade"):
        read_heads_folder(tmp_path)


def test_third_party_eagle3_without_aux_ids_or_base_record(tiny_llama, tmp_path):
    draft = _eagle(tiny_llama, 3)
    draft.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eagle_config": {}}))
    assert load_heads(tmp_path).config.aux_layer_ids == [1, 1, 0]  # the top-level copy alone
    for key in (
        "eagle_config",
        "eagle_aux_hidden_state_layer_ids",
        "base_hidden_layers",
        "base_hidden_size",
        "base_vocab_size",
    ):
        del cfg[key]  # as in configs written by other EAGLE-3 trainers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = load_file(tmp_path / "model.safetensors")
    t["embed_tokens.weight"] = torch.zeros(256, 64)  # some trainers save the base's embeddings
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="base="):
        load_heads(tmp_path)
    loaded = load_heads(tmp_path, base=tiny_llama)
    assert loaded.config.aux_layer_ids == [1, 1, 0]
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    # with no layer count recorded, aux ids past the given base's layers are refused at load
    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [1, 5, 8]})
    )
    with pytest.raises(ValueError, match=r"base layers \[1, 5, 8\], but .* has 2 layers"):
        load_heads(tmp_path, base=tiny_llama)
    assert cfg["torch_dtype"] == "float32"  # what the file holds
    draft.save_pretrained(tmp_path / "again", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "again/config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("kind", ["medusa", "eagle1", "eagle3"])
def test_foreign_folder_without_base_record_is_checked_by_its_own_sizes(tiny_llama, tmp_path, kind):
    _all_heads(tiny_llama)[kind].save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("base_model_name_or_path", "base_hidden_size", "base_vocab_size"):
        del cfg[key]  # as written by other trainers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    other = make_tiny_llama(vocab_size=320)
    with pytest.raises(
        ValueError, match="trained on a base with vocab_size=256, but .* has vocab_size=320"
    ):
        load_heads(tmp_path, base=other)
    assert load_heads(tmp_path, base=tiny_llama).config.base_vocab_size == 256


def test_third_party_eagle3_over_the_whole_vocabulary_needs_no_vocab_map(tiny_llama, tmp_path):
    """Engines read an EAGLE-3 config without draft_vocab_size, and a folder without d2t / t2d,
    as drafting over the whole vocabulary: so does load_heads."""
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=3, draft_vocab_size=256))
    draft.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")},
        tmp_path / "model.safetensors",
    )
    loaded = load_heads(tmp_path, base=tiny_llama)
    assert loaded.config.draft_vocab_size == 256
    assert torch.equal(loaded.to_base_ids(torch.arange(256)), torch.arange(256))
    # A reduced vocabulary without its map is still an error, naming what is missing.
    cfg["draft_vocab_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing tensors: .*d2t"):
        load_heads(tmp_path, base=tiny_llama)


def test_a_reduced_vocabulary_needs_d2t_only(tiny_llama, tmp_path):
    """vLLM and SGLang read d2t and never t2d: a folder with d2t alone loads, t2d rebuilt."""
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=3, draft_vocab_size=32))
    draft.set_vocab_map(torch.arange(3, 256, 8))
    draft.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["t2d"]
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_heads(tmp_path, base=tiny_llama)
    assert torch.equal(loaded.t2d, draft.t2d) and torch.equal(loaded.d2t, draft.d2t)
    tensors["d2t"][-1] = 300  # a target id past the base vocabulary
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="outside the base vocabulary of 256"):
        load_heads(tmp_path, base=tiny_llama)


def test_the_eagle_reference_eagle1_layout_with_an_fc_bias_loads(tiny_llama, tmp_path):
    """EAGLE's reference trains EAGLE-1 with an fc bias and may save the base's embeddings and
    the rope frequencies; its config need not say so. load_heads keeps the bias (the draft is
    wrong without it), leaves the rest, and saves it again with the bias in the tensors only
    (the engines read a config's "bias" as an attention bias)."""
    draft = _eagle(tiny_llama, 1)
    draft.save_pretrained(tmp_path / "ours")
    tensors = load_file(tmp_path / "ours" / "model.safetensors")
    tensors["fc.bias"] = torch.randn(64)
    tensors["embed_tokens.weight"] = torch.zeros(256, 64)
    tensors["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    ref = tmp_path / "reference"
    ref.mkdir()
    (ref / "config.json").write_text((tmp_path / "ours" / "config.json").read_text())
    save_file(tensors, ref / "model.safetensors")
    loaded = load_heads(ref, base=tiny_llama)
    assert loaded.config.fc_bias and torch.equal(loaded.fc.bias, tensors["fc.bias"])
    emb, hidden, pos = torch.randn(1, 4, 64), torch.randn(1, 4, 64), torch.arange(4)[None]
    with torch.no_grad():  # the bias is used: without it, another draft
        out = loaded(emb, hidden, pos)
        loaded.fc.bias.zero_()
        assert not torch.allclose(loaded(emb, hidden, pos), out)
        loaded.fc.bias.copy_(tensors["fc.bias"])
    from heads.export import ExportError, export_heads

    with pytest.raises(ExportError, match="vLLM's EAGLE-1 fc has no bias"):
        export_heads(ref, "vllm", tmp_path / "v")
    export_heads(ref, "sglang", tmp_path / "s")  # its fc has one: kept as it is
    assert torch.equal(
        load_file(tmp_path / "s" / "model.safetensors")["fc.bias"], tensors["fc.bias"]
    )
    loaded.save_pretrained(tmp_path / "again")
    assert "bias" not in json.loads((tmp_path / "again" / "config.json").read_text())
    assert "fc.bias" in load_file(tmp_path / "again" / "model.safetensors")
    # folders written before 2026-12-03 named it "bias": true; read as the tensors say
    legacy = json.loads((tmp_path / "again" / "config.json").read_text())
    (tmp_path / "again" / "config.json").write_text(json.dumps({**legacy, "bias": True}))
    assert load_heads(tmp_path / "again", base=tiny_llama).config.fc_bias
    again = load_heads(tmp_path / "again", base=tiny_llama)
    torch.testing.assert_close(again(emb, hidden, pos), loaded(emb, hidden, pos), rtol=0, atol=0)


def test_reference_keys_over_vllm_names_with_a_reduced_vocabulary(tiny_llama, tmp_path):
    """Sized by their tensors, the lm_heads give the draft vocabulary; the base's is the
    config's `vocab_size` (vLLM reads it so), and the heads load for that base."""
    keep = torch.arange(0, 256, 2)
    config = MedusaConfig.from_base(tiny_llama.config, num_heads=2, truncated_vocab_size=128)
    heads = MedusaHeads(config).init_from_base(tiny_llama, token_map=keep)
    heads.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "medusa_num_heads": 2,
                "medusa_num_layers": 1,
                "vocab_size": 256,
                "truncated_vocab_size": 128,
                "base_model_name_or_path": "tiny-llama-0",
            }
        )
    )
    loaded = load_heads(tmp_path, base=tiny_llama)
    assert (loaded.config.vocab_size, loaded.config.draft_vocab_size) == (256, 128)
    hidden = torch.randn(1, 3, 64)
    torch.testing.assert_close(loaded(hidden), heads(hidden), rtol=0, atol=0)


def test_medusa_truncated_to_the_whole_vocabulary_without_token_map(tiny_llama, tmp_path):
    """vLLM reads a token_map only when truncated_vocab_size is below vocab_size: a folder that
    sets it to the whole vocabulary and has no token_map drafts over the whole vocabulary."""
    heads = _medusa(tiny_llama)
    heads.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["truncated_vocab_size"] = cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_heads(tmp_path, base=tiny_llama)
    assert loaded.token_map is None and loaded.config.truncated_vocab_size is None
    hidden = torch.randn(1, 3, 64)
    torch.testing.assert_close(loaded(hidden), heads(hidden), rtol=0, atol=0)


def test_an_eagle3_draft_narrower_than_its_base_is_checked_by_target_hidden_size(
    tiny_llama, tmp_path
):
    config = EagleConfig.from_base(tiny_llama.config, version=3, draft_vocab_size=256)
    config = dataclasses.replace(
        config, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16
    )
    EagleDraft(config).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("base_model_name_or_path", "base_hidden_size", "base_vocab_size"):
        del cfg[key]  # as written by other trainers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert (cfg["hidden_size"], cfg["target_hidden_size"]) == (32, 64)
    loaded = load_heads(tmp_path, base=tiny_llama)
    assert loaded.config.base_hidden_size == 64
    narrow = make_tiny_llama(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"hidden_size=64.*hidden_size=32"):
        load_heads(tmp_path, base=narrow)


def test_an_eagle1_config_of_eagles_reference_without_grouped_heads_loads(tmp_path):
    """EAGLE's own EAGLE-1 configs (written by transformers 4.28, for Vicuna and Llama-2) name
    no num_key_value_heads: one key / value head per query head, as transformers reads them."""
    base = make_tiny_llama(num_key_value_heads=4)  # as Llama-2-7B: no grouped heads
    draft = EagleDraft(EagleConfig.from_base(base.config, version=1))
    draft.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw.pop("num_key_value_heads") == 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_heads(tmp_path, base=base)
    assert loaded.config.num_key_value_heads == 4
    # an EAGLE-1 config reads back as from_base built it
    assert EagleConfig.from_dict(draft.config.to_dict()) == draft.config
