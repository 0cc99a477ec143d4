"""What a checkpoint records and what resume compares: the newest complete checkpoint, a save
cut short, the process count, the settings that decide the batches, shards rewritten in place,
a loss that is not finite."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from train.checkpoint import (
    STATE_NAME,
    check_same_examples,
    check_same_run,
    complete_checkpoints,
    data_fingerprint,
    latest_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from train.config import RecipeError, load_recipe, recipe_to_dict


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
    ],
)
def test_every_setting_that_decides_the_batches_is_fixed_on_resume(tmp_path, override, named):
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
