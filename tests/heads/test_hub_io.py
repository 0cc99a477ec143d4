"""Saving heads (bf16 weights beside an exact vocabulary map, no temporary folder left) and the
Hub: a download's revision, token and Medusa-2 adapter; pushing again; the card's lines; why a
push failed. Offline: the Hub is a fake."""

from __future__ import annotations

import fnmatch
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads, load_heads
from heads.checkpoint import resolve_folder
from heads.hub import HubPushError, model_card, push_folder
from tests.conftest import make_tiny_llama


def _eagle3_with_large_ids():
    base = make_tiny_llama(vocab_size=4096)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    draft.set_vocab_map(torch.arange(1, 4096, 128))  # offsets up to 3938: not exact in bf16
    return draft


def test_a_bf16_save_casts_the_weights_but_not_the_vocabulary_map(tmp_path):
    draft = _eagle3_with_large_ids()
    folder = draft.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    saved = load_file(folder / "model.safetensors")
    assert saved["fc.weight"].dtype == torch.bfloat16
    assert saved["d2t"].dtype == draft.d2t.dtype and torch.equal(saved["d2t"], draft.d2t)
    assert saved["t2d"].dtype == torch.bool and torch.equal(saved["t2d"], draft.t2d)
    again = load_heads(folder)
    assert torch.equal(again.d2t, draft.d2t)


def test_saving_leaves_no_temporary_folder_beside_the_heads(tiny_llama, tmp_path):
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2))
    heads.save_pretrained(tmp_path / "heads")
    heads.save_pretrained(tmp_path / "heads")  # over an earlier save
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]


def _fake_hub(monkeypatch, remote: Path, calls: list):
    """snapshot_download as the Hub does it: the files of `remote` that allow_patterns match."""
    import huggingface_hub

    def snapshot_download(repo_id, revision=None, token=None, allow_patterns=None, **kwargs):
        calls.append({"repo_id": repo_id, "revision": revision, "token": token, **kwargs})
        local = remote.parent / f"snapshot-{len(calls)}"
        for path in remote.rglob("*"):
            name = path.relative_to(remote).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


def test_a_hub_download_takes_the_revision_token_and_the_medusa2_adapter(
    tiny_llama, tmp_path, monkeypatch
):
    remote = tmp_path / "remote"
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(remote)
    (remote / "lora").mkdir()
    (remote / "lora" / "adapter_config.json").write_text("{}")  # a Medusa-2 adapter
    (remote / "lora" / "adapter_model.safetensors").write_bytes(b"")
    (remote / "pytorch_model.bin").write_bytes(b"pickle")  # never downloaded
    calls = []
    _fake_hub(monkeypatch, remote, calls)
    folder = resolve_folder("me/medusa2", revision="v2", token="hf_secret")
    assert calls == [{"repo_id": "me/medusa2", "revision": "v2", "token": "hf_secret"}]
    assert (folder / "lora" / "adapter_config.json").is_file()
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert not (folder / "pytorch_model.bin").exists()


def test_load_heads_and_from_pretrained_take_huggingface_hubs_download_options(
    tiny_llama, tmp_path, monkeypatch
):
    remote = tmp_path / "remote"
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(remote)
    calls = []
    _fake_hub(monkeypatch, remote, calls)
    options = {"cache_dir": str(tmp_path / "cache"), "local_files_only": True}
    heads = MedusaHeads.from_pretrained("me/medusa", tiny_llama, force_download=True, **options)
    assert isinstance(heads, MedusaHeads) and heads.config.num_heads == 2
    assert calls == [
        {"repo_id": "me/medusa", "revision": None, "token": None, "force_download": True, **options}
    ]
    with pytest.raises(TypeError, match="me/medusa holds MedusaHeads, not EagleDraft: load it"):
        EagleDraft.from_pretrained("me/medusa")
    (remote / "model.safetensors").unlink()  # a download cut short, in the cache
    with pytest.raises(FileNotFoundError, match="the cached copy of me/medusa .* has no "):
        load_heads("me/medusa", local_files_only=True)


def test_pushing_again_to_a_repo_updates_it(tiny_llama, tmp_path, fake_hub):
    folder = tmp_path / "heads"
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(folder)
    assert push_folder(folder, "me/heads") == "https://hub/me/heads/commit/1"
    assert push_folder(folder, "me/heads") == "https://hub/me/heads/commit/2"  # not a 409


def test_a_push_removes_weights_files_the_heads_have_not_and_keeps_the_rest(
    tiny_llama, tmp_path, fake_hub
):
    """A repo that held TGI's layout, or shards, before: loaders read every top-level
    .safetensors file, so those the new heads lack go in the same commit; other files stay."""
    fake_hub.files["me/heads"] = {
        "medusa_lm_head.safetensors": b"tgi",
        "model-00001-of-00002.safetensors": b"shard",
        "model.safetensors.index.json": b"{}",
        "notes.md": b"mine",
        "old/model.safetensors": b"kept: not at the top",
    }
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2))
    heads.push_to_hub("me/heads")
    assert sorted(fake_hub.files["me/heads"]) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "notes.md",
        "old/model.safetensors",
    ]
    download = tmp_path / "download"  # what a snapshot of the repo's top holds
    download.mkdir()
    for name, data in fake_hub.files["me/heads"].items():
        if "/" not in name:
            (download / name).write_bytes(data)
    assert load_heads(download, base=tiny_llama).config.num_heads == 2


def test_a_push_to_a_branch_makes_it_and_a_pull_request_commits_nothing(tiny_llama, fake_hub):
    fake_hub.files["me/heads"] = {"medusa_lm_head.safetensors": b"tgi", "notes.md": b"mine"}
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2))
    assert heads.push_to_hub("me/heads", revision="v2").endswith("/commit/1")
    assert fake_hub.branches["me/heads"] == {"v2"}
    assert sorted(fake_hub.files["me/heads"]) == ["medusa_lm_head.safetensors", "notes.md"]
    branch = fake_hub.files["me/heads@v2"]  # made from main; its stale weights go there
    assert sorted(branch) == ["README.md", "config.json", "model.safetensors", "notes.md"]
    url = heads.push_to_hub("me/heads", create_pr=True)
    assert url == "https://hub/me/heads/discussions/2"
    assert sorted(fake_hub.files["me/heads"]) == ["medusa_lm_head.safetensors", "notes.md"]
    assert "model.safetensors" in fake_hub.pulls["me/heads"]


@pytest.mark.parametrize("version", [1, 3])
def test_the_pushed_card_names_the_repo_in_every_serving_line(tmp_path, fake_hub, version):
    """EAGLE-1's card exports for SGLang from the repo; EAGLE-3's SGLang line reads it: both
    must name the repo pushed to, not the REPO placeholder."""
    base = make_tiny_llama(num_hidden_layers=8)
    config = EagleConfig.from_base(base.config, version=version, draft_vocab_size=256)
    EagleDraft(config).save_pretrained(tmp_path / "draft")
    push_folder(tmp_path / "draft", "me/draft")
    card = fake_hub.card("me/draft")
    assert "REPO" not in card
    if version == 1:
        assert "export_heads('me/draft', 'sglang', 'draft-sglang')" in card
    else:
        assert "--speculative-draft-model-path me/draft " in card


@pytest.mark.parametrize("offline", [False, True])
def test_a_failed_push_says_why_offline_or_not(
    tiny_llama, tmp_path, monkeypatch, fake_hub, offline
):
    import heads.hub

    fake_hub.unreachable = True
    monkeypatch.setattr(heads.hub, "hub_offline", lambda: offline)
    folder = tmp_path / "heads"
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(folder)
    with pytest.raises(HubPushError) as error:
        push_folder(folder, "me/heads")
    hint = "HF_HUB_OFFLINE is set: unset it to push" if offline else "Check the network"
    assert hint in str(error.value)


def test_the_card_names_a_hub_base_but_not_a_local_folder(tiny_llama, tmp_path):
    config = MedusaConfig.from_base(tiny_llama.config, num_heads=2)
    config.base_model_name_or_path = "org/base"
    assert "\nbase_model: org/base\n" in model_card(config, "me/m")
    local = tmp_path / "my-base"
    local.mkdir()
    config.base_model_name_or_path = str(local)  # the Hub refuses such a base_model
    assert "base_model:" not in model_card(config, "me/m")


def test_an_offline_push_says_so_once(tiny_llama, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "heads"
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(folder)
    with pytest.raises(HubPushError, match="offline mode is enabled") as error:
        push_folder(folder, "me/heads")  # huggingface_hub's own message says to unset it
    said = str(error.value)
    assert said.count("HF_HUB_OFFLINE") == 1 and ".." not in said and said.endswith(".")


def test_a_revision_given_for_a_local_folder_is_said_not_applied(tiny_llama, tmp_path):
    folder = tmp_path / "me" / "heads"  # a repo id's form, and a folder here: the folder is read
    MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2)).save_pretrained(folder)
    with pytest.warns(UserWarning, match="is a local folder: revision='v2' is for Hub repos"):
        load_heads(folder, revision="v2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_heads(folder)
