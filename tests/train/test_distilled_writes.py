"""A distill folder's atomic writes, shard numbering and the checks of its records, manifest,
template and base."""

from __future__ import annotations

import json
import os

import pytest

import train.distilled as distilled
from train.distilled import (
    MANIFEST,
    DistillError,
    ShardWriter,
    check_template,
    read_done_ids,
    recorded_manifest,
    write_atomic,
)


def test_write_atomic_syncs_before_the_rename_and_a_crash_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / MANIFEST
    path.write_text("old")
    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append("replace") or replace(a, b))
    write_atomic(path, "new")
    assert calls == ["fsync", "replace"] and path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST]  # no temporary file left

    def power_cut(fd):  # the data never reached the disk: the rename must not happen
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", power_cut)
    with pytest.raises(OSError):
        write_atomic(path, "torn")
    assert path.read_text() == "new"


def test_a_new_shard_never_overwrites_one_written(tmp_path):
    """Shard 1 of rank 0 gone (deleted by hand, or moved away): the next one is numbered after
    the highest, not after the count, which would overwrite shard 2."""
    for i in (0, 2):
        (tmp_path / f"shard-r000-{i:05d}.jsonl").write_text(json.dumps({"id": f"p{i}-0"}) + "\n")
    (tmp_path / "shard-r001-00007.jsonl").write_text(json.dumps({"id": "q-0"}) + "\n")  # rank 1
    writer = ShardWriter(tmp_path, rank=0, records_per_shard=1)
    writer.add({"id": "new-0"})
    assert read_done_ids(tmp_path) == {"p0-0", "p2-0", "q-0", "new-0"}
    assert (tmp_path / "shard-r000-00003.jsonl").is_file()


@pytest.mark.parametrize("line", ["[1, 2]", "null", '"text"'])
def test_a_record_that_is_no_json_object_names_its_shard_and_line(tmp_path, line):
    shard = tmp_path / "shard-r000-00000.jsonl"
    shard.write_text(json.dumps({"id": "a-0"}) + "\n" + line + "\n")
    with pytest.raises(DistillError, match=r"shard-r000-00000\.jsonl:2: unreadable record"):
        read_done_ids(tmp_path)


def test_a_manifest_that_is_no_json_object_is_said_damaged(tmp_path):
    (tmp_path / MANIFEST).write_text("[1, 2]")
    with pytest.raises(DistillError, match=r"manifest.json is damaged \(not a JSON object\)"):
        recorded_manifest(tmp_path)


def test_a_folder_without_answers_takes_another_template(tmp_path):
    """A run killed before its first shard left only a manifest: nothing would mix templates."""
    (tmp_path / MANIFEST).write_text(json.dumps({"chat_template_sha1": "a" * 40}))
    check_template(tmp_path, "b" * 40)  # no DistillError
    (tmp_path / "shard-r000-00000.jsonl").write_text(json.dumps({"id": "p-0"}) + "\n")
    with pytest.raises(DistillError, match="answers written under another chat template"):
        check_template(tmp_path, "b" * 40)


def test_answers_recorded_under_one_spelling_of_the_base_are_that_base(smollm2_tokenizer, tmp_path):
    """The manifest records the base twice (as the recipe named it, and as resolved): naming
    either one is the base the answers came from."""
    from train.config import load_recipe

    manifest = {
        "base_model": "org/base-model",  # as resolved
        "settings": {"base_model": "/data/checkpoints/run-17"},  # as the recipe named it
    }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    for name in ("org/base-model", "/data/checkpoints/run-17"):
        recipe = load_recipe(None, [f"model.name_or_path={name}"])
        notes = distilled.distilled_otherwise(tmp_path, recipe, smollm2_tokenizer)
        assert not [n for n in notes if n.startswith("base ")], name
    other = load_recipe(None, ["model.name_or_path=org/another-model"])
    notes = distilled.distilled_otherwise(tmp_path, other, smollm2_tokenizer)
    assert [n for n in notes if n.startswith("base ")]
