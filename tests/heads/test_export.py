import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from heads.export import ExportError, export_heads


@pytest.mark.filterwarnings("ignore:these heads record")  # the tiny base's bare name
@pytest.mark.parametrize("target", ["tgi", "trtllm"])
def test_medusa_lm_head_layout(medusa_dir, tmp_path, target):
    src, heads = medusa_dir
    export_heads(src, target, tmp_path / target)
    t = load_file(tmp_path / target / "medusa_lm_head.safetensors")
    assert set(t) == {
        "0.0.linear.weight",
        "0.0.linear.bias",
        "0.1.weight",
        "1.0.linear.weight",
        "1.0.linear.bias",
        "1.1.weight",
    }
    assert torch.equal(t["1.1.weight"], heads.lm_heads[1].weight)
    cfg = json.loads((tmp_path / target / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 2 and cfg["medusa_num_layers"] == 1


def test_vllm_export_is_native_copy(medusa_dir, tmp_path):
    src, _ = medusa_dir
    export_heads(src, "vllm", tmp_path / "v")
    assert (tmp_path / "v/model.safetensors").read_bytes() == (
        src / "model.safetensors"
    ).read_bytes()


def test_refusals(tiny_llama, medusa_dir, tmp_path):
    src, _ = medusa_dir
    with pytest.raises(ExportError, match="SGLang has no Medusa"):
        export_heads(src, "sglang", tmp_path / "s")
    shared = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=2, original_lm_head=True)
    ).init_from_base(tiny_llama)
    shared.save_pretrained(tmp_path / "shared")
    with pytest.raises(
        ExportError, match="one lm_head per Medusa head.*heads.shared_lm_head=false"
    ):
        export_heads(tmp_path / "shared", "trtllm", tmp_path / "t")
    EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1)).save_pretrained(tmp_path / "e1")
    with pytest.raises(ExportError, match="Medusa heads"):
        export_heads(tmp_path / "e1", "tgi", tmp_path / "t2")
    # TGI and TensorRT-LLM read lm_head row j as token j: a draft vocabulary's rows would
    # draft other tokens than the heads rank
    config = MedusaConfig.from_base(tiny_llama.config, num_heads=2, truncated_vocab_size=128)
    reduced = MedusaHeads(config)
    reduced.init_from_base(tiny_llama, token_map=torch.arange(0, 256, 2))
    reduced.save_pretrained(tmp_path / "reduced")
    for target in ("tgi", "trtllm"):
        with pytest.raises(
            ExportError, match=r"no reduced draft vocabulary .*\(heads.draft_vocab_size=null\)"
        ):
            export_heads(tmp_path / "reduced", target, tmp_path / target / "new" / "out")
        assert not (tmp_path / target).exists()  # nor the folders made on the way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sglang_eagle1_has_its_architecture_and_a_zero_fc_bias(tiny_llama, tmp_path, dtype):
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1))
    draft.save_pretrained(tmp_path / "e1", dtype=dtype)  # the bias in the weights' dtype
    export_heads(tmp_path / "e1", "sglang", tmp_path / "s1")
    native = json.loads((tmp_path / "e1/config.json").read_text())
    sglang = json.loads((tmp_path / "s1/config.json").read_text())
    # vLLM maps LlamaForCausalLM to its EAGLE model; SGLang builds EAGLE-1 only under its name
    assert native["architectures"] == ["LlamaForCausalLM"]
    assert sglang == {**native, "architectures": ["LlamaForCausalLMEagle"]}
    before, after = (
        load_file(tmp_path / "e1/model.safetensors"),
        load_file(tmp_path / "s1/model.safetensors"),
    )
    assert set(after) == set(before) | {"fc.bias"}
    assert (
        torch.equal(after["fc.bias"], torch.zeros(64))
        and after["fc.bias"].dtype == before["fc.weight"].dtype
    )
    for name in before:
        assert torch.equal(after[name], before[name]), name
    # its card serves it with SGLang as it is, and says vLLM reads the native layout
    card = (tmp_path / "s1/README.md").read_text()
    assert "--speculative-draft-model-path REPO " in card and "'sglang'" not in card
    assert 'export_heads("REPO", "vllm", "draft-vllm")' in card
    # the zero bias is no bias: the SGLang folder exports back to vLLM as the native one
    export_heads(tmp_path / "s1", "vllm", tmp_path / "v1")
    assert json.loads((tmp_path / "v1/config.json").read_text()) == native
    assert set(load_file(tmp_path / "v1/model.safetensors")) == set(before)


def test_sglang_eagle3_export_is_the_native_folder(tmp_path, monkeypatch):
    from tests.conftest import make_tiny_llama

    base = make_tiny_llama(num_hidden_layers=8)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    draft.set_vocab_map(torch.arange(0, 256, 8))
    draft.save_pretrained(tmp_path / "e3")
    export_heads(tmp_path / "e3", "sglang", tmp_path / "s")
    native = json.loads((tmp_path / "e3/config.json").read_text())
    sglang = json.loads((tmp_path / "s/config.json").read_text())
    # headstart / vLLM: the state entering layers 2, 4, 5 (vLLM reads the top-level key); SGLang
    # reads eagle_config's and captures before layer id + 1: 1, 3, 4 there
    assert native["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert native["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert sglang == native
    export_heads(tmp_path / "e3", "vllm", tmp_path / "v")
    assert json.loads((tmp_path / "v/config.json").read_text()) == native
    # headstart's own card is written anew (an older one told SGLang users to export first);
    # a card written by hand is kept
    old = "---\nlibrary_name: headstart\n---\n# SGLang counts aux ids one lower: rewrite first\n"
    (tmp_path / "e3/README.md").write_text(old)
    export_heads(tmp_path / "e3", "sglang", tmp_path / "s2")
    card = (tmp_path / "s2/README.md").read_text()
    assert "rewrite first" not in card and "--speculative-draft-model-path REPO" in card
    (tmp_path / "e3/README.md").write_text("# My draft\n")
    export_heads(tmp_path / "e3", "vllm", tmp_path / "v2")
    assert (tmp_path / "v2/README.md").read_text() == "# My draft\n"
    # the embeddings (id 0) are refused before anything is written
    low = EagleDraft(
        EagleConfig.from_base(base.config, version=3, draft_vocab_size=32, aux_layer_ids=[0, 4, 5])
    )
    low.set_vocab_map(torch.arange(0, 256, 8))
    low.save_pretrained(tmp_path / "low")
    for engine in ("sglang", "vllm"):  # SGLang's Llama fails on id 0, as older vLLM's did
        with pytest.raises(ExportError, match="SGLang does not capture the embeddings"):
            export_heads(tmp_path / "low", engine, tmp_path / f"low-{engine}")
        assert not (tmp_path / f"low-{engine}").exists()
    # a Hub repo id (what the model card's EAGLE-1 SGLang lines export) is downloaded first
    import huggingface_hub

    fetched = []
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo, **kw: fetched.append(repo) or tmp_path / "e3",
    )
    export_heads("me/tiny-eagle3", "sglang", tmp_path / "hub-s")
    assert fetched == ["me/tiny-eagle3"]
    assert json.loads((tmp_path / "hub-s/config.json").read_text()) == sglang


@pytest.mark.filterwarnings("ignore:these heads record")  # the tiny base's bare name
def test_tgi_reads_a_bias_free_residual_block_as_zero_biases(tiny_llama, tmp_path):
    heads = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=2, num_layers=1, medusa_fc_bias=False)
    ).init_from_base(tiny_llama)
    heads.save_pretrained(tmp_path / "medusa")
    export_heads(tmp_path / "medusa", "tgi", tmp_path / "tgi")
    t = load_file(tmp_path / "tgi" / "medusa_lm_head.safetensors")
    for h in range(2):  # TGI's residual block always loads `linear.bias`
        assert torch.equal(t[f"{h}.0.linear.bias"], torch.zeros(64))
        assert torch.equal(t[f"{h}.0.linear.weight"], heads.blocks[h].layers[0].weight)


def test_tgi_gets_a_base_it_can_load(tiny_llama, tmp_path):
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=1))
    heads.save_pretrained(tmp_path / "medusa")  # records the base as "tiny-llama-0"
    with pytest.warns(
        UserWarning, match="record 'tiny-llama-0' as their base, .* without an owner"
    ):
        export_heads(tmp_path / "medusa", "tgi", tmp_path / "tgi")
    export_heads(tmp_path / "medusa", "tgi", tmp_path / "tgi2", base_name="me/tiny-llama")
    config = json.loads((tmp_path / "tgi2" / "config.json").read_text())
    assert config["base_model_name_or_path"] == "me/tiny-llama"
    with pytest.warns(UserWarning, match=r"--base-name '\./tiny', .*: a local path"):
        export_heads(tmp_path / "medusa", "tgi", tmp_path / "tgi4", base_name="./tiny")
    with pytest.raises(ExportError, match="--base-name is for tgi"):
        export_heads(tmp_path / "medusa", "vllm", tmp_path / "v", base_name="me/tiny-llama")
    # heads that record no base (another trainer's): refused, naming the flag
    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    config["base_model_name_or_path"] = ""
    (tmp_path / "medusa" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="record '' as their base.* --base-name"):
        export_heads(tmp_path / "medusa", "tgi", tmp_path / "tgi3")


def test_sglang_refuses_an_eagle3_layer_with_biases(tmp_path):
    from tests.conftest import make_tiny_llama

    base = make_tiny_llama(attention_bias=True, num_hidden_layers=8)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    draft.set_vocab_map(torch.arange(0, 256, 8))
    draft.save_pretrained(tmp_path / "e3")
    with pytest.raises(ExportError, match="no attention or MLP biases.*attention_bias.*vLLM"):
        export_heads(tmp_path / "e3", "sglang", tmp_path / "s")
    export_heads(tmp_path / "e3", "vllm", tmp_path / "v")  # vLLM's layer has them


def test_sglang_refuses_an_eagle1_layer_with_mlp_biases(tmp_path):
    """SGLang's EAGLE-1 layer biases q/k/v and o_proj but has no MLP biases, and its loader
    skips the file's without a word: a draft of a base with mlp_bias is refused there."""
    from tests.conftest import make_tiny_llama

    base = make_tiny_llama(mlp_bias=True, attention_bias=True)
    EagleDraft(EagleConfig.from_base(base.config, version=1)).save_pretrained(tmp_path / "e1")
    with pytest.raises(ExportError, match="SGLang's EAGLE-1 layer has no MLP biases.*vLLM"):
        export_heads(tmp_path / "e1", "sglang", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    export_heads(tmp_path / "e1", "vllm", tmp_path / "v")  # vLLM's layer has them
    # with an fc bias too (EAGLE's reference trains one), neither engine has all its biases
    both = EagleDraft(EagleConfig.from_base(base.config, version=1, fc_bias=True))
    torch.nn.init.normal_(both.fc.bias)  # an all-zero bias reads as none
    both.save_pretrained(tmp_path / "both")
    for engine in ("vllm", "sglang"):
        with pytest.raises(ExportError, match="serve it with headstart .neither engine"):
            export_heads(tmp_path / "both", engine, tmp_path / f"both-{engine}")
    base = make_tiny_llama(attention_bias=True)  # attention biases alone: SGLang has those
    EagleDraft(EagleConfig.from_base(base.config, version=1)).save_pretrained(tmp_path / "a1")
    export_heads(tmp_path / "a1", "sglang", tmp_path / "a1-s")


def test_aux_layers_the_engines_would_collect_in_another_order_are_refused(tmp_path):
    from tests.conftest import make_tiny_llama

    # A 2-layer base's default ids repeat a layer ([1, 1, 0]): native headstart fuses them as
    # listed, the engines would collect layers 0 and 1 once each.
    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    draft.save_pretrained(tmp_path / "e3")
    for target in ("vllm", "sglang"):
        with pytest.raises(ExportError, match=r"aux layer ids \[1, 1, 0\]: vLLM and SGLang"):
            export_heads(tmp_path / "e3", target, tmp_path / target)
    deeper = make_tiny_llama(num_hidden_layers=8)
    for ids in ([5, 2, 7], [2, 2, 7]):
        with pytest.raises(
            ValueError,
            match=rf"aux_layer_ids {ids}: give them in ascending order, each once".replace(
                "[", r"\["
            ).replace("]", r"\]"),
        ):
            EagleConfig.from_base(deeper.config, version=3, aux_layer_ids=ids)


@pytest.mark.filterwarnings("ignore:these heads record")  # the tiny base's bare name
@pytest.mark.parametrize("bias, layers", [(True, 2), (False, 2), (False, 1)])
def test_the_reference_medusa_layout_loads_back(tiny_llama, tmp_path, bias, layers):
    """FasterDecoding's and TGI's `medusa_lm_head` layout (what the tgi export writes) loads
    with load_heads and drafts as the heads it came from; a config without medusa_num_layers
    means one layer, as the reference repos default it."""
    from heads import load_heads

    heads = MedusaHeads(
        MedusaConfig.from_base(
            tiny_llama.config, num_heads=3, num_layers=layers, medusa_fc_bias=bias
        )
    ).init_from_base(tiny_llama)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn_like(p))
    heads.save_pretrained(tmp_path / "medusa")
    export_heads(tmp_path / "medusa", "tgi", tmp_path / "tgi")
    loaded = load_heads(tmp_path / "tgi", base=tiny_llama)
    assert isinstance(loaded, MedusaHeads)
    assert (loaded.config.num_heads, loaded.config.num_hidden_layers) == (3, layers)
    assert loaded.config.base_model_name_or_path == "tiny-llama-0"
    hidden = torch.randn(1, 5, 64)
    torch.testing.assert_close(loaded(hidden), heads.eval()(hidden), rtol=0, atol=1e-6)
    # as the reference repos ship it: only the Medusa keys in config.json, medusa_num_layers
    # left out for one layer (their default)
    reference = {"medusa_num_heads": 3, "base_model_name_or_path": "x"}
    if layers > 1:
        reference["medusa_num_layers"] = layers
    (tmp_path / "tgi" / "config.json").write_text(json.dumps(reference))
    torch.testing.assert_close(
        load_heads(tmp_path / "tgi")(hidden), heads(hidden), rtol=0, atol=1e-6
    )
    bigger = tiny_llama.config.hidden_size * 2
    from tests.conftest import make_tiny_llama

    with pytest.raises(ValueError, match="hidden_size=64, but the given base"):
        load_heads(tmp_path / "tgi", base=make_tiny_llama(hidden_size=bigger))


@pytest.mark.filterwarnings("ignore:these heads record")  # the tiny base's bare name
def test_vllm_and_sglang_exports_write_the_native_layout_of_any_loadable_folder(
    tiny_llama, tmp_path
):
    """A folder load_heads reads in another layout, or written by an earlier headstart, comes
    out as the engines read it: native tensor names, today's config keys, the source's dtype."""
    from heads import load_heads

    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).init_from_base(
        tiny_llama
    )
    heads.save_pretrained(tmp_path / "medusa", dtype=torch.bfloat16)
    export_heads(tmp_path / "medusa", "tgi", tmp_path / "tgi")
    export_heads(tmp_path / "tgi", "vllm", tmp_path / "v")  # the reference layout -> vLLM's
    names = set(load_file(tmp_path / "v" / "model.safetensors"))
    assert "blocks.0.layers.0.weight" in names and "lm_heads.1.weight" in names
    again = load_heads(tmp_path / "v", base=tiny_llama)
    hidden = torch.randn(1, 3, 64)
    torch.testing.assert_close(
        again(hidden), load_heads(tmp_path / "medusa", base=tiny_llama)(hidden)
    )
    # an earlier headstart's key, which vLLM takes for the residual layers per head
    cfg = json.loads((tmp_path / "medusa" / "config.json").read_text())
    cfg["base_num_hidden_layers"] = cfg.pop("base_hidden_layers")
    (tmp_path / "medusa" / "config.json").write_text(json.dumps(cfg))
    export_heads(tmp_path / "medusa", "vllm", tmp_path / "v2")
    written = json.loads((tmp_path / "v2" / "config.json").read_text())
    assert "base_num_hidden_layers" not in written and written["base_hidden_layers"] == 2
    assert written["torch_dtype"] == "bfloat16"
    assert (
        load_file(tmp_path / "v2" / "model.safetensors")["lm_heads.0.weight"].dtype
        == torch.bfloat16
    )
    # an EAGLE-3 folder naming its aux layers at the top level only
    from tests.conftest import make_tiny_llama

    deeper = make_tiny_llama(num_hidden_layers=8)
    draft = EagleDraft(EagleConfig.from_base(deeper.config, version=3, draft_vocab_size=32))
    draft.set_vocab_map(torch.arange(0, 256, 8))
    draft.save_pretrained(tmp_path / "e3")
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    del cfg["eagle_config"]
    (tmp_path / "e3" / "config.json").write_text(json.dumps(cfg))
    export_heads(tmp_path / "e3", "sglang", tmp_path / "s")
    sglang = json.loads((tmp_path / "s" / "config.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert sglang["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def _medusa2(base, folder: Path) -> Path:
    """Medusa-2 heads as training writes them: the adapter's folder, then the heads."""
    config = MedusaConfig.from_base(base.config, num_heads=2, base_lora="lora")
    (folder / "lora").mkdir(parents=True)
    (folder / "lora" / "adapter_config.json").write_text("{}")
    MedusaHeads(config).init_from_base(base).save_pretrained(folder)
    return folder


def test_a_failed_export_leaves_what_another_wrote_beside_it(medusa_dir, tmp_path, monkeypatch):
    import heads.export

    def fail(heads_, src, target, staging, base_name):  # another export finishes meanwhile
        (tmp_path / "new" / "vllm").mkdir(parents=True)
        (tmp_path / "new" / "vllm" / "config.json").write_text("{}")
        raise ExportError("refused")

    monkeypatch.setattr(heads.export, "_export_to", fail)
    with pytest.raises(ExportError, match="refused"):
        export_heads(medusa_dir[0], "tgi", tmp_path / "new" / "tgi")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["vllm"]
    assert (tmp_path / "new" / "vllm" / "config.json").read_text() == "{}"


def test_an_unknown_target_is_refused_before_anything_is_written(medusa_dir, tmp_path):
    src, _ = medusa_dir
    with pytest.raises(ExportError, match="unknown target 'onnx'; choose one of vllm, sglang, tgi"):
        export_heads(src, "onnx", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_base_name_is_refused_for_every_target_but_tgi(medusa_dir, tmp_path):
    src, _ = medusa_dir
    for target in ("vllm", "sglang", "trtllm"):
        with pytest.raises(ExportError, match=f"--base-name is for tgi.*; {target} is given"):
            export_heads(src, target, tmp_path / target, base_name="me/tiny-llama")
        assert not (tmp_path / target).exists()


def test_medusa2_heads_to_trtllm_warn_and_export_again_into_the_same_folder(tiny_llama, tmp_path):
    src = _medusa2(tiny_llama, tmp_path / "medusa2")
    out = tmp_path / "out"
    with pytest.warns(
        UserWarning, match="trtllm loads the base these heads name, without their LoRA"
    ):
        export_heads(src, "trtllm", out)
    assert (out / "lora" / "adapter_config.json").is_file()
    # the earlier export's adapter folder is the export's own: replaced, not refused
    export_heads(src, "vllm", out)
    assert sorted(p.name for p in out.iterdir()) == [
        ".headstart-export",
        "README.md",
        "config.json",
        "lora",
        "model.safetensors",
    ]
    assert json.loads((out / "config.json").read_text())["base_lora"] == "lora"


def test_a_hand_written_card_that_names_headstart_is_kept(medusa_dir, tmp_path):
    src, _ = medusa_dir
    mine = "# Our Medusa heads\nTrained with headstart on our support chats.\n"
    (src / "README.md").write_text(mine)
    export_heads(src, "vllm", tmp_path / "v")
    assert (tmp_path / "v" / "README.md").read_text() == mine


def test_an_fp16_folder_exports_in_fp16(tiny_llama, tmp_path):
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2))
    heads.init_from_base(tiny_llama).save_pretrained(tmp_path / "m", dtype=torch.float16)
    export_heads(tmp_path / "m", "vllm", tmp_path / "v")
    assert json.loads((tmp_path / "v" / "config.json").read_text())["torch_dtype"] == "float16"
    with safe_open(tmp_path / "v" / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}  # noqa: SIM118


def test_the_sglang_eagle1_weights_keep_the_native_header(tiny_llama, tmp_path):
    EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1)).save_pretrained(tmp_path / "e1")
    export_heads(tmp_path / "e1", "sglang", tmp_path / "s1")
    headers = []
    for folder in ("e1", "s1"):
        with safe_open(tmp_path / folder / "model.safetensors", framework="pt") as f:
            headers.append(f.metadata())
    assert headers == [{"format": "pt"}, {"format": "pt"}]


def test_tgi_is_warned_of_an_absolute_base_path_this_machine_lacks(medusa_dir, tmp_path):
    src, _ = medusa_dir
    name = "/srv/no-such-models/tiny-llama"
    assert not Path(name).exists()
    with pytest.warns(UserWarning, match=rf"--base-name '{name}', .*: a local path"):
        export_heads(src, "tgi", tmp_path / "tgi", base_name=name)


@pytest.mark.parametrize("target", ["tgi", "trtllm"])
def test_the_medusa_lm_head_config_holds_what_the_engines_read(medusa_dir, tmp_path, target):
    src, _ = medusa_dir
    base_name = "me/tiny-llama" if target == "tgi" else None
    export_heads(src, target, tmp_path / target, base_name=base_name)
    assert json.loads((tmp_path / target / "config.json").read_text()) == {
        "medusa_num_heads": 2,
        "medusa_num_layers": 1,
        "hidden_size": 64,
        "vocab_size": 256,
        "base_model_name_or_path": base_name or "tiny-llama-0",
    }
