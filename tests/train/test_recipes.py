"""CPU smoke runs of the real recipes, train/medusa.py and train/eagle.py, on a tiny Llama.

The tiny recipes (recipes/tiny-*.yaml) are pointed at the synthetic task of conftest.py with
`key=value` overrides and run in-process through `main(argv)`, except the two-process run, which
goes through `accelerate launch`. Each run checks what a user relies on: the exact output files,
heads that `load_heads` accepts, a base that is bit-identical afterwards, resume that continues
with the same losses, loss that falls, the NaN guard, and bad recipes failing clearly.
"""

from __future__ import annotations

import io
import json
import math
import re
import socket
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

import train.eagle
import train.medusa
from heads import EagleDraft, MedusaHeads, load_heads
from tests.train.conftest import SYSTEM_PROMPT
from train.checkpoint import TrainingDiverged
from train.config import load_recipe

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import eval_heads  # noqa: E402  (scripts/ is not a package)

ROOT = Path(__file__).parents[2]
TINY_MEDUSA = ROOT / "recipes" / "tiny-medusa.yaml"
TINY_EAGLE = ROOT / "recipes" / "tiny-eagle.yaml"

# Medusa: 12 steps over two epochs (9 steps each): checkpoints at 2, 4, ..., 12 and a held-out
# evaluation after every step, so a resume can start mid-epoch and learning shows step by step.
MEDUSA_RUN = [
    "training.epochs=2",
    "training.max_steps=12",
    "training.learning_rate=0.02",
    "training.eval_every_steps=1",
]
# EAGLE-3 starts from a random lm_head and first learns the letters' marginal: 18 steps (two
# epochs) of a 2-step unroll at a steady rate to learn the pattern itself.
EAGLE3_RUN = [
    "heads.ttt_steps=2",
    "training.epochs=2",
    "training.max_steps=18",
    "training.learning_rate=0.01",
    "training.warmup_steps=0",
    "training.eval_every_steps=1",
]
HEADS_FILES = {"config.json", "model.safetensors", "README.md", "training_metrics.json"}
# A run's output folder when the recipe sets heads.draft_vocab_size.
RUN_FILES = {"heads", "checkpoints", "metrics.jsonl", "recipe.yaml", "draft_vocab.safetensors"}
CHECKPOINT_FILES = {
    "model.safetensors",  # the trainee's state dict: heads (and LoRA) only, never the base
    "optimizer.bin",
    "scheduler.bin",
    "random_states_0.pkl",
    "trainer_state.json",
    "recipe.yaml",
}


class Interrupted(Exception):
    """Stands for a kill in the middle of a run."""


@contextmanager
def watching(module):
    """Keep the base that `module`'s recipe loads (to check it afterwards)."""
    seen = {}
    real = module.load_frozen_base

    def load(recipe, accelerator):
        seen["base"], tokenizer = real(recipe, accelerator)
        return seen["base"], tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "load_frozen_base", load)
        yield seen


def run(module, recipe: Path, task, out: Path, *overrides: str):
    """Run a recipe in-process; returns the base it trained against."""
    with watching(module) as seen:
        module.main([str(recipe), *task.overrides(out), *overrides])
    return seen["base"]


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


def load_tiny_base(task):
    from heads import load_base

    return load_base(str(task.base_dir), device="cpu")[0]


def heads_tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "heads" / "model.safetensors")


@pytest.fixture(scope="module")
def medusa_run(tiny_task, tmp_path_factory):
    """The uninterrupted Medusa run: (output dir, base it trained against, stdout)."""
    out = tmp_path_factory.mktemp("medusa") / "out"
    with redirect_stdout(io.StringIO()) as printed:
        base = run(train.medusa, TINY_MEDUSA, tiny_task, out, *MEDUSA_RUN)
    return out, base, printed.getvalue()


@pytest.fixture(scope="module")
def eagle3_run(tiny_task, tmp_path_factory):
    """The EAGLE-3 run: (output dir, base it trained against, stdout)."""
    out = tmp_path_factory.mktemp("eagle3") / "out"
    with redirect_stdout(io.StringIO()) as printed:
        base = run(train.eagle, TINY_EAGLE, tiny_task, out, *EAGLE3_RUN)
    return out, base, printed.getvalue()


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
def test_eval_heads_scores_the_held_out_split_and_other_answers(
    medusa_run, eagle3_run, tiny_task, tmp_path
):
    """scripts/eval_heads.py: without --data it reproduces the run's final held-out metrics; with
    --data and --categories it scores every answer, each category and all of them."""
    for out in (medusa_run[0], eagle3_run[0]):
        scores = tmp_path / f"{out.parent.name}.json"
        eval_heads.main([str(out / "recipe.yaml"), str(out / "heads"), "--out", str(scores)])
        got = json.loads(scores.read_text())["held-out"]
        final = json.loads((out / "heads" / "training_metrics.json").read_text())
        assert got["answers"] == 4  # eval_fraction 0.1 of 40 answers
        assert {k: got[k] for k in final} == pytest.approx(final, abs=1e-5)
    # Categories by first user turn: the answers from 'a'-'d' and from 'e'-'h' (20 each).
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"prompt": f"Recite the letters from '{x}'.", "category": c}) + "\n"
            for x, c in zip("abcdefgh", ["early"] * 4 + ["late"] * 4)
        )
    )
    out, scores = medusa_run[0], tmp_path / "data.json"
    argv = [str(out / "recipe.yaml"), str(out / "heads"), "--data", str(tiny_task.data_dir)]
    eval_heads.main([*argv, "--categories", str(questions), "--out", str(scores)])
    got = json.loads(scores.read_text())
    assert list(got) == ["all", "early", "late"]
    assert [got[k]["answers"] for k in got] == [40, 20, 20]
    assert got["all"]["eval/walk_tau"] > 2.0  # trained on these answers: both heads mostly right
    # "all" is tokens / steps over both categories: between the two.
    tau = [got[k]["eval/walk_tau"] for k in ("early", "late")]
    assert min(tau) - 1e-9 <= got["all"]["eval/walk_tau"] <= max(tau) + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_walk_tau_is_the_tau_a_fixed_chain_decodes_at(kind, medusa_run, eagle3_run, tiny_task):
    """Decode the base's greedy answer with the trained heads as a fixed chain (fp32), then score
    that answer as the trainer's held-out evaluation does: walk_tau equals the decode's tau."""
    from inference.generate import SpeculativeGenerator
    from train.features import ExampleDataset
    from train.run import evaluate

    out = (medusa_run if kind == "medusa" else eagle3_run)[0]
    recipe = load_recipe(out / "recipe.yaml")
    base = load_tiny_base(tiny_task)
    heads = load_heads(out / "heads", base=base)
    if kind == "medusa":
        generator = SpeculativeGenerator(base, heads, choices="chain-2")
        trainee = train.medusa.MedusaTrainee(base, heads, recipe)
    else:  # EAGLE-3 trained a 2-step unroll: a 2-token chain
        generator = SpeculativeGenerator(base, heads, top_k=1, depth=2, total_tokens=3)
        trainee = train.eagle.EagleTrainee(base, heads, recipe)
    tokenizer = AutoTokenizer.from_pretrained(tiny_task.base_dir)
    examples, taus = [], []
    for letter in "bdg":
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Recite the letters from '{letter}'."},
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        decoded = generator.generate(torch.tensor(prompt), max_new_tokens=20)
        answer = decoded.sequences[0, len(prompt) :].tolist()
        assert decoded.mean_accepted_length > 1.5  # the heads draft most of it
        ids = prompt + answer
        mask = [0] * len(prompt) + [1] * len(answer)
        examples.append({"input_ids": ids, "loss_mask": mask, "labels": ids})
        taus.append((sum(decoded.accepted_lengths), decoded.num_steps))
    with torch.no_grad():
        for example, (tokens, steps) in zip(examples, taus):
            one = ExampleDataset([example])
            got = evaluate(trainee, one, recipe, tokenizer.pad_token_id, "cpu")
            assert got["eval/walk_tau"] == pytest.approx(tokens / steps), example
        # Over several answers: tokens over steps, not a mean of the answers' ratios.
        got = evaluate(trainee, ExampleDataset(examples), recipe, tokenizer.pad_token_id, "cpu")
    total = [sum(x) for x in zip(*taus)]
    assert got["eval/walk_tau"] == pytest.approx(total[0] / total[1])


@pytest.mark.slow
def test_eval_heads_refuses_bad_arguments(medusa_run, eagle3_run, tiny_task, tmp_path, capsys):
    medusa, eagle = medusa_run[0], eagle3_run[0]
    recipe, heads, data = medusa / "recipe.yaml", medusa / "heads", tiny_task.data_dir
    no_category = tmp_path / "plain.jsonl"
    no_category.write_text(json.dumps({"prompt": "Recite the letters from 'a'."}) + "\n")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "Say hello.", "category": "chat"}) + "\n")
    for argv, message in (
        ([recipe, eagle / "heads"], "does not hold medusa heads"),
        ([recipe, tmp_path / "missing"], "heads folder not found"),
        ([recipe, heads, "--categories", other], "give --data too"),
        ([recipe, heads, "--data", tmp_path / "missing"], "no .jsonl shards"),
        ([recipe, heads, "--data", tmp_path], "no assistant answers"),  # prompts only
        ([recipe, heads, "--data", data, "--categories", no_category], "no record has a"),
        ([recipe, heads, "--data", data, "--categories", other], "answers a prompt of"),
        ([recipe, heads, "training.eval_fraction=0"], "holds no answer out"),
    ):
        with pytest.raises(SystemExit) as stop:
            eval_heads.main([str(a) for a in argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err, argv


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
    capsys.readouterr()
    run(train.medusa, TINY_MEDUSA, tiny_task, out, *MEDUSA_RUN)
    assert "at step 10" in capsys.readouterr().out
    assert_same_run(out, reference, 12)


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


@pytest.mark.slow
def test_eagle1_run(tiny_task, tmp_path, capsys):
    out = tmp_path / "out"
    base = run(train.eagle, TINY_EAGLE, tiny_task, out, "heads.version=1", "training.max_steps=3")
    # EAGLE-1 predicts over the base's own lm_head: no draft vocabulary file.
    assert {p.name for p in out.iterdir()} == {
        "heads",
        "checkpoints",
        "metrics.jsonl",
        "recipe.yaml",
    }
    assert {p.name for p in (out / "heads").iterdir()} == HEADS_FILES
    draft = load_heads(out / "heads", base=load_tiny_base(tiny_task))
    assert isinstance(draft, EagleDraft) and draft.config.version == 1
    assert trainable_printed(capsys.readouterr().out) == draft.num_trainable_parameters()
    assert_base_untouched(base, tiny_task)
    train_lines, _ = read_metrics(out)
    assert sorted(train_lines) == [1, 2, 3]
    assert {"feature_loss", "token_loss", "step0/top1"} <= train_lines[1].keys()


@pytest.mark.slow
def test_medusa2_trains_heads_and_lora_only(tiny_task, tmp_path, capsys):
    out = tmp_path / "out"
    base = run(train.medusa, TINY_MEDUSA, tiny_task, out, "heads.lora_r=4", "training.max_steps=2")
    heads = load_heads(out / "heads", base=load_tiny_base(tiny_task))
    # LoRA A (r x in) and B (out x r) on q, k, v, o of both layers: q, o are 64 -> 64, k, v
    # 64 -> 32 (2 kv heads of 16).
    lora = 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
    assert trainable_printed(capsys.readouterr().out) == heads.num_trainable_parameters() + lora
    assert_base_untouched(base, tiny_task)
    ckpt = load_file(out / "checkpoints" / "step-00000002" / "model.safetensors")
    assert sum(t.numel() for k, t in ckpt.items() if "lora_" in k) == lora
    train_lines, _ = read_metrics(out)
    assert sorted(train_lines) == [1, 2] and "kl" in train_lines[1]
    adapter = load_file(out / "lora" / "adapter_model.safetensors")  # served with the heads
    assert sum(t.numel() for t in adapter.values()) == lora


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
    # 40 records of 8 distinct conversations: each token sequence is computed and stored once.
    assert "0 examples cached, 8 to compute" in capsys.readouterr().out
    first = read_metrics(tmp_path / "a")[0]
    for step in (1, 2):
        assert first[step]["loss"] == pytest.approx(online[step]["loss"], rel=2e-2)
    assert len(list(cache.glob("features-r000-*.safetensors"))) == 1

    run(train.eagle, TINY_EAGLE, tiny_task, tmp_path / "b", *offline, "training.max_steps=2")
    assert "8 examples cached, 0 to compute" in capsys.readouterr().out
    assert read_metrics(tmp_path / "b")[0][2]["loss"] == first[2]["loss"]
    # Medusa reads "hidden" and "top" only, from the same cache.
    run(train.medusa, TINY_MEDUSA, tiny_task, tmp_path / "c", *offline[-2:], "training.max_steps=2")
    assert "8 examples cached, 0 to compute" in capsys.readouterr().out
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
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_task, tmp_path, monkeypatch):
    out = tmp_path / "out"
    forward = train.medusa.MedusaTrainee.forward

    def nan_at_step_3(self, batch, step=0):
        loss, metrics = forward(self, batch, step)
        return (loss * float("nan") if step == 2 else loss), metrics  # `step` counts done steps

    monkeypatch.setattr(train.medusa.MedusaTrainee, "forward", nan_at_step_3)
    with pytest.raises(TrainingDiverged) as err:
        run(train.medusa, TINY_MEDUSA, tiny_task, out, "training.save_every_steps=1")
    last_good = out / "checkpoints" / "step-00000002"
    assert "loss is nan at step 3" in str(err.value) and str(last_good) in str(err.value)
    assert (last_good / "trainer_state.json").is_file()
    assert not (out / "checkpoints" / "step-00000003").exists() and not (out / "heads").exists()


def test_unknown_recipe_key_exits_2_listing_the_valid_keys(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.medusa.main([str(TINY_MEDUSA), "training.lerning_rate=0.1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key 'training.lerning_rate'" in err and "Did you mean 'learning_rate'" in err
    assert "Valid keys of 'training': mode, feature_cache, epochs, max_steps" in err

    recipe = yaml.safe_load(TINY_EAGLE.read_text())
    recipe["heads"]["ttt_step"] = 3
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_:
        train.eagle.main([str(path)])
    assert exit_.value.code == 2
    assert "Valid keys of 'heads': type, num_heads" in capsys.readouterr().err


def test_heads_type_must_match_the_script(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.eagle.main([str(TINY_MEDUSA)])
    assert exit_.value.code == 2
    assert "heads.type='medusa': run train/medusa.py" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        train.medusa.main([str(TINY_EAGLE)])
    assert exit_.value.code == 2
    assert "run train/eagle.py" in capsys.readouterr().err
