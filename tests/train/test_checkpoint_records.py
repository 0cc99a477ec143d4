"""What a checkpoint records and what resume compares: the newest complete checkpoint, a save
cut short, the process count, the settings that decide the batches, shards rewritten in place,
a loss that is not finite."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from train.checkpoint import (
    STATE_NAME,
    TrainingDiverged,
    base_identity,
    begin_run,
    check_branch,
    check_finite,
    check_same_examples,
    check_same_run,
    complete_checkpoints,
    data_fingerprint,
    latest_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from train.config import RecipeError, load_recipe, recipe_to_dict
from train.features import VOCAB_FILE, save_draft_vocabulary


class FakeAccelerator(SimpleNamespace):
    """What save_checkpoint uses of an Accelerator: one main process that writes a file."""

    def __init__(self, num_processes: int = 1):
        super().__init__(is_main_process=True, num_processes=num_processes)

    def wait_for_everyone(self):
        pass

    def save_state(self, folder: str):
        (Path(folder) / "model.safetensors").write_bytes(b"weights")


def _step(root: Path, step: int, state: bool = True) -> Path:
    path = root / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    if state:
        (path / STATE_NAME).write_text(json.dumps({"step": step}))
    return path


def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    """keep_last_checkpoints keeps several: resume=auto goes on from the newest, not the oldest
    (which would train the steps after it again), and never from a step folder without its
    trainer_state.json."""
    two, four, six = (_step(tmp_path, s) for s in (2, 4, 6))
    assert latest_checkpoint(tmp_path) == six
    assert resolve_resume("auto", tmp_path) == six
    assert complete_checkpoints(tmp_path) == [two, four, six]
    cut = _step(tmp_path, 8, state=False)  # no trainer_state.json: not a checkpoint
    (cut / "model.safetensors").write_bytes(b"half")
    assert complete_checkpoints(tmp_path) == [two, four, six]
    assert latest_checkpoint(tmp_path) == six


def test_a_save_cut_short_after_the_trainer_state_leaves_the_previous_checkpoint_latest(
    tmp_path, monkeypatch
):
    """Killed between the trainer state and the rename (here: while the recipe is written):
    the new checkpoint must not exist under its final name, only as .tmp-step-*."""
    import train.checkpoint as ckpt_module

    recipe = load_recipe(None, [f"output.dir={tmp_path}"])
    accelerator = FakeAccelerator()
    first = save_checkpoint(accelerator, tmp_path, recipe, {"step": 2}, keep_last=2)
    assert latest_checkpoint(tmp_path) == first

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_module, "save_recipe", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(accelerator, tmp_path, recipe, {"step": 4}, keep_last=2)
    assert not (tmp_path / "checkpoints" / "step-00000004").exists()
    assert latest_checkpoint(tmp_path) == first


def test_a_checkpoint_records_its_process_count_and_resume_compares_it_both_ways(tmp_path):
    """save_checkpoint records num_processes; resuming with fewer processes, as with more,
    is refused (the batches would be split otherwise)."""
    recipe = load_recipe(None, [f"output.dir={tmp_path}"])
    path = save_checkpoint(FakeAccelerator(2), tmp_path, recipe, {"step": 2}, keep_last=2)
    state = json.loads((path / STATE_NAME).read_text())
    assert state["num_processes"] == 2 and state["step"] == 2
    check_same_run(path, recipe, processes=2)
    with pytest.raises(RecipeError, match="processes: 2 there, 1 now"):
        check_same_run(path, recipe, processes=1)
    with pytest.raises(RecipeError, match="processes: 2 there, 3 now"):
        check_same_run(path, recipe, processes=3)


@pytest.mark.parametrize(
    "override, named",
    [
        ("training.gradient_accumulation_steps=4", "training.gradient_accumulation_steps: 1"),
        ("training.eval_fraction=0.2", "training.eval_fraction: 0.05"),
        ("training.max_length=512", "training.max_length: 2048"),
        ("training.mode=offline", "training.mode: 'online'"),
        ("training.text_max_tokens=100", "training.text_max_tokens: 0"),
        ("training.seed=1", "training.seed: 0"),
        ("training.init_heads=other/heads", "training.init_heads: None"),
        ("training.text_corpus=[notes]", r"training.text_corpus: \[\]"),
        ("data.chat_template=chat.jinja", "data.chat_template: None"),
    ],
)
def test_every_setting_that_decides_the_batches_or_the_start_is_fixed_on_resume(
    tmp_path, override, named
):
    ckpt = tmp_path / "step-00000004"
    ckpt.mkdir()
    recipe = load_recipe(None, [])
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 4, "num_processes": 1}))
    (ckpt / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe)))
    check_same_run(ckpt, recipe, processes=1)
    with pytest.raises(RecipeError, match=rf"{named} there, .* now.*resume=never"):
        check_same_run(ckpt, load_recipe(None, [override]), processes=1)


def test_a_shard_rewritten_with_other_answers_is_not_the_data_it_trained_on(tmp_path):
    """The same shard names with other sizes (a shard regenerated in place) are other data."""
    data = tmp_path / "distill"
    data.mkdir()
    (data / "shard-r000-00000.jsonl").write_text("x" * 10)
    recipe = load_recipe(None, [f"data.output_dir={data}"])
    ckpt = tmp_path / "step-00000004"
    ckpt.mkdir()
    state = {"step": 4, "num_processes": 1, "data": data_fingerprint(data)}
    (ckpt / STATE_NAME).write_text(json.dumps(state))
    check_same_run(ckpt, recipe, processes=1)
    (data / "shard-r000-00000.jsonl").write_text("y" * 25)
    with pytest.raises(RecipeError, match="are not those it trained on"):
        check_same_run(ckpt, recipe, processes=1)


def test_checkpoints_from_before_the_examples_were_recorded_resume(tmp_path):
    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 2}))  # an earlier headstart's
    check_same_examples(ckpt, "0123456789abcdef")
    check_same_examples(None, "0123456789abcdef")  # a fresh run
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 2, "examples": "fedcba9876543210"}))
    check_same_examples(ckpt, "fedcba9876543210")
    with pytest.raises(RecipeError, match="trained on other examples than those loaded now"):
        check_same_examples(ckpt, "0123456789abcdef")


def test_a_fresh_run_is_not_warned_about_an_older_held_out_split(tiny_llama, capsys):
    from train.checkpoint import base_identity

    identity = base_identity(tiny_llama, None)
    assert identity["base_dtype"] == "float32" and len(identity["base_weights"]) == 16
    assert "held-out answers another way" not in capsys.readouterr().err


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_an_infinite_loss_stops_training_as_a_nan_does(tmp_path, loss):
    from train.checkpoint import TrainingDiverged, check_finite

    check_finite(1.5, 3, tmp_path)  # finite: goes on
    with pytest.raises(TrainingDiverged, match=rf"loss is {loss} at step 3; training stopped"):
        check_finite(loss, 3, tmp_path)


def test_gradients_are_checked_where_no_grad_scaler_skips_their_step(tmp_path):
    """A non-finite norm stops the run, but under fp16, whose grad scaler skips that step
    itself; no norm (DeepSpeed before its first step) is no check."""
    from types import SimpleNamespace

    from train.checkpoint import TrainingDiverged
    from train.config import load_recipe
    from train.steps import clip_gradients

    recipe = load_recipe(None, [f"output.dir={tmp_path}"])
    norms = {"bf16": float("nan"), "no": float("inf")}
    for precision, norm in norms.items():
        fake = SimpleNamespace(clip_grad_norm_=lambda p, m, n=norm: torch.tensor(n))
        fake.mixed_precision = precision
        with pytest.raises(TrainingDiverged, match=rf"the gradients' norm is {norm} at step 3"):
            clip_gradients(fake, torch.nn.Linear(1, 1), recipe, 3)
    for precision, norm in [("fp16", torch.tensor(float("inf"))), ("bf16", None), ("no", 2.5)]:
        fake = SimpleNamespace(clip_grad_norm_=lambda p, m, n=norm: n, mixed_precision=precision)
        clip_gradients(fake, torch.nn.Linear(1, 1), recipe, 3)


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_fresh_run_removes_the_earlier_runs_checkpoints_a_killed_save_and_vocabulary(
    tmp_path, capsys
):
    out = tmp_path / "out"
    for step in (2, 4):
        _step(out, step)
    killed = out / "checkpoints" / ".tmp-step-00000006"  # a save cut short by a kill
    killed.mkdir()
    save_draft_vocabulary(out, torch.tensor([3, 9]))  # the earlier run's, of its data
    recipe = load_recipe(None, [f"output.dir={out}"])

    begin_run(recipe, None, FakeAccelerator(), vocab=torch.tensor([5, 6, 7]))

    assert _names(out / "checkpoints") == []
    assert load_file(out / VOCAB_FILE)["token_ids"].tolist() == [5, 6, 7]  # this run's
    printed = capsys.readouterr().out
    assert "removed the earlier run's 3 checkpoint(s) and draft_vocab.safetensors" in printed


def test_resuming_an_earlier_checkpoint_removes_the_later_ones_and_keeps_the_vocabulary(
    tmp_path, capsys
):
    out = tmp_path / "out"
    two = _step(out, 2)
    for step in (4, 6):
        _step(out, step)
    save_draft_vocabulary(out, torch.tensor([3, 9]))
    recipe = load_recipe(None, [f"output.dir={out}"])

    begin_run(recipe, two, FakeAccelerator(), vocab=torch.tensor([3, 9]))

    assert _names(out / "checkpoints") == ["step-00000002"]
    assert load_file(out / VOCAB_FILE)["token_ids"].tolist() == [3, 9]
    assert "resuming from step-00000002: removed the 2 later checkpoint(s)" in (
        capsys.readouterr().out
    )


def test_another_folders_checkpoint_is_refused_where_this_output_holds_checkpoints(tmp_path):
    """training.resume=PATH of another run's checkpoint: this output's checkpoints are not a
    continuation of it; mixed with its own, rotation would remove the new run's (the others'
    later steps sort after them) and resume=auto would take the others'."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    for step in (4, 6):
        _step(out, step)
    other = _step(elsewhere, 2)
    with pytest.raises(
        RecipeError,
        match=r"another folder's checkpoint, and output.dir=.*out holds "
        r"checkpoints already \(latest step-00000006\): training.resume=auto goes on",
    ):
        check_branch(other, out)
    check_branch(out / "checkpoints" / "step-00000004", out)  # its own: resumed as before
    check_branch(other, tmp_path / "new")


def test_going_on_from_another_folders_checkpoint_starts_this_folder_from_it(tmp_path, capsys):
    """The new folder takes the vocabulary read with the checkpoint (not a leftover one), the
    metrics of the run that wrote it, and no half-written save of an earlier kill."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    other = _step(elsewhere, 2)
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    (elsewhere / "metrics.jsonl").write_text("".join(lines))
    (out / "checkpoints" / ".tmp-step-00000006").mkdir(parents=True)  # a kill mid-save
    save_draft_vocabulary(out, torch.tensor([3, 9]))  # an earlier run's, of other data
    (out / "metrics.jsonl").write_text(json.dumps({"step": 9, "loss": 0.5}) + "\n")
    recipe = load_recipe(None, [f"output.dir={out}"])

    begin_run(recipe, other, FakeAccelerator(), vocab=torch.tensor([5, 6]))

    assert _names(out / "checkpoints") == []
    assert load_file(out / VOCAB_FILE)["token_ids"].tolist() == [5, 6]
    assert (out / "metrics.jsonl").read_text() == "".join(lines)  # MetricsLog cuts past step 2
    assert f"going on from {other} in {out}: removed the earlier run's 1 checkpoint(s) and " in (
        capsys.readouterr().out
    )


def test_a_resumed_run_removes_a_save_that_a_kill_cut_short(tmp_path):
    """Its step may never be saved again (another save_every_steps, or the run ends first)."""
    out = tmp_path / "out"
    four = _step(out, 4)
    (out / "checkpoints" / ".tmp-step-00000006").mkdir()
    begin_run(load_recipe(None, [f"output.dir={out}"]), four, FakeAccelerator())
    assert _names(out / "checkpoints") == ["step-00000004"]


def test_a_run_keeps_its_last_keep_last_checkpoints(tmp_path):
    recipe = load_recipe(None, [f"output.dir={tmp_path}"])
    for step in (1, 2, 3, 4):
        save_checkpoint(FakeAccelerator(), tmp_path, recipe, {"step": step}, keep_last=2)
    assert _names(tmp_path / "checkpoints") == ["step-00000003", "step-00000004"]


def test_a_nan_right_after_a_checkpoint_also_names_the_one_before(tmp_path):
    """The last checkpoint holds the weights the diverged step started from: the one before it
    is named too (or a fresh start, when it is the only one)."""
    for step in (2, 4, 6):
        _step(tmp_path, step)
    ckpts = tmp_path / "checkpoints"
    with pytest.raises(TrainingDiverged) as stopped:
        check_finite(float("nan"), 7, tmp_path)
    said = str(stopped.value)
    assert f"goes on from the last checkpoint, {ckpts / 'step-00000006'}" in said
    assert f"rerun with training.resume={ckpts / 'step-00000004'}, the one before" in said

    with pytest.raises(TrainingDiverged) as stopped:  # steps 7-8 ran from step 6's weights
        check_finite(float("nan"), 9, tmp_path)
    assert "started from" not in str(stopped.value)

    (ckpts / "step-00000002" / STATE_NAME).unlink()  # two checkpoints: 4 and 6
    with pytest.raises(TrainingDiverged, match=r"resume=\S*step-00000004, the one before"):
        check_finite(float("nan"), 7, tmp_path)
    (ckpts / "step-00000004" / STATE_NAME).unlink()  # step 6 is the only one
    with pytest.raises(TrainingDiverged, match="rerun with training.resume=never, afresh"):
        check_finite(float("nan"), 7, tmp_path)


def test_other_weights_of_a_checkpoint_without_a_dtype_are_said_as_other_weights(
    tiny_llama, tmp_path
):
    """A checkpoint from before the base's dtype was recorded: the fingerprints still tell
    other weights apart, and the error says so rather than blame a dtype of None."""
    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 2, "base_weights": "0123456789abcdef"}))
    with pytest.raises(RecipeError, match="other weights of the base than those loaded now"):
        base_identity(tiny_llama, ckpt)
