"""Exports' `--out` folder: a new, empty or earlier export's folder, whose files are replaced only
once the new export is written; anything else, and the source itself, refused untouched."""

import json
from pathlib import Path

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from heads.export import ExportError, export_heads


@pytest.mark.filterwarnings("ignore:these heads record")
def test_an_export_replaces_an_earlier_one_and_leaves_other_folders_alone(medusa_dir, tmp_path):
    src, _ = medusa_dir
    out = tmp_path / "out"
    export_heads(src, "vllm", out)
    export_heads(src, "tgi", out)  # the vllm export's model.safetensors must not stay beside it
    assert sorted(p.name for p in out.iterdir()) == [
        ".headstart-export",
        "config.json",
        "medusa_lm_head.safetensors",
    ]
    assert json.loads((out / ".headstart-export").read_text()) == {"target": "tgi"}
    export_heads(src, "tgi", out)  # the same command again
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"holds files an export does not write \(notes.txt\)"):
        export_heads(src, "vllm", out)
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()


@pytest.mark.filterwarnings("ignore:these heads record")
def test_a_refused_export_leaves_the_earlier_one_in_place(medusa_dir, tiny_llama, tmp_path):
    """Refusals come before `--out` is touched: an EAGLE draft to tgi, heads over a draft
    vocabulary to trtllm, Medusa to sglang leave the earlier export as it was, and no staging
    folder behind."""
    src, _ = medusa_dir
    out = tmp_path / "exports" / "medusa-tgi"
    export_heads(src, "tgi", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1)).save_pretrained(tmp_path / "e1")
    config = MedusaConfig.from_base(tiny_llama.config, num_heads=2, truncated_vocab_size=128)
    reduced = MedusaHeads(config).init_from_base(tiny_llama, token_map=torch.arange(0, 256, 2))
    reduced.save_pretrained(tmp_path / "reduced")
    for source, target in [
        (tmp_path / "e1", "tgi"),
        (tmp_path / "reduced", "trtllm"),
        (src, "sglang"),
    ]:
        with pytest.raises(ExportError):
            export_heads(source, target, out)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["medusa-tgi"]


@pytest.mark.filterwarnings("ignore:these heads record")
def test_an_export_interrupted_while_moving_in_leaves_the_earlier_one(
    medusa_dir, tmp_path, monkeypatch
):
    """The new files are moved in by renames after the earlier ones are put aside: a rename
    that fails (or a Ctrl-C) there puts the earlier export back, whole."""
    src, _ = medusa_dir
    out = tmp_path / "out"
    export_heads(src, "vllm", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, renames = Path.rename, []

    def second_new_file_fails(self, target):
        if Path(target).parent == out:
            renames.append(self.name)
            if len(renames) == 2:
                raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(Path, "rename", second_new_file_fails)
    with pytest.raises(KeyboardInterrupt):
        export_heads(src, "tgi", out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.filterwarnings("ignore:these heads record")
def test_out_keeps_its_own_folder_its_mode_a_link_and_the_working_directory(
    medusa_dir, tmp_path, monkeypatch
):
    """The export replaces what is in `--out`, not the folder: a link to a folder (an
    exports/current -> v3 alias), `.`, and a folder's own mode stay; a killed export's work
    folder is cleared by the next."""
    src, _ = medusa_dir
    target = tmp_path / "v3"
    target.mkdir()
    target.chmod(0o2750)
    link = tmp_path / "current"
    link.symlink_to(target)
    export_heads(src, "tgi", link)
    export_heads(src, "vllm", link)  # an earlier export replaced through the link
    assert link.is_symlink() and (target / "model.safetensors").is_file()
    assert not (target / "medusa_lm_head.safetensors").exists()
    assert target.stat().st_mode & 0o7777 == 0o2750
    (target / ".headstart-export-work-99-dead").mkdir()  # left by a killed export
    export_heads(src, "tgi", link)
    assert sorted(p.name for p in target.iterdir()) == [
        ".headstart-export",
        "config.json",
        "medusa_lm_head.safetensors",
    ]
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert export_heads(src, "tgi", ".") == Path(".")
    assert (here / "medusa_lm_head.safetensors").is_file()


def test_a_heads_folder_is_not_taken_for_an_earlier_export(medusa_dir, tiny_llama, tmp_path):
    """save_pretrained writes the names a vllm export writes: without the export's mark the
    folder is refused, untouched, instead of replaced."""
    src, _ = medusa_dir
    mine = tmp_path / "my-eagle"
    EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1)).save_pretrained(mine)
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    with pytest.raises(ExportError, match=r"no \.headstart-export, so no export wrote it"):
        export_heads(src, "vllm", mine)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_heads(src, "vllm", empty) == empty and (empty / "model.safetensors").is_file()


def test_the_source_under_another_spelling_is_refused_as_out(medusa_dir, tmp_path, monkeypatch):
    """A relative path or one through '..' to the source folder: the export would clear it."""
    src, _ = medusa_dir
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    monkeypatch.chdir(src.parent)
    for out in (Path(src.name), src / ".." / src.name):
        with pytest.raises(ExportError, match="--out must differ from the source folder"):
            export_heads(src, "trtllm", out)
        assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_an_out_folder_under_folders_not_made_yet(medusa_dir, tmp_path):
    src, _ = medusa_dir
    for target in ("trtllm", "vllm"):
        out = tmp_path / "exports" / target / "heads"
        export_heads(src, target, out)
        assert (out / "config.json").is_file()
