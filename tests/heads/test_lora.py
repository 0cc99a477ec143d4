import copy
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import cpu_offload
from peft import LoraConfig, get_peft_model

from heads import MedusaConfig, MedusaHeads, load_heads
from heads.cpu import can_prepack, prepack_linear_weights
from heads.lora import base_as_served, lora_merged, lora_probe, with_heads_adapter
from tests.conftest import make_tiny_llama


def test_the_probe_tells_a_base_with_the_adapter_merged_from_the_plain_one():
    plain = make_tiny_llama(seed=2)
    adapted = get_peft_model(copy.deepcopy(plain), LoraConfig(r=2, target_modules=["q_proj"]))
    assert lora_probe(adapted)["plain"] == lora_probe(adapted)["merged"]  # B starts at zero
    assert lora_merged(plain, lora_probe(adapted)) is None  # a fresh adapter: nothing to tell
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    probe = lora_probe(adapted, k=4)
    assert probe["weight"] == "model.layers.0.self_attn.q_proj.weight" and len(probe["index"]) == 4
    assert lora_merged(adapted, probe) is True  # a peft model computes with its adapter
    assert lora_merged(plain, probe) is False
    merged = adapted.merge_and_unload()
    assert lora_merged(merged, probe) is True
    # offloaded by accelerate (its weights on "meta", the values in the hooks): read the same
    assert lora_merged(cpu_offload(copy.deepcopy(merged), torch.device("cpu")), probe) is True
    assert lora_merged(cpu_offload(copy.deepcopy(plain), torch.device("cpu")), probe) is False
    assert lora_merged(merged.to(torch.bfloat16), probe) is True  # served in another dtype
    assert (
        lora_merged(make_tiny_llama(seed=2, num_hidden_layers=1), {**probe, "weight": "x"}) is None
    )
    assert lora_probe(plain) == {}


def test_a_tied_adapted_weight_is_found():
    plain = make_tiny_llama(seed=2, tie_word_embeddings=True)
    adapted = get_peft_model(copy.deepcopy(plain), LoraConfig(r=2, target_modules=["lm_head"]))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    probe = lora_probe(adapted)
    assert probe["weight"] == "lm_head.weight"  # tied: named_parameters lists it only once
    assert lora_merged(plain, probe) is False
    assert lora_merged(adapted.merge_and_unload(), probe) is True


def test_a_hub_download_brings_the_adapter_along(tmp_path, monkeypatch):
    """`resolve_folder` downloads only what heads need; Medusa-2's lora/ is part of that."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from heads.checkpoint import resolve_folder

    files = ["config.json", "model.safetensors", "README.md", "training_metrics.json"]
    files += ["lora/adapter_config.json", "lora/adapter_model.safetensors", "lora/README.md"]
    files += ["optimizer.pt"]
    fetched = []

    def snapshot(repo_id, allow_patterns=None, **kw):
        fetched.extend(filter_repo_objects(files, allow_patterns=allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_folder("me/medusa2") == tmp_path
    assert {"lora/adapter_config.json", "lora/adapter_model.safetensors"} <= set(fetched)
    assert "optimizer.pt" not in fetched and "training_metrics.json" not in fetched


def test_medusa2_heads_keep_their_adapter_when_saved_again_pushed_or_exported(
    tmp_path, monkeypatch
):
    """The heads module does not hold the base's adapter: saving copies it from the folder the
    heads were loaded from, and a save or export that would lose it is refused, writing nothing."""
    import pytest

    from heads import MedusaConfig, MedusaHeads, load_heads
    from heads.export import ExportError, export_heads

    base = make_tiny_llama()
    config = MedusaConfig.from_base(base.config, num_heads=2, base_lora="lora")
    heads = MedusaHeads(config).init_from_base(base)
    with pytest.raises(ValueError, match="neither .*first nor the folder they were loaded from"):
        heads.save_pretrained(tmp_path / "first")
    assert not (tmp_path / "first").exists()
    (tmp_path / "first" / "lora").mkdir(parents=True)  # as training writes it, before the heads
    (tmp_path / "first" / "lora" / "adapter_config.json").write_text("{}")
    heads.save_pretrained(tmp_path / "first")
    loaded = load_heads(tmp_path / "first")
    loaded.save_pretrained(tmp_path / "first")  # into its own folder: nothing to copy
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "lora" / "adapter_config.json").read_text() == "{}"
    import heads.hub as hub

    pushed = []

    def push(folder, repo_id, **kw):
        pushed.extend(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*"))
        return f"https://huggingface.co/{repo_id}"

    monkeypatch.setattr(hub, "push_folder", push)
    loaded.push_to_hub("me/medusa2")
    assert "lora/adapter_config.json" in pushed
    with pytest.warns(UserWarning, match="without their LoRA adapter"):
        export_heads(tmp_path / "again", "tgi", tmp_path / "tgi", base_name="me/base")
    assert (tmp_path / "tgi" / "lora" / "adapter_config.json").is_file()
    # a folder whose config names the adapter but lacks it: refused before anything is written
    shutil.rmtree(tmp_path / "again" / "lora")
    with pytest.raises(ExportError, match="'lora' folder, which .* lacks"):
        export_heads(tmp_path / "again", "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_medusa2_heads_are_given_the_base_with_their_adapter_merged(tmp_path):
    # what eval_heads.py scores Medusa-2 heads on: the base as they are served, adapter merged
    from heads import MedusaConfig, MedusaHeads, load_heads
    from heads.lora import with_heads_adapter

    plain = make_tiny_llama(seed=2)
    adapted = get_peft_model(copy.deepcopy(plain), LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    adapted.save_pretrained(tmp_path / "heads" / "lora")
    config = MedusaConfig.from_base(
        plain.config, num_heads=2, base_lora="lora", base_lora_probe=lora_probe(adapted)
    )
    MedusaHeads(config).init_from_base(plain).save_pretrained(tmp_path / "heads")
    ids = torch.tensor([[1, 5, 9, 22]])
    want = adapted(input_ids=ids).logits
    base = with_heads_adapter(plain, load_heads(tmp_path / "heads"))
    torch.testing.assert_close(base(input_ids=ids).logits, want)
    assert with_heads_adapter(base, load_heads(tmp_path / "heads")) is base  # merged already
    other = MedusaHeads(MedusaConfig.from_base(plain.config, num_heads=2))
    assert with_heads_adapter(plain, other) is plain  # Medusa-1: the base as it is


def _adapted(plain, std: float = 0.05):
    """`plain` with a q_proj adapter whose B entries have `std` (seeded)."""
    adapted = get_peft_model(copy.deepcopy(plain), LoraConfig(r=2, target_modules=["q_proj"]))
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std, generator=draw)
    return adapted


def _medusa2_folder(folder: Path, plain, std: float = 0.05):
    """Medusa-2 heads saved in `folder` beside `_adapted(plain, std)`'s adapter; returns it."""
    from heads import MedusaConfig, MedusaHeads

    adapted = _adapted(plain, std)
    adapted.save_pretrained(folder / "lora")
    config = MedusaConfig.from_base(
        plain.config, num_heads=2, base_lora="lora", base_lora_probe=lora_probe(adapted)
    )
    MedusaHeads(config).init_from_base(plain).save_pretrained(folder)
    return adapted


def test_the_scripts_serve_medusa2_heads_on_their_merged_base(tmp_path, capsys):
    import pytest

    from heads import MedusaConfig, MedusaHeads, load_heads
    from heads.lora import base_as_served

    plain = make_tiny_llama(seed=2)
    _medusa2_folder(tmp_path / "m2", plain, std=0.05)
    MedusaHeads(MedusaConfig.from_base(plain.config, num_heads=2)).save_pretrained(tmp_path / "m1")
    probe = load_heads(tmp_path / "m2").config.base_lora_probe

    assert base_as_served(plain, [tmp_path / "m1"], "bench.py") == (plain, None)
    assert capsys.readouterr().err == ""
    served, folder = base_as_served(plain, [tmp_path / "m1", tmp_path / "m2"], "bench.py")
    assert folder == str(tmp_path / "m2") and lora_merged(served, probe) is True
    assert "bench.py: the base with the LoRA adapter" in capsys.readouterr().err
    assert base_as_served(served, [tmp_path / "m2"], "chat.py") == (served, None)  # merged
    _medusa2_folder(tmp_path / "other", make_tiny_llama(seed=2), std=0.05)
    with pytest.raises(ValueError, match="serve one of them at a time"):
        base_as_served(make_tiny_llama(seed=2), [tmp_path / "m2", tmp_path / "other"], "x")


def test_an_adapter_that_a_bf16_base_rounds_away_is_neither_merged_nor_warned_of(
    tmp_path, capsys, recwarn
):
    from heads import load_heads
    from heads.lora import base_as_served

    plain = make_tiny_llama(seed=2)
    _medusa2_folder(tmp_path / "m2", plain, std=1e-9)  # changes far below bf16's rounding
    probe = load_heads(tmp_path / "m2").config.base_lora_probe
    assert lora_merged(plain, probe) is False  # in float32 the adapter shows
    base = plain.to(torch.bfloat16)  # merged or not, the same bf16 weights: nothing to tell
    assert lora_merged(base, probe) is None
    assert base_as_served(base, [tmp_path / "m2"], "chat.py") == (base, None)
    assert capsys.readouterr().err == ""
    load_heads(tmp_path / "m2", base=base)
    assert not [w for w in recwarn if "LoRA" in str(w.message)]


def test_the_probe_holds_the_entries_the_adapter_changes_most_either_way():
    adapted = _adapted(make_tiny_llama(seed=2))
    probe = lora_probe(adapted, k=8)
    module = adapted.base_model.model.model.layers[0].self_attn.q_proj
    delta = module.get_delta_weight("default").reshape(-1)
    assert sorted(probe["index"]) == sorted(delta.abs().topk(8).indices.tolist())
    assert any(delta[i] < 0 for i in probe["index"])  # negative changes count as much


def test_a_probe_of_a_larger_weight_cannot_tell(tmp_path):
    plain = make_tiny_llama(seed=2)
    probe = lora_probe(_adapted(plain))
    numel = plain.get_parameter(probe["weight"]).numel()
    probe = {**probe, "index": [*probe["index"][:-1], numel]}  # one entry past this weight
    assert lora_merged(plain, probe) is None


def test_heads_whose_probe_cannot_tell_leave_the_base_as_given(tmp_path):
    # heads saved without a probe (base_lora_probe None) cannot tell a merged base from a plain
    # one: the base is left as given, never merged a second time
    plain = make_tiny_llama(seed=2)
    adapted = _medusa2_folder(tmp_path / "m2", plain)
    config = MedusaConfig.from_base(plain.config, num_heads=2, base_lora="lora")
    MedusaHeads(config).init_from_base(plain).save_pretrained(tmp_path / "m2")  # no probe
    heads = load_heads(tmp_path / "m2")
    assert heads.config.base_lora == "lora" and not heads.config.base_lora_probe
    merged = copy.deepcopy(adapted).merge_and_unload()
    ids = torch.tensor([[1, 5, 9, 22]])
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        served = with_heads_adapter(merged, heads)
        torch.testing.assert_close(served(input_ids=ids).logits, want)  # not merged twice


def test_a_prepacked_cpu_base_computes_with_the_merged_adapter(tmp_path):
    if not can_prepack():
        import pytest

        pytest.skip("no oneDNN packed linear in this torch build")
    plain = make_tiny_llama(seed=2)
    adapted = _medusa2_folder(tmp_path / "m2", plain)
    ids = torch.tensor([[1, 5, 9, 22]])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
    base = copy.deepcopy(plain)
    assert prepack_linear_weights(base) > 0  # as load_base packs a CPU base
    served, folder = base_as_served(base, [tmp_path / "m2"], "chat")
    assert folder == str(tmp_path / "m2")
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, want)


def test_the_probe_goes_by_all_its_entries_not_the_one_furthest_off():
    # three of four probed entries hold the merged values, one was moved elsewhere (the merged
    # base edited afterwards): taken together the entries are nearer the merged values
    base = make_tiny_llama(seed=2)
    weight = base.model.layers[0].self_attn.q_proj.weight
    index = [0, 1, 2, 3]
    plain = weight.reshape(-1)[index].tolist()
    merged = [v + 0.1 for v in plain]
    with torch.no_grad():
        flat = weight.view(-1)
        flat[index] = torch.tensor(merged)
        flat[3] = plain[3] - 0.3  # 0.4 from its merged value, 0.3 from its plain one
    probe = {
        "weight": "model.layers.0.self_attn.q_proj.weight",
        "index": index,
        "plain": plain,
        "merged": merged,
    }
    assert lora_merged(base, probe) is True


def _sharded(adapted):
    """`adapted` with its adapted q_proj's parameters emptied, as ZeRO-3 leaves them outside a
    gather, and the `gather(*params)` that makes them whole for the while."""
    module = adapted.base_model.model.model.layers[0].self_attn.q_proj
    whole = {p: p.data for p in module.parameters()}
    for p in whole:
        p.data = torch.empty(0)
    gathered = []

    @contextmanager
    def gather(*params):
        gathered.append(set(params))
        for p in params:
            p.data = whole[p]
        try:
            yield
        finally:
            for p in params:
                p.data = torch.empty(0)

    return module, gather, gathered


def test_a_sharded_adapter_is_probed_within_its_gather():
    adapted = _adapted(make_tiny_llama(seed=2))
    want = lora_probe(adapted, k=4)
    module, gather, gathered = _sharded(adapted)
    assert lora_probe(adapted, k=4, gather=gather) == want
    assert gathered == [set(module.parameters())]  # once, for the module read
    assert all(p.numel() == 0 for p in module.parameters())  # sharded again afterwards


def test_the_probe_holds_eight_entries_unless_told():
    adapted = _adapted(make_tiny_llama(seed=2))
    module = adapted.base_model.model.model.layers[0].self_attn.q_proj
    delta = module.get_delta_weight("default").reshape(-1)
    probe = lora_probe(adapted)
    assert sorted(probe["index"]) == sorted(delta.abs().topk(8).indices.tolist())
    assert len(probe["plain"]) == len(probe["merged"]) == 8
