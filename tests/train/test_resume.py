"""Resume, as a kill leaves a run: the same losses after it, a checkpoint half written, a fresh
start over an earlier run's output, a finished run run again (the tiny recipes of conftest.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

import train.eagle
import train.medusa
from tests.train.conftest import MEDUSA_RUN, TINY_EAGLE, TINY_MEDUSA, load_tiny_base, run
from tests.train.test_recipes import heads_tensors, read_metrics
from train.config import load_recipe


class Interrupted(Exception):
    """Stands for a kill in the middle of a run."""


def interrupted_run(module, recipe: Path, task, out: Path, kill_at_step: int, *overrides: str):
    """Run a recipe and stop it as a kill would, as soon as step `kill_at_step` has run."""
    real = module.check_finite

    def check_then_kill(loss, step, output_dir):
        real(loss, step, output_dir)
        if step == kill_at_step:
            raise Interrupted(step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "check_finite", check_then_kill)
        with pytest.raises(Interrupted):
            run(module, recipe, task, out, *overrides)


def assert_same_run(out: Path, reference: Path, steps: int) -> None:
    """Same losses at every step (training and held-out) and the same final heads."""
    got, want = read_metrics(out), read_metrics(reference)
    assert sorted(got[0]) == list(range(1, steps + 1))
    for (got_lines, want_lines), key in zip(zip(got, want), ("loss", "eval/loss")):
        assert sorted(got_lines) == sorted(want_lines)
        for step in want_lines:
            assert got_lines[step][key] == pytest.approx(want_lines[step][key], abs=1e-6), step
    got_heads, want_heads = heads_tensors(out), heads_tensors(reference)
    assert got_heads.keys() == want_heads.keys()
    for name in want_heads:
        torch.testing.assert_close(got_heads[name], want_heads[name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_medusa_resume_continues_with_the_same_losses(medusa_run, tiny_task, tmp_path, capsys):
    reference, _, _ = medusa_run
    out = tmp_path / "out"
    # Killed during step 12: the last checkpoint is step 10 (epoch 1, batch 1) and step 11 is
    # already in metrics.jsonl; the rerun (resume: auto) continues from step 10.
    interrupted_run(train.medusa, TINY_MEDUSA, tiny_task, out, 12, *MEDUSA_RUN)
    assert (out / "checkpoints" / "step-00000010").is_dir() and not (out / "heads").exists()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 12, "loss": 0.')  # a line torn by the kill
    capsys.readouterr()
    # Resumed with another batch order or other heads, it would not continue that run: refused
    # before any work, naming the difference, and the checkpoint is kept.
    with pytest.raises(SystemExit) as exit_info:
        run(
            train.medusa,
            TINY_MEDUSA,
            tiny_task,
            out,
            *MEDUSA_RUN,
            "training.seed=1",
            "heads.num_heads=3",
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "(heads.num_heads: 2 there, 3 now; training.seed: 0 there, 1 now)" in err
    assert "training.resume=never" in err
    assert (out / "checkpoints" / "step-00000010").is_dir() and not (out / "heads").exists()
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *MEDUSA_RUN)
    assert "at step 10" in capsys.readouterr().out
    assert_same_run(out, reference, 12)  # reads every line of metrics.jsonl as JSON


@pytest.mark.slow
def test_a_kill_mid_save_resumes_from_the_checkpoint_before(tiny_task, tmp_path, monkeypatch):
    """Killed while accelerate writes the step-4 checkpoint: the half-written folder is not taken
    for a checkpoint, the rerun continues from step 2 as if nothing happened, and clears it."""
    import accelerate

    reference, out = tmp_path / "reference", tmp_path / "out"
    run(train.eagle, TINY_EAGLE, tiny_task, reference)
    real = accelerate.Accelerator.save_state

    def save_then_kill(self, output_dir=None, **kwargs):
        written = real(self, output_dir, **kwargs)
        if Path(output_dir).name.endswith("step-00000004"):
            (Path(output_dir) / "optimizer.bin").unlink()  # only part of it reached the disk
            raise Interrupted(output_dir)
        return written

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(accelerate.Accelerator, "save_state", save_then_kill)
        with pytest.raises(Interrupted):
            run(train.eagle, TINY_EAGLE, tiny_task, out)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp-step-00000004", "step-00000002"]
    assert not (out / "heads").exists()
    run(train.eagle, TINY_EAGLE, tiny_task, out)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004"]
    assert_same_run(out, reference, 4)


@pytest.mark.slow
def test_resume_refuses_examples_the_run_did_not_load(tiny_task, tmp_path, capsys):
    """Answers distill added while the run trained, and a text corpus edited since: resumed, the
    run would reshuffle over other examples, training some twice and skipping others."""
    data = tmp_path / "data"
    data.mkdir()
    lines = next(tiny_task.data_dir.glob("*.jsonl")).read_text().splitlines(keepends=True)
    (data / "shard-r000-00000.jsonl").write_text("".join(lines[:30]))
    out = tmp_path / "out"
    folder = [f"data.output_dir={data}", "training.save_every_steps=1"]
    real = train.medusa.check_finite

    def distill_adds_a_shard(loss, step, output_dir):
        real(loss, step, output_dir)
        if step == 1:
            (data / "shard-r000-00001.jsonl").write_text("".join(lines[30:]))
        if step == 3:
            raise Interrupted(step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train.medusa, "check_finite", distill_adds_a_shard)
        with pytest.raises(Interrupted):
            run(train.medusa, TINY_MEDUSA, tiny_task, out, *folder)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # the checkpoint of step 2 names the 30 answers
        run(train.medusa, TINY_MEDUSA, tiny_task, out, *folder)
    assert exit_info.value.code == 2
    assert "are not those it trained on" in capsys.readouterr().err

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(f"word{i}" for i in range(300)), encoding="utf-8")
    settings = [f"training.text_corpus=[{corpus}]", "training.save_every_steps=1"]
    out = tmp_path / "out2"
    interrupted_run(train.medusa, TINY_MEDUSA, tiny_task, out, 3, *settings)
    (corpus / "b.txt").write_text(" ".join(f"term{i}" for i in range(300)), encoding="utf-8")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(train.medusa, TINY_MEDUSA, tiny_task, out, *settings)
    assert exit_info.value.code == 2
    assert "trained on other examples than those loaded now" in capsys.readouterr().err
    (corpus / "b.txt").unlink()  # the corpus as it trained on: the run continues
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *settings)
    assert sorted(read_metrics(out)[0]) == [1, 2, 3, 4]


@pytest.mark.slow
def test_starting_afresh_over_an_earlier_run_removes_its_checkpoints_and_vocabulary(
    tiny_task, tmp_path, capsys
):
    """resume=never over a finished run: its step-2 / step-4 checkpoints would outlast the new
    run's own (keep_last 2) and be resumed after a kill; its draft vocabulary came from its
    data. Both go; the new run keeps only its own."""
    out = tmp_path / "out"
    run(train.eagle, TINY_EAGLE, tiny_task, out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]
    capsys.readouterr()
    run(
        train.eagle,
        TINY_EAGLE,
        tiny_task,
        out,
        "training.resume=never",
        "training.max_steps=3",
        "training.save_every_steps=3",
        "heads.draft_vocab_size=128",
    )
    printed = capsys.readouterr().out
    assert "removed the earlier run's 2 checkpoint(s) and draft_vocab.safetensors" in printed
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    assert load_file(out / "draft_vocab.safetensors")["token_ids"].numel() == 128
    assert sorted(read_metrics(out)[0]) == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad",
    [
        ["training.init_heads=no/such/heads"],  # found once the base and data are loaded
        ["heads.draft_vocab_size=100000"],  # past the base's 256 tokens
        # stopped (a Ctrl-C) after the heads and their vocabulary of 64 are built
        ["heads.draft_vocab_size=64", "stop in make_optimizer"],
    ],
)
def test_a_fresh_run_refused_for_bad_input_leaves_the_earlier_run(
    tiny_task, tmp_path, capsys, monkeypatch, bad
):
    """resume=never removes the earlier run's checkpoints and draft vocabulary only once every
    input has loaded: a run refused on the way (exit 2), or stopped before it begins, leaves
    both, and the earlier run resumes as before."""
    out, vocab = tmp_path / "out", tmp_path / "out" / "draft_vocab.safetensors"
    earlier = ["training.max_steps=2", "heads.draft_vocab_size=128"]
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *earlier)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert before == ["step-00000002"]
    vocab_before = vocab.read_bytes()
    if "stop in make_optimizer" in bad:

        def stop(*args):
            raise KeyboardInterrupt

        with monkeypatch.context() as mp, pytest.raises(SystemExit) as exit_info:
            mp.setattr(train.medusa, "make_optimizer", stop)
            run(train.medusa, TINY_MEDUSA, tiny_task, out, "training.resume=never", bad[0])
        assert exit_info.value.code == 130  # as a Ctrl-C ends a run
    else:
        with pytest.raises(SystemExit) as exit_info:
            run(train.medusa, TINY_MEDUSA, tiny_task, out, "training.resume=never", *bad)
        assert exit_info.value.code == 2
    assert "removed the earlier run" not in capsys.readouterr().out
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert vocab.read_bytes() == vocab_before
    run(train.medusa, TINY_MEDUSA, tiny_task, out, "training.max_steps=4", earlier[1])
    assert "resumed" in capsys.readouterr().out
    assert sorted(read_metrics(out)[0]) == [1, 2, 3, 4]


@pytest.mark.slow
def test_resuming_an_earlier_checkpoint_replaces_the_later_ones(tiny_task, tmp_path, capsys):
    """training.resume=PATH of step 2 of a finished 4-step run: the run goes on from step 2, the
    checkpoints of steps 3-4 it replaces go (a kill would otherwise resume them), and it ends
    as the uninterrupted run did."""
    reference, out = tmp_path / "reference", tmp_path / "out"
    keep = ["training.save_every_steps=1", "training.keep_last_checkpoints=4"]
    run(train.medusa, TINY_MEDUSA, tiny_task, reference, *keep)
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *keep)
    capsys.readouterr()
    earlier = out / "checkpoints" / "step-00000002"
    real = train.medusa.check_finite

    def kill_at_3(loss, step, output_dir):
        real(loss, step, output_dir)
        if step == 3:
            raise Interrupted(step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train.medusa, "check_finite", kill_at_3)
        with pytest.raises(Interrupted):
            run(train.medusa, TINY_MEDUSA, tiny_task, out, *keep, f"training.resume={earlier}")
    assert "removed the 2 later checkpoint(s)" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000001",
        "step-00000002",
    ]
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *keep)  # resume=auto: from step 2 again
    assert_same_run(out, reference, 4)


def test_eagle1_feature_noise_differs_per_micro_batch_and_repeats_on_resume(tiny_task, tmp_path):
    """Each micro-batch of a step (accumulation) draws its own noise; a fresh trainee at the
    same step draws the same again (what a resumed run does)."""
    from heads import EagleConfig, EagleDraft
    from train.data import build_examples, load_distilled
    from train.features import ExampleDataset, collate

    recipe = load_recipe(
        TINY_EAGLE, [*tiny_task.overrides(tmp_path), "heads.version=1", "heads.feature_noise=0.5"]
    )
    base = load_tiny_base(tiny_task)
    tokenizer = AutoTokenizer.from_pretrained(tiny_task.base_dir)
    examples = build_examples(load_distilled(tiny_task.data_dir)[:2], tokenizer, max_length=256)
    batch = collate(ExampleDataset(examples), [0, 1], tokenizer.pad_token_id, "cpu")

    def losses() -> list[float]:
        torch.manual_seed(0)
        draft = EagleDraft(EagleConfig.from_base(base.config, version=1))
        trainee = train.eagle.EagleTrainee(base, draft, recipe).train()
        with torch.no_grad():
            return [float(trainee(batch, step)[0]) for step in (3, 3, 4)]

    first = losses()
    assert len(set(first)) == 3  # two micro-batches of step 3, one of step 4: three draws
    assert losses() == first
    recipe = load_recipe(
        TINY_EAGLE,
        [*tiny_task.overrides(tmp_path), "heads.version=1", "training.seed=300000"],
    )
    assert all(math.isfinite(x) for x in losses())  # a large seed still seeds the noise


@pytest.mark.slow
def test_a_finished_run_run_again_trains_nothing_and_writes_its_heads(tiny_task, tmp_path, capsys):
    """What `make demo` does on a rerun: resume=auto finds the final checkpoint."""
    out = tmp_path / "out"
    run(train.eagle, TINY_EAGLE, tiny_task, out)
    metrics = (out / "metrics.jsonl").read_text()
    weights = (out / "heads" / "model.safetensors").read_bytes()
    (out / "heads" / "model.safetensors").unlink()
    capsys.readouterr()
    run(train.eagle, TINY_EAGLE, tiny_task, out)
    said = capsys.readouterr().out
    assert "at step 4" in said and "past this recipe" not in said
    assert (out / "metrics.jsonl").read_text() == metrics
    assert (out / "heads" / "model.safetensors").read_bytes() == weights
    # asked for fewer steps than the run has taken: refused, the run left as it is
    with pytest.raises(SystemExit) as exit_:
        run(train.eagle, TINY_EAGLE, tiny_task, out, "training.max_steps=2")
    assert exit_.value.code == 2
    said = capsys.readouterr().err
    assert f"the run in {out} is at step 4 (step-00000004), past this recipe's 2 steps" in said
    assert "training.resume=never to replace this one (its checkpoints are removed)" in said
    assert (out / "heads" / "model.safetensors").read_bytes() == weights
    assert (out / "metrics.jsonl").read_text() == metrics


@pytest.mark.slow
def test_resume_refuses_other_weights_of_the_base_and_says_an_older_split(
    tiny_task, tmp_path, capsys
):
    """The base re-saved with other weights under its old name: the checkpoint trained on the
    former ones, so resuming is refused naming both fingerprints. A checkpoint from before the
    held-out split was recorded resumes, saying its held-out figures read high."""
    import json
    import shutil

    from safetensors.torch import save_file

    base_dir, out = tmp_path / tiny_task.base_dir.name, tmp_path / "out"
    shutil.copytree(tiny_task.base_dir, base_dir)
    uses_copy = f"model.name_or_path={base_dir}"
    interrupted_run(train.eagle, TINY_EAGLE, tiny_task, out, 3, uses_copy)
    ckpt = out / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["held_out_split"] == "prompt-hash-2" and len(state["base_weights"]) == 16
    assert state["base_dtype"] == "float32"  # the recipe's: a resumed auto run loads it so

    weights = load_file(base_dir / "model.safetensors")
    original = {k: v.clone() for k, v in weights.items()}
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5  # fine-tuned in place
    save_file(weights, base_dir / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(train.eagle, TINY_EAGLE, tiny_task, out, uses_copy)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "other weights of the base" in err and state["base_weights"] in err
    assert "training.resume=never" in err and ckpt.is_dir()

    save_file(original, base_dir / "model.safetensors", metadata={"format": "pt"})
    del state["held_out_split"]  # as an earlier headstart wrote it
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    run(train.eagle, TINY_EAGLE, tiny_task, out, uses_copy)
    captured = capsys.readouterr()
    assert "at step 2" in captured.out
    assert "chose its held-out answers another way" in captured.err
    assert (out / "heads" / "config.json").is_file()


@pytest.mark.slow
def test_a_resumed_run_takes_the_recipes_learning_rate_on_its_stretched_schedule(
    tiny_task, tmp_path, capsys
):
    """A finished 4-step run given 6 steps and another learning rate: its steps 5 and 6 run at
    the rates a 6-step run of that rate has there (the optimizer's saved state brought back the
    old rate, and the old schedule's end value, 0, for step 5)."""
    out, reference = tmp_path / "out", tmp_path / "reference"
    run(train.medusa, TINY_MEDUSA, tiny_task, out)
    longer = ("training.max_steps=6", "training.learning_rate=0.01")
    capsys.readouterr()
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *longer)
    said = capsys.readouterr().out  # the changes are said as the run resumes
    assert "changed since: training.max_steps: 4 there, 6 now; training.learning_rate: 0." in said
    run(train.medusa, TINY_MEDUSA, tiny_task, reference, *longer)
    got, want = read_metrics(out)[0], read_metrics(reference)[0]
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got[5]["lr"] > 0
    for step in (5, 6):
        assert got[step]["lr"] == pytest.approx(want[step]["lr"], rel=1e-9), step


THREE_A_EPOCH = ["training.micro_batch_size=12"]  # 36 training examples: 3 steps an epoch


def test_eagle_resumed_mid_epoch_goes_on_into_the_next_epoch_as_before(tiny_task, tmp_path):
    """Killed during step 3: the run resumes at step 2 (batch 2 of epoch 0), ends epoch 0 and
    takes epoch 1 from its first batch, with the uninterrupted run's losses; the checkpoint at an
    epoch's end resumes at the next epoch's start."""
    settings = [
        *THREE_A_EPOCH,
        "heads.ttt_steps=1",
        "training.max_steps=5",
        "training.save_every_steps=1",
        "training.keep_last_checkpoints=5",
    ]
    reference, out = tmp_path / "reference", tmp_path / "out"
    run(train.eagle, TINY_EAGLE, tiny_task, reference, *settings)
    states = [
        json.loads(
            (reference / "checkpoints" / f"step-0000000{s}" / "trainer_state.json").read_text()
        )
        for s in (2, 3, 4)
    ]
    assert [(s["step"], s["epoch"], s["batch_in_epoch"]) for s in states] == [
        (2, 0, 2),
        (3, 1, 0),
        (4, 1, 1),
    ]
    interrupted_run(train.eagle, TINY_EAGLE, tiny_task, out, 3, *settings)
    run(train.eagle, TINY_EAGLE, tiny_task, out, *settings)
    assert_same_run(out, reference, 5)
