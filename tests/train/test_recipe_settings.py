"""What the recipes, train/medusa.py and train/eagle.py, build and log from their settings, on
the tiny task of conftest.py: the draft each builds (aux layers, notes, init from the base, a
draft vocabulary), Medusa-2's learning rates, the held-out score and checkpoint at an epoch's
end, a step's logged loss under gradient accumulation, and the prompts the heads record. Runs
take 12 examples a micro-batch: 3 optimizer steps an epoch."""

from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoTokenizer

import train.eagle
import train.medusa
from heads import load_heads
from tests.train.conftest import SYSTEM_PROMPT, TINY_EAGLE, TINY_MEDUSA, load_tiny_base, run
from tests.train.test_recipes import read_metrics
from train.config import load_recipe
from train.outputs import record_training_setup
from train.steps import make_optimizer

THREE_A_EPOCH = ["training.micro_batch_size=12"]  # 36 training examples: 3 steps an epoch


ANSWERS = SimpleNamespace(examples=[{"input_ids": list(range(400)), "loss_mask": [1] * 400}])


def _build_draft(task, out, *overrides: str):
    recipe = load_recipe(TINY_EAGLE, [*task.overrides(out), *overrides])
    base = load_tiny_base(task)
    draft, vocab = train.eagle.build_draft(recipe, base, ANSWERS, Accelerator(cpu=True), ckpt=None)
    return base, draft, vocab


def test_eagle3_draft_reads_the_recipes_aux_layers(tiny_task, tmp_path):
    _, draft, _ = _build_draft(tiny_task, tmp_path, "heads.aux_layer_ids=[0,0,1]")
    assert list(draft.config.aux_layer_ids) == [0, 0, 1]
    _, default, _ = _build_draft(tiny_task, tmp_path)
    assert list(default.config.aux_layer_ids) != [0, 0, 1]


def test_only_settings_of_the_other_eagle_version_are_noted(tiny_task, tmp_path, capsys):
    _build_draft(tiny_task, tmp_path)  # the tiny EAGLE-3 recipe sets none of EAGLE-1's
    assert "note:" not in capsys.readouterr().out
    _build_draft(tiny_task, tmp_path, "heads.version=1")
    printed = capsys.readouterr().out
    assert "note: heads.draft_vocab_size=256, heads.ttt_steps=3: EAGLE-3's, unused" in printed


def test_eagle3_init_from_base_gathers_the_tensors_it_reads(tiny_task, tmp_path, monkeypatch):
    """Under ZeRO-3 each process holds a shard: the base's last layer, final norm and lm_head
    are gathered around the copy (a layer left out would be copied as an empty shard)."""
    gathered = []

    def gather(*params):
        gathered.extend(params)
        return nullcontext()

    monkeypatch.setattr(train.eagle, "gather_for_reading", gather)
    base, _, _ = _build_draft(tiny_task, tmp_path)
    read = [base.model.layers[-1], base.model.norm, base.lm_head]
    assert {id(p) for p in gathered} == {id(p) for m in read for p in m.parameters()}


def test_an_eagle3_draft_whose_d2t_is_not_one_to_one_is_refused(tiny_task, tmp_path, capsys):
    _, draft, _ = _build_draft(tiny_task, tmp_path / "a", "heads.init_from_base=false")
    with torch.no_grad():
        draft.d2t[1] = draft.d2t[0] - 1  # draft tokens 0 and 1 both mean base id d2t[0]
    draft.save_pretrained(tmp_path / "broken")
    with pytest.raises(SystemExit) as exit_:
        _build_draft(tiny_task, tmp_path / "b", f"training.init_heads={tmp_path / 'broken'}")
    assert exit_.value.code == 2
    assert "inconsistent d2t / t2d" in capsys.readouterr().err


def _optimizer_groups(task, out, monkeypatch, *overrides: str) -> list[tuple[float, int]]:
    """(starting learning rate, parameters) of each group of the run's optimizer; the run is
    stopped there as a Ctrl-C would."""
    groups = []

    def record(recipe, param_groups, total):
        optimizer, scheduler = make_optimizer(recipe, param_groups, total)
        for g in optimizer.param_groups:
            groups.append((g["initial_lr"], sum(p.numel() for p in g["params"])))
        raise KeyboardInterrupt

    monkeypatch.setattr(train.medusa, "make_optimizer", record)
    with pytest.raises(SystemExit) as exit_:
        run(train.medusa, TINY_MEDUSA, task, out, *overrides)
    assert exit_.value.code == 130
    return groups


def test_medusa2_heads_learn_at_the_multiplied_rate_and_the_lora_at_the_recipes(
    tiny_task, tmp_path, monkeypatch
):
    medusa1 = _optimizer_groups(tiny_task, tmp_path / "m1", monkeypatch)
    assert [lr for lr, _ in medusa1] == [pytest.approx(0.001)]
    medusa2 = _optimizer_groups(tiny_task, tmp_path / "m2", monkeypatch, "heads.lora_r=4")
    assert [lr for lr, _ in medusa2] == [pytest.approx(0.004), pytest.approx(0.001)]
    # LoRA A (r x in) and B (out x r) on q, k, v, o of both layers: q, o 64 -> 64, k, v 64 -> 32
    lora = 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
    assert medusa2[0][1] == medusa1[0][1] and medusa2[1][1] == lora


def test_an_epochs_end_is_scored_and_checkpointed_as_the_next_epochs_start(tiny_task, tmp_path):
    """4 steps of 3 an epoch: held-out scores at the epoch's end (step 3) and at the run's
    (step 4, not a multiple of the epoch); the checkpoint of step 3 resumes at epoch 1's start."""
    out = tmp_path / "out"
    run(
        train.medusa,
        TINY_MEDUSA,
        tiny_task,
        out,
        *THREE_A_EPOCH,
        "training.max_steps=4",
        "training.save_every_steps=3",
    )
    _, eval_lines = read_metrics(out)
    assert sorted(eval_lines) == [3, 4]
    final = json.loads((out / "heads" / "training_metrics.json").read_text())
    assert final == {k: v for k, v in eval_lines[4].items() if k != "step"}
    states = {
        name: json.loads((out / "checkpoints" / name / "trainer_state.json").read_text())
        for name in ("step-00000003", "step-00000004")
    }
    got = {name: (s["step"], s["epoch"], s["batch_in_epoch"]) for name, s in states.items()}
    assert got == {"step-00000003": (3, 1, 0), "step-00000004": (4, 1, 1)}
    assert states["step-00000004"]["metrics"] == final


def test_the_logged_loss_is_the_mean_of_the_steps_micro_batches(tiny_task, tmp_path, monkeypatch):
    """Two micro-batches a step: the loss logged for a step is the mean of both."""
    losses: dict[int, list[float]] = {}
    real = train.eagle.check_finite

    def record(loss, step, output_dir):  # called with every micro-batch's loss
        losses.setdefault(step, []).append(loss)
        real(loss, step, output_dir)

    monkeypatch.setattr(train.eagle, "check_finite", record)
    out = tmp_path / "out"
    accumulate = ["training.gradient_accumulation_steps=2", "heads.ttt_steps=1"]
    run(train.eagle, TINY_EAGLE, tiny_task, out, *accumulate, "training.max_steps=2")
    train_lines, _ = read_metrics(out)
    assert sorted(losses) == sorted(train_lines) == [1, 2]
    for step, (a, b) in losses.items():
        assert a != b
        assert train_lines[step]["loss"] == pytest.approx((a + b) / 2, rel=1e-6)


def test_gradients_that_overflow_under_a_finite_loss_stop_training(
    tiny_task, tmp_path, monkeypatch, capsys
):
    """Step 2's loss is finite but its backward gives NaN gradients (d sqrt(x) at 0, times 0):
    training stops before that update, as at a NaN loss, and the checkpoint of step 1 holds the
    finite weights to go on from."""
    from safetensors.torch import load_file

    real = train.medusa.MedusaTrainee.forward

    def overflowing(self, batch, step=0, norm=None):
        loss, metrics = real(self, batch, step, norm)
        if step == 1:  # the second optimizer step (steps count from 0 here)
            p = next(p for p in self.parameters() if p.requires_grad)
            loss = loss + 0 * torch.sqrt(p - p).sum()
        return loss, metrics

    monkeypatch.setattr(train.medusa.MedusaTrainee, "forward", overflowing)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        run(
            train.medusa, TINY_MEDUSA, tiny_task, out, *THREE_A_EPOCH, "training.save_every_steps=1"
        )
    assert stopped.value.code == 1
    assert (
        "error: the gradients' norm is nan at step 2; training stopped" in capsys.readouterr().err
    )
    assert not (out / "heads").exists()
    saved = sorted((out / "checkpoints").iterdir())
    assert [c.name for c in saved] == ["step-00000001"]
    weights = load_file(next(saved[0].glob("*.safetensors")))
    assert weights and all(bool(t.isfinite().all()) for t in weights.values())


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_heads_record_the_system_prompt_and_template_their_recipe_set(
    kind, request, tiny_task, tmp_path
):
    """A Hub folder has no recipe beside it: the config and card say what the heads learned
    under (the template's text, not its path), and leave out what the recipe left to the data
    and the tokenizer."""

    module, recipe = (train.medusa, TINY_MEDUSA) if kind == "medusa" else (train.eagle, TINY_EAGLE)
    earlier = request.getfixturevalue(f"{kind}_run")[0] / "heads"  # the tokenizer's template
    config = json.loads((earlier / "config.json").read_text())
    assert config["training_system_prompt"] == SYSTEM_PROMPT
    assert "training_chat_template" not in config and "training_base_gguf" not in config
    card = (earlier / "README.md").read_text()
    assert f"under the system prompt {json.dumps(SYSTEM_PROMPT)}: they draft" in card

    template = tmp_path / "chat.jinja"
    template.write_text(AutoTokenizer.from_pretrained(tiny_task.base_dir).chat_template)
    out = tmp_path / "out"
    settings = ["data.system_prompt=Recite.", f"data.chat_template={template}"]
    run(module, recipe, tiny_task, out, *settings, "training.max_steps=1")
    config = load_heads(out / "heads").config
    assert config.training_system_prompt == "Recite."
    assert config.training_chat_template == template.read_text()
    card = (out / "heads" / "README.md").read_text()
    assert 'under the system prompt "Recite." and the chat template in config.json' in card


@pytest.mark.parametrize(
    ("base", "recorded"),
    [
        ("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"),  # the alias, any case
        ("HuggingFaceTB/SmolLM2-135M-Instruct", None),  # a Hub id or folder: weights as they are
        ("~/models/llama-3-8b.Q8_0.gguf", "llama-3-8b.Q8_0.gguf"),
    ],
)
def test_heads_trained_on_a_gguf_base_record_its_file(base, recorded):
    """Heads learn the dequantised weights' hidden states: their config names the GGUF file, so
    that the card can say it to users who serve the full-precision model."""
    recipe = load_recipe(TINY_MEDUSA, [f"model.name_or_path={base}"])
    config = SimpleNamespace()
    record_training_setup(config, recipe)
    assert config.training_base_gguf == recorded
