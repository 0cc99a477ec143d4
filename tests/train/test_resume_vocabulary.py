"""Resumed runs and their draft vocabulary: read back from the run that wrote the checkpoint, written
whole, refused when damaged or of another size."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

import heads.checkpoint
import train.eagle
import train.medusa
from tests.train.conftest import MEDUSA_RUN, TINY_EAGLE, TINY_MEDUSA, run
from tests.train.test_resume import THREE_A_EPOCH, assert_same_run, interrupted_run
from train.features import VOCAB_FILE, draft_vocabulary, save_draft_vocabulary


@pytest.mark.slow
def test_a_medusa_run_goes_on_from_another_folders_checkpoint_as_it_would_have(
    tiny_task, tmp_path, capsys
):
    """training.resume=PATH of another folder: the new folder's run takes the draft vocabulary
    of the run that wrote the checkpoint, not one left in the new folder by an earlier run (with
    which every target fell outside the heads' vocabulary and the run learned nothing)."""
    settings = [*MEDUSA_RUN, "heads.draft_vocab_size=8"]
    reference, first, branch = tmp_path / "reference", tmp_path / "first", tmp_path / "branch"
    run(train.medusa, TINY_MEDUSA, tiny_task, reference, *settings)
    interrupted_run(train.medusa, TINY_MEDUSA, tiny_task, first, 12, *settings)
    save_draft_vocabulary(branch, torch.arange(200, 208))  # an earlier run's, of other data
    capsys.readouterr()
    resume = f"training.resume={first / 'checkpoints' / 'step-00000010'}"
    run(train.medusa, TINY_MEDUSA, tiny_task, branch, *settings, resume)
    assert "removed the earlier run's draft_vocab.safetensors" in capsys.readouterr().out
    assert_same_run(branch, reference, 12)  # its metrics.jsonl begins with the first run's
    assert torch.equal(
        load_file(branch / VOCAB_FILE)["token_ids"], load_file(first / VOCAB_FILE)["token_ids"]
    )


@pytest.mark.slow
def test_eagle3_resume_reuses_the_draft_vocabulary(tiny_task, tmp_path, monkeypatch):
    """A 3-step unroll, interrupted after its checkpoint at step 2; the resumed run must not
    rebuild the draft vocabulary (d2t / t2d) from the data."""
    reference, out = tmp_path / "reference", tmp_path / "out"
    run(train.eagle, TINY_EAGLE, tiny_task, reference)
    interrupted_run(train.eagle, TINY_EAGLE, tiny_task, out, 4)
    assert (out / "draft_vocab.safetensors").is_file()

    def rebuild(*args):
        raise AssertionError("the draft vocabulary was rebuilt on resume")

    monkeypatch.setattr("train.features.frequent_tokens", rebuild)
    run(train.eagle, TINY_EAGLE, tiny_task, out)
    assert_same_run(out, reference, 4)


def test_the_draft_vocabulary_is_written_whole_read_on_resume_and_a_damaged_one_named(tmp_path):
    from train.features import draft_vocabulary, save_draft_vocabulary

    examples = [{"input_ids": [5, 6, 6, 7, 7, 7], "loss_mask": [0, 1, 1, 1, 1, 1]}]
    ids = draft_vocabulary(examples, 2, 16)
    assert ids.tolist() == [6, 7] and list(tmp_path.iterdir()) == []  # written at begin_run
    save_draft_vocabulary(tmp_path, torch.tensor([3, 9]))  # an earlier run's, of other data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft_vocab.safetensors"]  # no tmp
    assert draft_vocabulary([], 2, 16, kept=tmp_path).tolist() == [3, 9]  # read back
    assert draft_vocabulary(examples, 2, 16).tolist() == [6, 7]
    path = tmp_path / "draft_vocab.safetensors"
    path.write_bytes(path.read_bytes()[:20])  # as a kill mid-write left it before
    with pytest.raises(ValueError, match="draft_vocab.safetensors cannot be read.*delete it"):
        draft_vocabulary(examples, 2, 16, kept=tmp_path)


def test_a_resumed_run_refuses_a_draft_vocabulary_of_another_size(tmp_path):
    examples = [{"input_ids": [5, 6, 6, 7, 7, 7], "loss_mask": [0, 1, 1, 1, 1, 1]}]
    save_draft_vocabulary(tmp_path, torch.tensor([3, 9]))
    with pytest.raises(
        ValueError, match="holds 2 tokens but the recipe asks for 3; use a new output.dir"
    ):
        draft_vocabulary(examples, 3, 16, kept=tmp_path)


def test_a_vocabulary_write_killed_midway_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    save_draft_vocabulary(tmp_path, torch.tensor([3, 9]))
    real = safetensors.torch.save_file

    def killed_mid_write(tensors, path, metadata=None):
        real(tensors, path, metadata)
        with open(path, "r+b") as f:
            f.truncate(20)  # only part of it reached the disk
        raise KeyboardInterrupt

    monkeypatch.setattr(heads.checkpoint, "save_file", killed_mid_write)  # write_safetensors
    with pytest.raises(KeyboardInterrupt):
        save_draft_vocabulary(tmp_path, torch.tensor([4, 8]))
    monkeypatch.undo()
    assert draft_vocabulary([], 2, 16, kept=tmp_path).tolist() == [3, 9]
    save_draft_vocabulary(tmp_path, torch.tensor([4, 8]))  # the rerun writes it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [VOCAB_FILE]
    assert draft_vocabulary([], 2, 16, kept=tmp_path).tolist() == [4, 8]


def test_a_resumed_medusa_run_reads_its_draft_vocabulary(tiny_task, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *THREE_A_EPOCH, "training.max_steps=2")
    vocab = load_file(out / "draft_vocab.safetensors")["token_ids"]

    def rebuild(*args):
        raise AssertionError("the draft vocabulary was rebuilt on resume")

    monkeypatch.setattr("train.features.frequent_tokens", rebuild)
    capsys.readouterr()
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *THREE_A_EPOCH, "training.max_steps=3")
    assert "at step 2" in capsys.readouterr().out
    assert torch.equal(load_file(out / "draft_vocab.safetensors")["token_ids"], vocab)
