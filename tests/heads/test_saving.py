"""What saving heads keeps and what loading them refuses beyond the formats: a model card
written by hand, the weights' file mode, a tensor in two weight files, dtype and device names."""

import os
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import load_heads
from tests.conftest import make_tiny_llama
from tests.heads.test_checkpoint import _eagle, _medusa


def test_a_tensor_in_two_weight_files_is_refused(tiny_llama, tmp_path):
    """A leftover copy of other weights beside them (model_v2.safetensors, zeroed here) would
    replace them unsaid, whichever sorts last: refused, naming both files. Shards with names of
    their own load together."""
    _medusa(tiny_llama).save_pretrained(tmp_path / "m")
    weights = load_file(tmp_path / "m/model.safetensors")
    save_file(
        {k: torch.zeros_like(v) for k, v in weights.items()}, tmp_path / "m/model_v2.safetensors"
    )
    first = sorted(weights)[0]
    with pytest.raises(
        ValueError,
        match=rf"holds tensor '{first}' in both model.safetensors and model_v2.safetensors, "
        rf"with other values \({len(weights)} such names\): move the file",
    ):
        load_heads(tmp_path / "m")
    shutil.copy(tmp_path / "m/model.safetensors", tmp_path / "m/model_v2.safetensors")
    load_heads(tmp_path / "m")  # the same weights twice (a consolidated file beside its shards)
    (tmp_path / "m/model_v2.safetensors").unlink()
    names = sorted(weights)
    save_file({k: weights[k] for k in names[:2]}, tmp_path / "m/model.safetensors")
    save_file({k: weights[k] for k in names[2:]}, tmp_path / "m/model-2.safetensors")
    loaded = load_heads(tmp_path / "m").state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in names)


def test_saving_keeps_a_model_card_written_by_hand(tiny_llama, tmp_path, fake_hub):
    """Re-saving heads (in bf16, say) over their folder, or loading and saving them elsewhere
    or to the Hub, keeps the card their owner wrote; headstart's own is written anew."""
    _eagle(tiny_llama, 3).save_pretrained(tmp_path / "e")
    assert "library_name: headstart" in (tmp_path / "e/README.md").read_text()
    mine = "# Our draft\nTrained on our support chats.\n"
    (tmp_path / "e/README.md").write_text(mine)
    heads = load_heads(tmp_path / "e")
    heads.save_pretrained(tmp_path / "e", dtype=torch.bfloat16)
    assert (tmp_path / "e/README.md").read_text() == mine
    assert load_heads(tmp_path / "e").fc.weight.dtype == torch.bfloat16
    heads.save_pretrained(tmp_path / "copy")
    assert (tmp_path / "copy/README.md").read_text() == mine
    heads.push_to_hub("me/ours")
    assert fake_hub.card("me/ours") == mine
    # heads built in memory, saved over a folder with headstart's card: the card is written anew
    (tmp_path / "e/README.md").write_text("---\nlibrary_name: headstart\n---\nolder\n")
    _eagle(tiny_llama, 3).save_pretrained(tmp_path / "e")
    assert "older" not in (tmp_path / "e/README.md").read_text()
    # other heads (another kind, or for another base) saved where these were: not their card
    (tmp_path / "e/README.md").write_text(mine)
    _medusa(tiny_llama).save_pretrained(tmp_path / "e")
    assert "library_name: headstart" in (tmp_path / "e/README.md").read_text()
    (tmp_path / "e/README.md").write_text(mine)
    other = _eagle(make_tiny_llama(), 3)
    other.config.base_model_name_or_path = "org/another-base"
    other.save_pretrained(tmp_path / "e")
    assert "org/another-base" in (tmp_path / "e/README.md").read_text()


def test_load_heads_reads_dtype_names_and_refuses_what_this_machine_cannot_use(
    tiny_llama, tmp_path
):
    _eagle(tiny_llama, 3).save_pretrained(tmp_path / "e")
    assert load_heads(tmp_path / "e", dtype="bfloat16").fc.weight.dtype == torch.bfloat16
    assert load_heads(tmp_path / "e", base=tiny_llama, dtype="auto").fc.weight.dtype == (
        tiny_llama.dtype
    )
    for bad in ("bf16", "int8", torch.int64):
        with pytest.raises(ValueError, match=r"is no floating torch dtype: give one such as"):
            load_heads(tmp_path / "e", dtype=bad)
    with pytest.raises(ValueError, match="device='gpu' is no torch device: give 'cpu', 'cuda'"):
        load_heads(tmp_path / "e", device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no cuda device on this machine"):
            load_heads(tmp_path / "e", device="cuda")


def test_saved_weights_are_as_readable_as_the_folders_other_files(tiny_llama, tmp_path):
    """safetensors 0.8 writes owner-only files (0600): a server running as another user could
    read the config but not the weights. They take the mode any new file takes here."""
    from heads.export import export_heads

    umask = os.umask(0o022)  # the usual one, whatever this shell's
    try:
        _medusa(tiny_llama).save_pretrained(tmp_path / "m")
        export_heads(tmp_path / "m", "tgi", tmp_path / "tgi")
    finally:
        os.umask(umask)
    for path in (tmp_path / "m/model.safetensors", tmp_path / "tgi/medusa_lm_head.safetensors"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, path


def test_saving_over_other_weights_files_replaces_the_heads_own_and_refuses_others(
    tiny_llama, tmp_path
):
    """load_heads reads every top-level .safetensors file: heads re-saved in place over the
    shards they were loaded from replace them (the weights now in one file); weights files of
    something else in the folder are refused, before anything is written."""
    _medusa(tiny_llama).save_pretrained(tmp_path / "m")
    weights = load_file(tmp_path / "m/model.safetensors")
    names = sorted(weights)
    (tmp_path / "m/model.safetensors").unlink()
    save_file({k: weights[k] for k in names[:2]}, tmp_path / "m/model-00001-of-00002.safetensors")
    save_file({k: weights[k] for k in names[2:]}, tmp_path / "m/model-00002-of-00002.safetensors")
    (tmp_path / "m/model.safetensors.index.json").write_text("{}")
    load_heads(tmp_path / "m").save_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert sorted(os.listdir(tmp_path / "m")) == ["README.md", "config.json", "model.safetensors"]
    again = load_heads(tmp_path / "m").state_dict()
    assert all(torch.equal(again[k], weights[k].to(again[k].dtype)) for k in names)

    (tmp_path / "other").mkdir()
    save_file({"x": torch.zeros(1)}, tmp_path / "other/medusa_lm_head.safetensors")
    with pytest.raises(
        ValueError, match="holds medusa_lm_head.safetensors, which load_heads would read beside"
    ):
        _medusa(tiny_llama).save_pretrained(tmp_path / "other")
    assert os.listdir(tmp_path / "other") == ["medusa_lm_head.safetensors"]
