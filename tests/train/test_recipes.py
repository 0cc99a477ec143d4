"""CPU smoke runs of the real recipes, train/medusa.py and train/eagle.py, on a tiny Llama.

The tiny recipes (recipes/tiny-*.yaml) are pointed at the synthetic task of conftest.py with
`key=value` overrides and run in-process through `main(argv)`, except the two-process run, which
goes through `accelerate launch`. Each run checks what a user relies on: the exact output files,
heads that `load_heads` accepts, a base that is bit-identical afterwards, resume that continues
with the same losses (test_resume.py), loss that falls, the NaN guard, and bad recipes failing
clearly.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import AutoTokenizer

import train.eagle
import train.medusa
from heads import EagleDraft, MedusaHeads, load_heads
from tests.train.conftest import (
    EAGLE3_RUN,
    MEDUSA_RUN,
    TINY_EAGLE,
    TINY_MEDUSA,
    load_tiny_base,
    run,
)
from train.config import load_recipe

HEADS_FILES = {"config.json", "model.safetensors", "README.md", "training_metrics.json"}
# A run's output folder when the recipe sets heads.draft_vocab_size (.headstart.lock: one run
# at a time in the folder, train/lock.py).
RUN_FILES = {"heads", "checkpoints", "metrics.jsonl", "recipe.yaml", "draft_vocab.safetensors"}
RUN_FILES |= {".headstart.lock"}
CHECKPOINT_FILES = {
    "model.safetensors",  # the trainee's state dict: heads (and LoRA) only, never the base
    "optimizer.bin",
    "scheduler.bin",
    "random_states_0.pkl",
    "trainer_state.json",
    "recipe.yaml",
}


def read_metrics(out: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """metrics.jsonl as ({step: training line}, {step: held-out line}); a step logged twice is an
    error (a resumed run must not repeat what the interrupted one logged)."""
    train_lines: dict[int, dict] = {}
    eval_lines: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        lines = eval_lines if any(k.startswith("eval/") for k in record) else train_lines
        assert record["step"] not in lines, f"step {record['step']} logged twice"
        lines[record["step"]] = record
    return train_lines, eval_lines


def trainable_printed(text: str) -> int:
    counts = re.findall(r"trainable parameters: ([\d,]+)", text)
    assert len(counts) == 1, text
    return int(counts[0].replace(",", ""))


def assert_base_untouched(base, task) -> None:
    """The base a recipe trained against equals the saved one, bit for bit, and stayed frozen.
    (Medusa-2 wraps the base's linears with peft: their weights sit under `base_layer`.)"""
    saved = load_file(task.base_dir / "model.safetensors")
    state = {
        k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k
    }
    assert state.keys() >= saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), f"base tensor {name} changed"
    assert not any(p.requires_grad for n, p in base.named_parameters() if "lora_" not in n)
    if not any("lora_" in n for n in base.state_dict()):  # no dropout in the frozen features
        assert not any(m.training for m in base.modules())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def heads_tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "heads" / "model.safetensors")


def test_tiny_recipes_validate():
    medusa, eagle = load_recipe(TINY_MEDUSA), load_recipe(TINY_EAGLE)
    assert medusa.heads.type == "medusa" and eagle.heads.type == "eagle"
    assert eagle.heads.version == 3 and eagle.heads.ttt_steps == 3
    assert medusa.training.max_steps == eagle.training.max_steps == 4


@pytest.mark.slow
def test_medusa_run_writes_the_heads_and_keeps_the_base(medusa_run, tiny_task):
    out, base, printed = medusa_run
    assert {p.name for p in out.iterdir()} == RUN_FILES  # heads.draft_vocab_size is set
    assert {p.name for p in (out / "heads").iterdir()} == HEADS_FILES
    # keep_last_checkpoints: 2 of the six written (every 2 steps) remain; no temporary folders.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000010",
        "step-00000012",
    ]
    for ckpt in (out / "checkpoints").iterdir():
        assert {p.name for p in ckpt.iterdir()} == CHECKPOINT_FILES
        assert all(k.startswith("heads.") for k in load_file(ckpt / "model.safetensors"))
    state = json.loads((out / "checkpoints" / "step-00000010" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (10, 1, 1)

    heads = load_heads(out / "heads", base=load_tiny_base(tiny_task))
    assert isinstance(heads, MedusaHeads) and heads.config.num_heads == 2
    draft_vocab = load_file(out / "draft_vocab.safetensors")["token_ids"]
    assert torch.equal(heads.token_map, draft_vocab) and draft_vocab.numel() == 256
    assert trainable_printed(printed) == heads.num_trainable_parameters()
    assert_base_untouched(base, tiny_task)

    train_lines, eval_lines = read_metrics(out)
    assert sorted(train_lines) == sorted(eval_lines) == list(range(1, 13))
    assert {"loss", "lr", "head0/top1", "head1/top5", "sim_tau"} <= train_lines[1].keys()
    final = json.loads((out / "heads" / "training_metrics.json").read_text())
    assert final == {k: v for k, v in eval_lines[12].items() if k != "step"}
    assert load_recipe(out / "recipe.yaml") == load_recipe(
        TINY_MEDUSA, [*tiny_task.overrides(out), *MEDUSA_RUN]
    )


def test_max_steps_past_the_epochs_trains_on_into_the_next_epoch(tiny_task, tmp_path):
    # 9 optimizer steps an epoch (the checkpoint above: step 10 is epoch 1's first); as in HF's
    # Trainer, max_steps overrides epochs instead of being capped by them
    out = tmp_path / "out"
    settings = ["training.epochs=1", "training.max_steps=11", "training.save_every_steps=11"]
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *settings)
    train_lines, _ = read_metrics(out)
    assert sorted(train_lines) == list(range(1, 12))
    state = json.loads((out / "checkpoints" / "step-00000011" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (11, 1, 2)


@pytest.mark.slow
def test_medusa_loss_falls_on_a_learnable_task(medusa_run):
    train_lines, eval_lines = read_metrics(medusa_run[0])
    assert train_lines[12]["loss"] < 0.2 * train_lines[1]["loss"]
    assert eval_lines[12]["eval/loss"] < 0.2 * eval_lines[1]["eval/loss"]
    assert eval_lines[12]["eval/head0/top1"] > eval_lines[1]["eval/head0/top1"] + 0.5
    assert eval_lines[12]["eval/sim_tau"] > 2.0  # 1 + both heads mostly right
    # In decode order too (held-out only: the walk is not logged per training step).
    assert "walk_tau" not in train_lines[12]
    assert eval_lines[1]["eval/walk_tau"] < 1.5
    assert 2.0 < eval_lines[12]["eval/walk_tau"] <= 3.0  # 2 heads and the bonus token


def test_logged_lr_is_the_rate_each_update_used(medusa_run):
    """Cosine schedule with 1 warmup step over 12 steps: update 1 uses lr 0, update s > 1 uses
    0.02 * (1 + cos(pi * (s - 2) / 11)) / 2 (transformers' get_cosine_schedule_with_warmup)."""
    train_lines, _ = read_metrics(medusa_run[0])
    want = [0.0] + [0.01 * (1 + math.cos(math.pi * (s - 1) / 11)) for s in range(1, 12)]
    assert [train_lines[s]["lr"] for s in range(1, 13)] == pytest.approx(want, abs=1e-9)


@pytest.mark.slow
def test_eagle3_run_writes_the_draft_and_learns(eagle3_run, tiny_task):
    out, base, printed = eagle3_run
    assert {p.name for p in out.iterdir()} == RUN_FILES
    assert {p.name for p in (out / "heads").iterdir()} == HEADS_FILES
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000016",
        "step-00000018",
    ]
    draft = load_heads(out / "heads", base=load_tiny_base(tiny_task))
    assert isinstance(draft, EagleDraft) and draft.config.version == 3
    assert draft.config.draft_vocab_size == 256
    draft_vocab = load_file(out / "draft_vocab.safetensors")["token_ids"]
    assert torch.equal(draft.to_base_ids(torch.arange(256)), draft_vocab)
    assert trainable_printed(printed) == draft.num_trainable_parameters()
    assert_base_untouched(base, tiny_task)

    train_lines, eval_lines = read_metrics(out)
    assert sorted(train_lines) == sorted(eval_lines) == list(range(1, 19))
    assert {"step0/top1", "step1/top1", "sim_tau"} <= train_lines[1].keys()
    first, last = eval_lines[1], eval_lines[18]
    assert train_lines[18]["loss"] < 0.5 * train_lines[1]["loss"]
    assert last["eval/loss"] < 0.5 * first["eval/loss"]
    assert last["eval/step0/top1"] > max(0.5, first["eval/step0/top1"] + 0.3)
    assert last["eval/sim_tau"] > first["eval/sim_tau"] + 0.5
    assert 1.0 <= first["eval/walk_tau"] < last["eval/walk_tau"] - 0.3
    assert last["eval/walk_tau"] <= 4.0  # 3 TTT steps and the bonus token


@pytest.mark.parametrize("from_base", [True, False])
def test_eagle3_draft_starts_from_the_base_unless_the_recipe_says_not(
    tiny_task, tmp_path, from_base
):
    base = load_tiny_base(tiny_task)
    recipe = load_recipe(
        TINY_EAGLE, [*tiny_task.overrides(tmp_path), f"heads.init_from_base={from_base}"]
    )
    answers = SimpleNamespace(examples=[{"input_ids": list(range(400)), "loss_mask": [1] * 400}])
    draft, _ = train.eagle.build_draft(recipe, base, answers, Accelerator(cpu=True), ckpt=None)
    kept = draft.to_base_ids(torch.arange(256))
    starts_as_base = torch.equal(draft.lm_head.weight, base.lm_head.weight[kept])
    mlp = draft.midlayer.mlp.down_proj.weight
    assert (
        starts_as_base == torch.equal(mlp, base.model.layers[-1].mlp.down_proj.weight) == from_base
    )


@pytest.mark.slow
def test_eagle1_run(tiny_task, tmp_path, capsys):
    out = tmp_path / "out"
    base = run(train.eagle, TINY_EAGLE, tiny_task, out, "heads.version=1", "training.max_steps=3")
    # EAGLE-1 predicts over the base's own lm_head: no draft vocabulary file.
    assert {p.name for p in out.iterdir()} == RUN_FILES - {"draft_vocab.safetensors"}
    assert {p.name for p in (out / "heads").iterdir()} == HEADS_FILES
    draft = load_heads(out / "heads", base=load_tiny_base(tiny_task))
    assert isinstance(draft, EagleDraft) and draft.config.version == 1
    printed = capsys.readouterr().out
    assert trainable_printed(printed) == draft.num_trainable_parameters()
    # the recipe's EAGLE-3 settings are said to be unused, not dropped without a word
    assert "note: heads.draft_vocab_size=256, heads.ttt_steps=3: EAGLE-3's, unused" in printed
    assert_base_untouched(base, tiny_task)
    train_lines, _ = read_metrics(out)
    assert sorted(train_lines) == [1, 2, 3]
    assert {"feature_loss", "token_loss", "step0/top1"} <= train_lines[1].keys()


@pytest.mark.slow
def test_medusa2_trains_heads_and_lora_only(tiny_task, tmp_path, capsys):
    out = tmp_path / "out"
    warmup = "heads.heads_loss_warmup_steps=10"
    base = run(
        train.medusa, TINY_MEDUSA, tiny_task, out, "heads.lora_r=4", "training.max_steps=2", warmup
    )
    # the heads read the adapted base: given the plain one they say so, given it merged not
    with pytest.warns(UserWarning, match="Medusa-2 heads were trained on the base with the LoRA"):
        heads = load_heads(out / "heads", base=load_tiny_base(tiny_task))
    assert heads.config.base_lora == "lora" and len(heads.config.base_lora_probe["index"]) == 8
    from peft import PeftModel

    merged = PeftModel.from_pretrained(
        load_tiny_base(tiny_task), str(out / "heads"), subfolder="lora"
    ).merge_and_unload()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_heads(out / "heads", base=merged)
    card = (out / "heads" / "README.md").read_text()
    assert 'PeftModel.from_pretrained(base, "REPO", subfolder="lora")' in card
    assert 'LLM(model="BASE_WITH_LORA_MERGED"' in card  # vLLM: the merged base, saved
    from heads.export import export_heads

    export_heads(out / "heads", "vllm", tmp_path / "vllm")  # the adapter goes along
    assert (tmp_path / "vllm" / "lora" / "adapter_model.safetensors").is_file()
    # LoRA A (r x in) and B (out x r) on q, k, v, o of both layers: q, o are 64 -> 64, k, v
    # 64 -> 32 (2 kv heads of 16).
    lora = 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
    assert trainable_printed(capsys.readouterr().out) == heads.num_trainable_parameters() + lora
    assert_base_untouched(base, tiny_task)
    ckpt = load_file(out / "checkpoints" / "step-00000002" / "model.safetensors")
    assert sum(t.numel() for k, t in ckpt.items() if "lora_" in k) == lora
    train_lines, _ = read_metrics(out)
    assert sorted(train_lines) == [1, 2] and "kl" in train_lines[1]
    adapter = load_file(out / "heads" / "lora" / "adapter_model.safetensors")  # with the heads
    assert sum(t.numel() for t in adapter.values()) == lora
    # The heads' weight ramps up over training steps; a held-out loss weighs them fully
    # whatever the step (it read step 0's 1/10 all through a run).
    from train.data import build_examples, load_distilled
    from train.features import ExampleDataset, collate

    recipe = load_recipe(out / "recipe.yaml")
    tokenizer = AutoTokenizer.from_pretrained(tiny_task.base_dir)
    examples = build_examples(load_distilled(tiny_task.data_dir)[:4], tokenizer, max_length=256)
    batch = collate(ExampleDataset(examples), [0, 1, 2, 3], tokenizer.pad_token_id, "cpu")
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(load_tiny_base(tiny_task), LoraConfig(r=4, target_modules=["q_proj"]))
    trainee = train.medusa.MedusaTrainee(adapted, heads, recipe)
    with torch.no_grad():
        trainee.eval()  # no LoRA dropout in either
        held_out = [float(trainee(batch, step)[0]) for step in (0, 9)]
        trainee.training = True  # the trainee's own flag only: what a training step reads
        ramped = [float(trainee(batch, step)[0]) for step in (0, 9)]
    assert ramped[0] < ramped[1] == pytest.approx(held_out[0]) and held_out[0] == held_out[1]
    # Medusa-1 started from these heads, afresh in the same output: said, and the old adapter
    # leaves the heads folder (it would be pushed and exported with heads that never read it)
    shutil.copytree(out / "heads", tmp_path / "m2-heads")
    with pytest.warns(UserWarning, match="these Medusa-2 heads read the base with the LoRA"):
        run(
            train.medusa,
            TINY_MEDUSA,
            tiny_task,
            out,
            f"training.init_heads={tmp_path / 'm2-heads'}",
            "training.resume=never",
            "training.max_steps=1",
        )
    assert not (out / "heads" / "lora").exists()
    assert not load_heads(out / "heads").config.base_lora


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_offline_features_give_the_online_losses(kind, request, tiny_task, tmp_path):
    """Offline mode computes the base's features once before training; the first steps' losses
    equal the online run's (the learning rate of steps 1-2 does not depend on max_steps)."""
    module, recipe, settings = {
        "medusa": (train.medusa, TINY_MEDUSA, MEDUSA_RUN),
        "eagle3": (train.eagle, TINY_EAGLE, EAGLE3_RUN),
    }[kind]
    online = read_metrics(request.getfixturevalue(f"{kind}_run")[0])[0]
    out = tmp_path / "out"
    run(module, recipe, tiny_task, out, *settings, "training.mode=offline", "training.max_steps=2")
    offline = read_metrics(out)[0]
    assert sorted(offline) == [1, 2]
    for step in (1, 2):
        assert offline[step]["loss"] == pytest.approx(online[step]["loss"], rel=1e-5)


@pytest.mark.slow
def test_a_feature_cache_is_filled_once_and_shared_by_both_recipes(
    request, tiny_task, tmp_path, capsys
):
    """training.feature_cache keeps the features as bf16 on disk: the first steps' losses are
    the online run's up to bf16 rounding, and a second run (another recipe, the same data)
    computes nothing."""
    online = read_metrics(request.getfixturevalue("eagle3_run")[0])[0]
    cache = tmp_path / "cache"
    offline = [*EAGLE3_RUN, "training.mode=offline", f"training.feature_cache={cache}"]
    run(train.eagle, TINY_EAGLE, tiny_task, tmp_path / "a", *offline, "training.max_steps=2")
    # 40 distinct conversations (test_feature_cache.py: duplicates are computed once).
    assert "0 examples cached, 40 to compute" in capsys.readouterr().out
    first = read_metrics(tmp_path / "a")[0]
    for step in (1, 2):
        assert first[step]["loss"] == pytest.approx(online[step]["loss"], rel=2e-2)
    assert len(list(cache.glob("features-r000-*.safetensors"))) == 1

    run(train.eagle, TINY_EAGLE, tiny_task, tmp_path / "b", *offline, "training.max_steps=2")
    assert "40 examples cached, 0 to compute" in capsys.readouterr().out
    assert read_metrics(tmp_path / "b")[0][2]["loss"] == first[2]["loss"]
    # Medusa reads "hidden" and "top" only, from the same cache.
    run(train.medusa, TINY_MEDUSA, tiny_task, tmp_path / "c", *offline[-2:], "training.max_steps=2")
    assert "40 examples cached, 0 to compute" in capsys.readouterr().out
    assert sorted(read_metrics(tmp_path / "c")[0]) == [1, 2]
    # A cache of other aux layers is refused, saying what differs.
    with pytest.raises(SystemExit):
        run(
            train.eagle,
            TINY_EAGLE,
            tiny_task,
            tmp_path / "d",
            *offline,
            "heads.aux_layer_ids=[0,0,1]",
        )
    assert "aux_layer_ids" in capsys.readouterr().err


@pytest.mark.slow
def test_medusa_shared_lm_head_over_the_full_vocabulary(tiny_task, tmp_path, capsys):
    out = tmp_path / "out"
    base = run(
        train.medusa,
        TINY_MEDUSA,
        tiny_task,
        out,
        "heads.shared_lm_head=true",
        "heads.draft_vocab_size=null",
        "training.max_steps=2",
    )
    assert not (out / "draft_vocab.safetensors").exists()
    tiny = load_tiny_base(tiny_task)
    heads = load_heads(out / "heads", base=tiny)
    assert heads.config.original_lm_head and heads.token_map is None
    assert heads.lm_head.weight is tiny.get_output_embeddings().weight
    # Only the residual blocks train: 2 heads x (64 x 64 + 64).
    assert trainable_printed(capsys.readouterr().out) == heads.num_trainable_parameters() == 8320
    assert_base_untouched(base, tiny_task)


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, trainee, recipe",
    [
        (train.medusa, train.medusa.MedusaTrainee, TINY_MEDUSA),
        (train.eagle, train.eagle.EagleTrainee, TINY_EAGLE),
    ],
    ids=["medusa", "eagle3"],
)
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(
    module, trainee, recipe, tiny_task, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    forward = trainee.forward

    def nan_at_step_3(self, batch, step=0, norm=None):
        loss, metrics = forward(self, batch, step, norm)
        return (loss * float("nan") if step == 2 else loss), metrics  # `step` counts done steps

    monkeypatch.setattr(trainee, "forward", nan_at_step_3)
    with pytest.raises(SystemExit) as exit_:
        run(module, recipe, tiny_task, out, "training.save_every_steps=1")
    assert exit_.value.code == 1
    err = capsys.readouterr().err  # the message, without a traceback
    last_good = out / "checkpoints" / "step-00000002"
    assert "error: loss is nan at step 3" in err and str(last_good) in err
    # step 2's weights are those step 3 started from: the checkpoint before is named too
    assert f"rerun with training.resume={out / 'checkpoints' / 'step-00000001'}, the one" in err
    assert (last_good / "trainer_state.json").is_file()
    assert not (out / "checkpoints" / "step-00000003").exists() and not (out / "heads").exists()


def test_hard_labels_outside_a_reduced_draft_vocabulary_add_no_nan(tmp_path):
    """soft_labels=false with a reduced draft vocabulary: a micro-batch whose targets of some
    head all lie outside it adds 0 for that head (an empty mean was NaN, which stopped the run)."""
    from heads import MedusaConfig, MedusaHeads
    from tests.conftest import make_tiny_llama

    base = make_tiny_llama()
    config = MedusaConfig.from_base(base.config, num_heads=2, truncated_vocab_size=4)
    heads = MedusaHeads(config).init_from_base(base, token_map=torch.tensor([0, 1, 2, 3]))
    recipe = load_recipe(TINY_MEDUSA, [f"output.dir={tmp_path}", "training.soft_labels=false"])
    trainee = train.medusa.MedusaTrainee(base, heads, recipe)
    ids = torch.tensor(
        [[5, 6, 7, 8, 9, 10, 2, 3]]
    )  # head 0's targets (8, 9, 10, 2, 3): two drafted
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        loss, metrics = trainee(batch)
        assert math.isfinite(float(loss)) and float(loss) > 0
        far = ids.clone()
        far[0, 3:] = torch.tensor([200, 201, 202, 203, 204])  # none drafted, for either head
        loss, _ = trainee({**batch, "input_ids": far})
        assert float(loss) == 0.0


def test_the_vicuna_recipes_template_is_fastchats_v1_1_after_the_bos_token(smollm2_tokenizer):
    """Vicuna's tokenizer has no chat template and adds BOS itself; headstart tokenises the
    rendered text without special tokens, so the template writes BOS."""
    from train.data import render_conversation

    recipe = load_recipe(TINY_MEDUSA.parent / "vicuna-7b-medusa.yaml", [])
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    text = render_conversation(turns, smollm2_tokenizer, chat_template=recipe.data.chat_template)
    assert text == (
        f"{smollm2_tokenizer.bos_token}A chat between a curious user and an artificial "
        "intelligence assistant. The assistant gives helpful, detailed, and polite answers to "
        "the user's questions. USER: Hi ASSISTANT: Hello.</s>"
    )
