import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads, load_heads
from heads.hub import model_card
from tests.conftest import make_tiny_llama


def _medusa(base, **kw):
    heads = MedusaHeads(
        MedusaConfig.from_base(base.config, num_heads=3, num_layers=2, **kw)
    ).init_from_base(base)
    for p in heads.parameters():  # move off the zero init so the round trip is meaningful
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    return heads


def _eagle(base, version):
    draft = EagleDraft(EagleConfig.from_base(base.config, version=version, draft_vocab_size=32))
    if version == 3:
        draft.set_vocab_map(torch.arange(0, 256, 8))
    return draft


def _all_heads(base):
    return {
        "medusa": _medusa(base),
        "medusa-shared": _medusa(base, original_lm_head=True),
        "eagle1": _eagle(base, 1),
        "eagle3": _eagle(base, 3),
    }


@pytest.mark.parametrize("kind", ["medusa", "medusa-shared", "eagle1", "eagle3"])
def test_save_load_bit_exact(tiny_llama, tmp_path, kind):
    heads = _all_heads(tiny_llama)[kind].eval()
    heads.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    again = load_heads(tmp_path, base=tiny_llama)
    assert type(again) is type(heads)
    hidden = torch.randn(1, 4, 64)
    if isinstance(heads, MedusaHeads):
        assert torch.equal(heads(hidden), again(hidden))
    else:
        emb, pos = torch.randn(1, 4, 64), torch.arange(4)[None]
        a = heads.compute_logits(heads(emb, hidden, pos), tiny_llama.lm_head)
        b = again.compute_logits(again(emb, hidden, pos), tiny_llama.lm_head)
        assert torch.equal(a, b)
    for name, t in heads.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name


def test_medusa_layout_is_vllm(tiny_llama, tmp_path):
    _medusa(tiny_llama).save_pretrained(tmp_path / "own")
    cfg = json.loads((tmp_path / "own/config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    for key, value in {
        "hidden_size": 64,
        "vocab_size": 256,
        "num_heads": 3,
        "num_hidden_layers": 2,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        "truncated_vocab_size": None,
        "base_hidden_size": 64,
        "base_vocab_size": 256,
        "base_hidden_layers": 2,
        "headstart_format": 2,
        "base_model_name_or_path": "tiny-llama-0",
    }.items():
        assert cfg[key] == value, key
    names = set(load_file(tmp_path / "own/model.safetensors"))
    expected = {
        f"blocks.{h}.layers.{i}.{w}" for h in range(3) for i in range(2) for w in ("weight", "bias")
    }
    expected |= {f"lm_heads.{h}.weight" for h in range(3)}
    assert names == expected
    _medusa(tiny_llama, original_lm_head=True).save_pretrained(tmp_path / "shared")
    names = set(load_file(tmp_path / "shared/model.safetensors"))
    assert "lm_head.weight" in names and not any(n.startswith("lm_heads") for n in names)
    # vLLM's MedusaConfig.from_pretrained renames every key holding "num" and "layers" to
    # num_hidden_layers (and "num" and "heads" to num_heads): no other key may hold them, or
    # it would build the base's layer count of residual blocks per head.
    assert {k for k in cfg if "num" in k} == {"num_heads", "num_hidden_layers"}


def test_folders_of_the_old_base_layer_key_still_load_and_check(tiny_llama, tmp_path):
    for kind, heads in _all_heads(tiny_llama).items():
        folder = tmp_path / kind
        heads.save_pretrained(folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["base_num_hidden_layers"] = cfg.pop("base_hidden_layers")  # as written until 2026-12
        (folder / "config.json").write_text(json.dumps(cfg))
        assert load_heads(folder, base=tiny_llama).config.base_hidden_layers == 2
        cfg["base_num_hidden_layers"] = 3
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="num_hidden_layers=3, but the given base"):
            load_heads(folder, base=tiny_llama)


def test_eagle3_layout_is_engines(tiny_llama, tmp_path):
    _eagle(tiny_llama, 3).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (
        cfg["num_hidden_layers"] == 1
        and cfg["draft_vocab_size"] == 32
        and cfg["target_hidden_size"] == 64
    )
    # vLLM reads the top-level ids as the state entering layer i (headstart's meaning); SGLang
    # and SpecForge read eagle_config's as the output of layer i: one lower (-1: the embeddings)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, -1]
    assert cfg["headstart_format"] == 2
    assert cfg["tie_word_embeddings"] is False  # SGLang would draft with embed_tokens instead
    t = load_file(tmp_path / "model.safetensors")
    assert t["fc.weight"].shape == (64, 192)
    assert t["midlayer.self_attn.q_proj.weight"].shape[1] == 128
    assert "midlayer.hidden_norm.weight" in t and "norm.weight" in t
    assert t["lm_head.weight"].shape == (32, 64)
    assert (
        t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and t["t2d"].shape == (256,)
    )
    assert (t["d2t"] + torch.arange(32)).tolist() == list(range(0, 256, 8))


def test_eagle1_layout_is_plain_llama(tiny_llama, tmp_path):
    _eagle(tiny_llama, 1).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (
        cfg["model_type"] == "llama"
        and cfg["num_hidden_layers"] == 1
        and "draft_vocab_size" not in cfg
        and cfg["tie_word_embeddings"] is False
    )
    t = load_file(tmp_path / "model.safetensors")
    assert t["fc.weight"].shape == (64, 128)
    assert "layers.0.self_attn.q_proj.weight" in t and "layers.0.input_layernorm.weight" not in t


def test_mismatched_base_names_both_sides(tiny_llama, tmp_path):
    _medusa(tiny_llama).save_pretrained(tmp_path)
    other = make_tiny_llama(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"hidden_size=64.*hidden_size=32"):
        load_heads(tmp_path, base=other)
    deeper = make_tiny_llama(num_hidden_layers=3)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_heads(tmp_path, base=deeper)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
@pytest.mark.parametrize("change", ["missing", "unexpected", "misshaped"])
def test_bad_tensors_are_named(tiny_llama, tmp_path, change, kind):
    heads = _eagle(tiny_llama, 3) if kind == "eagle3" else _medusa(tiny_llama)
    heads.save_pretrained(tmp_path)
    t = load_file(tmp_path / "model.safetensors")
    some = "norm.weight" if kind == "eagle3" else sorted(t)[0]
    weight = "fc.weight" if kind == "eagle3" else next(k for k in sorted(t) if t[k].dim() == 2)
    if change == "missing":
        del t[some]
        pattern = f"missing tensors: {re.escape(some)}"
    elif change == "unexpected":
        t["extra.weight"] = torch.zeros(2)
        pattern = "unexpected tensors: extra.weight"
    else:
        t[weight] = torch.zeros(64, 128)
        pattern = rf"{re.escape(weight)} has shape \(64, 128\)"
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=pattern):
        load_heads(tmp_path, base=tiny_llama)


def test_pickle_only_is_refused(tiny_llama, tmp_path):
    heads = _medusa(tiny_llama)
    heads.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(heads.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*never loaded"):
        load_heads(tmp_path)


def test_where_the_heads_are_not_is_said(tiny_llama, tmp_path, monkeypatch):
    heads = _medusa(tiny_llama)
    heads.save_pretrained(tmp_path / "h")
    with pytest.raises(
        FileNotFoundError, match=r"model.safetensors is a file: give the heads folder"
    ):
        load_heads(tmp_path / "h" / "model.safetensors")
    with pytest.raises(TypeError, match=r"load_base's \(model, tokenizer\) pair"):
        load_heads(tmp_path / "h", base=(tiny_llama, None))

    def no_such_repo(repo_id, **kwargs):
        raise OSError(f"404 Client Error: Repository Not Found for url: .../{repo_id}")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_such_repo)
    # one slash and no such folder here: a Hub id, whose failure is said as such
    with pytest.raises(
        FileNotFoundError,
        match=r"heads not found: runz/heads is not a local folder, and the Hub gave: 404",
    ):
        load_heads("runz/heads")

    # A Hub repo of pickled weights: they are not downloaded, and the listing names them.
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text((tmp_path / "h" / "config.json").read_text())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: snapshot)
    monkeypatch.setattr(
        huggingface_hub,
        "list_repo_files",
        lambda repo_id, **kw: ["config.json", "medusa_lm_head.pt", "README.md"],
    )
    with pytest.raises(
        FileNotFoundError,
        match=r"Hub repo someone/medusa has no .safetensors weights. Found medusa_lm_head.pt: "
        r"pickled checkpoints are never loaded",
    ):
        load_heads("someone/medusa")


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_loaded_without_a_base_heads_keep_their_stored_dtype(tiny_llama, tmp_path, kind):
    # saved again (or pushed) as they came: a bf16 folder does not double into fp32; an EAGLE
    # draft cast to bf16 keeps its rotary frequencies in fp32, as the base does
    _all_heads(tiny_llama)[kind].save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    again = load_heads(tmp_path / "bf16")
    assert {t.dtype for t in again.parameters()} == {torch.bfloat16}
    again.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (
        load_file(tmp_path / "again" / "model.safetensors").keys()
        == load_file(tmp_path / "bf16" / "model.safetensors").keys()
    )
    if kind == "eagle3":
        _all_heads(tiny_llama)[kind].save_pretrained(tmp_path / "fp32")
        cast = load_heads(tmp_path / "fp32", dtype=torch.bfloat16)
        assert cast.fc.weight.dtype == torch.bfloat16
        assert {b.dtype for b in cast.rotary_emb.buffers()} == {torch.float32}


def test_config_of_wrong_types_is_a_clear_error(tiny_llama, tmp_path):
    _medusa(tiny_llama).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in (("num_heads", "4"), ("num_hidden_layers", True), ("base_vocab_size", None)):
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=f"config.json: {key} is {value!r}, expected int"):
            load_heads(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "engine_extra": True}))
    load_heads(tmp_path)  # keys of other tools are ignored, whatever their type
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object of settings"):
        load_heads(tmp_path)


def test_eagle_configs_missing_keys_or_of_wrong_types_are_clear_errors(tiny_llama, tmp_path):
    _eagle(tiny_llama, 3).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    nested = {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]}  # SGLang's: layers 1, 1, 1
    for change, message in (
        ({"hidden_size": None}, "config.json lacks hidden_size: not an EAGLE draft's config"),
        ({"vocab_size": None}, "config.json lacks vocab_size"),
        ({"hidden_size": "64"}, "config.json: hidden_size is '64', expected int"),
        ({"eagle_config": [1]}, "config.json: eagle_config is [1], expected an object"),
        ({"eagle_aux_hidden_state_layer_ids": ["a", 1]}, "expected a list of layer numbers"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "12"}}, "a list of layer numbers"),
        ({"rope_parameters": None, "rope_theta": "1e4"}, "rope_theta is '1e4', expected a number"),
    ):
        edited = {k: v for k, v in {**config, **change}.items() if v is not None}
        if "eagle_config" in change:
            edited.pop("eagle_aux_hidden_state_layer_ids", None)
        (tmp_path / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_heads(tmp_path)
    edited = {**config, "eagle_config": nested, "head_dim": None, "target_hidden_size": None}
    edited.pop("eagle_aux_hidden_state_layer_ids", None)
    (tmp_path / "config.json").write_text(json.dumps(edited))
    assert load_heads(tmp_path).config.head_dim == config["head_dim"]  # null: hidden / heads
    # a draft over the whole vocabulary, its draft_vocab_size written null (the engines' reading)
    EagleDraft(EagleConfig.from_base(tiny_llama.config, draft_vocab_size=256)).save_pretrained(
        tmp_path / "whole"
    )
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    (tmp_path / "whole" / "config.json").write_text(
        json.dumps({**config, "draft_vocab_size": None})
    )
    assert load_heads(tmp_path / "whole").config.draft_vocab_size == 256


def test_truncated_safetensors_is_a_clear_error(tiny_llama, tmp_path):
    _medusa(tiny_llama).save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="unreadable or truncated"):
        load_heads(tmp_path)


def test_inconsistent_vocab_map_is_refused(tiny_llama, tmp_path):
    _eagle(tiny_llama, 3).save_pretrained(tmp_path)
    t = load_file(tmp_path / "model.safetensors")
    t["d2t"] = t["d2t"].flip(0)  # offsets no longer map one-to-one onto t2d's ids
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="d2t"):
        load_heads(tmp_path)
    t["d2t"] = t["d2t"].flip(0)
    t["t2d"][1] = True  # one more marked token than the draft vocabulary holds
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="t2d"):
        load_heads(tmp_path)


def test_not_a_heads_folder(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError):
        load_heads(tmp_path / "nope")
    # a training run's output.dir given for the heads folder inside it
    run = tmp_path / "run"
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=1)).save_pretrained(
        run / "heads"
    )
    with pytest.raises(
        FileNotFoundError, match=f"training run's folder: its heads are in {run}/heads"
    ):
        load_heads(run)
    # one of its checkpoints: resumed from, not loaded as heads
    step = run / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 4}))
    with pytest.raises(
        FileNotFoundError, match=f"{step} is a training checkpoint.*training.resume={step}$"
    ):
        load_heads(step)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="neither Medusa"):
        load_heads(tmp_path)


def test_model_card_and_push_to_hub(tiny_llama, fake_hub):
    heads = _eagle(make_tiny_llama(num_hidden_layers=8), 3)  # aux layers 2, 4, 5
    assert heads.push_to_hub("me/tiny-eagle3") == "https://hub/me/tiny-eagle3/commit/1"
    assert list(fake_hub.private) == ["me/tiny-eagle3"]
    assert set(fake_hub.files["me/tiny-eagle3"]) == {
        "config.json",
        "model.safetensors",
        "README.md",
    }
    card = fake_hub.card("me/tiny-eagle3")
    assert "for tiny-llama-0" in card and "EAGLE-3" in card
    # the card's base_model is a repo id, or none: the Hub refuses a card that names a path
    # (a base loaded from a folder, a GGUF's name)
    config = _eagle(tiny_llama, 3).config
    config.base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in model_card(config)
    for name in ("/data/models/my-base", "./my-base", "runs/x/base", "my-base.Q4_1"):
        config.base_model_name_or_path = name
        assert "base_model:" not in model_card(config) and f"for {name}" in model_card(config)
    assert '"model": "me/tiny-eagle3"' in card  # vLLM reads the repo as is
    # the config names the aux layers in SGLang's meaning too: it serves the repo as is
    assert "--speculative-draft-model-path me/tiny-eagle3" in card and "export_heads" not in card
    # SGLang reads the draft's dtype from --dtype, else a float32 draft's config says float16
    assert "sglang.launch_server --model tiny-llama-0 --dtype bfloat16 --spec" in card
    assert 'return_dict=True)["input_ids"]' in card  # transformers 5's apply_chat_template
    # the 2-layer base's default aux layers repeat one (1, 1, 0): the engines would read fewer
    repeated = model_card(_eagle(tiny_llama, 3).config, "me/x")
    assert "# vLLM cannot serve these heads: aux layer ids [1, 1, 0]" in repeated
    assert "# SGLang cannot serve this draft: aux layer ids [1, 1, 0]" in repeated
    assert "speculative_config" not in repeated and "launch_server" not in repeated


def test_heads_for_another_base_of_the_same_sizes_are_warned_about(
    tiny_llama, tmp_path, monkeypatch
):
    """Sizes that match but a recorded base of another name (SmolLM2-135M vs -Instruct, Llama 3
    vs 3.1): a warning, since a copy under another path or name is the same model."""
    _medusa(tiny_llama).save_pretrained(tmp_path)  # records tiny-llama-0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for same in (
            "tiny-llama-0",
            "/models/Tiny-Llama-0",
            "someone/tiny-llama-0",
            "tiny-llama-0.Q4_1",
        ):
            monkeypatch.setattr(tiny_llama.config, "name_or_path", same)
            load_heads(tmp_path, base=tiny_llama)
    monkeypatch.setattr(tiny_llama.config, "name_or_path", "tiny-llama-0-base")
    with pytest.warns(UserWarning, match="trained on 'tiny-llama-0' and the given base is 'tiny"):
        heads = load_heads(tmp_path, base=tiny_llama)
    from inference import SpeculativeGenerator

    with warnings.catch_warnings(record=True) as caught:  # said once, not again by the generator
        warnings.simplefilter("always")
        SpeculativeGenerator(tiny_llama, heads)
    assert not [w for w in caught if "trained on 'tiny-llama-0'" in str(w.message)]


def test_a_weights_file_whose_target_is_gone_is_said_to_be_unreadable(tiny_llama, tmp_path):
    # the Hub cache keeps model.safetensors as a link to a blob: a deleted blob leaves it dangling
    _medusa(tiny_llama).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(
        ValueError, match="model.safetensors is unreadable or truncated .*re-download"
    ):
        load_heads(tmp_path)


@pytest.mark.parametrize("name", ["medusa_lm_head.pt", "heads.pth", "last.ckpt", "model.bin"])
def test_every_pickled_checkpoint_kind_is_named_and_refused(tiny_llama, tmp_path, name):
    heads = _medusa(tiny_llama)
    heads.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(heads.state_dict(), tmp_path / name)
    with pytest.raises(FileNotFoundError, match=f"Found {name}: pickled checkpoints are never"):
        load_heads(tmp_path)


def test_a_path_that_is_no_repo_id_is_not_looked_for_on_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    def asked(repo_id, **kwargs):
        raise AssertionError(f"the Hub was asked for {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", asked)
    for path in (tmp_path / "nope", "./runs/heads", "runs/x/heads"):
        with pytest.raises(FileNotFoundError, match=f"heads folder not found: {path}$"):
            load_heads(path)


def test_a_repo_id_the_hub_refuses_is_said_as_not_found():
    # one slash, so a repo id's form, but a name the Hub never accepts: refused before any request
    with pytest.raises(
        FileNotFoundError,
        match=r"heads not found: me/my heads is not a local folder, and the Hub gave: Repo id must",
    ):
        load_heads("me/my heads")


def test_a_shared_medusa_head_left_out_of_the_folder_is_the_bases_or_missing(tiny_llama, tmp_path):
    heads = _medusa(tiny_llama, original_lm_head=True)
    heads.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]  # vLLM's Medusa reads the base's lm_head when it is absent
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_heads(tmp_path, base=tiny_llama)
    assert loaded.lm_head is tiny_llama.lm_head
    hidden = torch.randn(1, 4, 64)
    torch.testing.assert_close(loaded(hidden), heads.eval()(hidden), rtol=0, atol=0)
    # without the base there is no head to take: refused, not left at its random init
    with pytest.raises(ValueError, match="missing tensors: lm_head.weight"):
        load_heads(tmp_path)


def test_heads_loaded_on_a_base_take_the_dtype_asked_for(tiny_llama, tmp_path):
    _medusa(tiny_llama).save_pretrained(tmp_path)
    assert {p.dtype for p in load_heads(tmp_path, base=tiny_llama).parameters()} == {torch.float32}
    cast = load_heads(tmp_path, base=tiny_llama, dtype=torch.bfloat16)
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}


def test_a_shared_head_of_a_reduced_vocabulary_keeps_its_rows_on_the_base(tiny_llama, tmp_path):
    keep = torch.tensor([0, 2, 3, 7, 100, 255])
    config = MedusaConfig.from_base(
        tiny_llama.config, num_heads=2, truncated_vocab_size=6, original_lm_head=True
    )
    heads = MedusaHeads(config).init_from_base(tiny_llama, token_map=keep)
    heads.save_pretrained(tmp_path)
    loaded = load_heads(tmp_path, base=tiny_llama)
    hidden = torch.randn(1, 3, 64)
    logits = loaded(hidden)  # (K, B, T, V_draft)
    assert logits.shape == (2, 1, 3, 6)
    torch.testing.assert_close(logits[0], tiny_llama.lm_head(hidden)[..., keep])
    assert loaded.to_base_ids(logits.argmax(-1)).max() <= 255


def test_a_base_models_folder_given_for_heads_is_refused(tmp_path):

    make_tiny_llama().save_pretrained(tmp_path)  # a 2-layer Llama: a base, not an EAGLE draft
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="neither Medusa heads .* got model_type='llama'"):
        load_heads(tmp_path)
