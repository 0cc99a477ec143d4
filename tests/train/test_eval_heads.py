"""scripts/eval_heads.py and the trainers' walk_tau on the tiny recipe runs of conftest.py: walk_tau
equals the tau of a fixed chain decoding the same answers, held-out metrics do not depend on the
batch size, the script reproduces a run's held-out metrics and scores other answers per category,
and bad input exits 2 with a message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import train.eagle
import train.medusa
from heads import load_heads
from tests.train.conftest import (
    LETTERS,
    N_RECORDS,
    TINY_MEDUSA,
    letter_prompt,
    load_tiny_base,
)
from train.config import load_recipe

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import eval_heads  # noqa: E402  (scripts/ is not a package)
from bench_methods import BenchError  # noqa: E402


def write_questions(path: Path, *first: str) -> Path:
    """The tiny task's prompts by category, 'a'-'d' early and 'e'-'h' late, after `first` (early)."""
    records = [{"prompt": p, "category": "early"} for p in first]
    records += [
        {
            "prompt": f"Recite the letters from '{LETTERS[i % 8]}' ({i}).",
            "category": "early" if i % 8 < 4 else "late",
        }
        for i in range(N_RECORDS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_eval_heads_scores_the_held_out_split_and_other_answers(
    medusa_run, eagle3_run, tiny_task, tmp_path
):
    """scripts/eval_heads.py: without --data it reproduces the run's final held-out metrics; with
    --data and --categories it scores every answer, each category and all of them."""
    for out in (medusa_run[0], eagle3_run[0]):
        scores = tmp_path / "scores" / f"{out.parent.name}.json"  # its folder is made
        eval_heads.main([str(out / "recipe.yaml"), str(out / "heads"), "--out", str(scores)])
        got = json.loads(scores.read_text())["held-out"]
        final = json.loads((out / "heads" / "training_metrics.json").read_text())
        assert got["answers"] == 4  # eval_fraction 0.1 of 40 answers
        assert {k: got[k] for k in final} == pytest.approx(final, abs=1e-5)
    # Categories by first user turn: the answers from 'a'-'d' and from 'e'-'h' (20 each).
    questions = write_questions(tmp_path / "questions.jsonl")
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
    # records without a category are a group of their own; "all" stays every answer
    lines = questions.read_text().splitlines()
    late = [json.loads(x) for x in lines if json.loads(x)["category"] == "late"]
    for record in late:
        del record["category"]
    early = [x for x in lines if json.loads(x)["category"] == "early"]
    questions.write_text("".join(x + "\n" for x in early + [json.dumps(r) for r in late]))
    eval_heads.main([*argv, "--categories", str(questions), "--out", str(scores)])
    got = json.loads(scores.read_text())
    assert {k: got[k]["answers"] for k in got} == {"all": 40, "early": 20, "(no category)": 20}


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])  # a few seconds: not slow
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
        prompt = letter_prompt(tokenizer, letter)[0].tolist()
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


def test_a_prompt_in_two_categories_is_refused(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Say hello.", "category": "chat"})
        + "\n"
        + json.dumps({"prompt": "Say hello.", "category": "greeting"})
        + "\n"
    )
    with pytest.raises(BenchError, match="'Say hello.'... is in two categories"):
        eval_heads.categories_of(str(prompts))


def test_the_first_user_turn_is_matched_without_its_surrounding_spaces():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Say hello.\n"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again."},
    ]
    assert eval_heads.first_user_turn(messages) == "Say hello."


@pytest.mark.slow
def test_answers_dropped_for_their_length_take_no_category_and_no_categories_mean_one_group(
    medusa_run, tiny_task, tmp_path
):
    """A record whose prompt fills training.max_length has no answer token to score: it is
    dropped, and the answers after it keep their own categories."""
    data = tmp_path / "distilled"
    data.mkdir()
    shard = next(tiny_task.data_dir.glob("*.jsonl"))
    long_prompt = "Recite the letters from 'a' (99). " + "Slowly, please. " * 200
    record = {
        "id": "long",
        "conversations": [
            {"from": "human", "value": long_prompt},
            {"from": "gpt", "value": "a b c d"},
        ],
        "finished": True,
        "source": "synthetic",
    }
    (data / shard.name).write_text(json.dumps(record) + "\n" + shard.read_text())
    questions = write_questions(tmp_path / "questions.jsonl", long_prompt)
    out, scores = medusa_run[0], tmp_path / "scores.json"
    argv = [str(out / "recipe.yaml"), str(out / "heads"), "--data", str(data), "--out", str(scores)]
    eval_heads.main([*argv, "--categories", str(questions)])
    got = json.loads(scores.read_text())
    assert {k: got[k]["answers"] for k in got} == {"all": 40, "early": 20, "late": 20}
    eval_heads.main(argv)  # no --categories: every answer, as one group
    assert {k: v["answers"] for k, v in json.loads(scores.read_text()).items()} == {"all": 40}


@pytest.mark.slow
def test_medusa2_heads_are_scored_as_their_run_scored_them(medusa2_run, tmp_path, capsys):
    """On the base with their adapter, unmerged: their acceptance on the adapted base's tokens and
    their KL term against the base without it (merged into the base they were scored on, the KL
    read ~0 and the loss the merged base's own soft labels)."""
    out, scores = medusa2_run[0], tmp_path / "scores.json"
    capsys.readouterr()
    eval_heads.main([str(out / "recipe.yaml"), str(out / "heads"), "--out", str(scores)])
    assert "eval_heads: the base with the LoRA adapter of the Medusa-2 heads" in (
        capsys.readouterr().err
    )
    got = json.loads(scores.read_text())["held-out"]
    final = json.loads((out / "heads" / "training_metrics.json").read_text())
    assert {"eval/kl", "eval/loss", "eval/head0/top1", "eval/walk_tau"} <= set(final)
    assert final["eval/kl"] > 0.01
    assert {k: got[k] for k in final} == pytest.approx(final, rel=1e-3)


def test_a_missing_heads_folder_or_an_out_that_is_a_folder_is_said_before_the_base_loads(
    tiny_task, tmp_path, capsys, monkeypatch
):
    def load_frozen_base(*args):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr(eval_heads, "load_frozen_base", load_frozen_base)
    data = f"data.output_dir={tiny_task.data_dir}"
    for argv, message in (
        ([tmp_path / "missing"], "heads folder not found"),
        ([tmp_path / "heads", "--out", tmp_path], f"--out {tmp_path} is a folder"),
    ):
        with pytest.raises(SystemExit) as stop:
            eval_heads.main([str(a) for a in (TINY_MEDUSA, *argv, data)])
        assert stop.value.code == 2 and message in capsys.readouterr().err, argv


def test_data_limit_is_said_to_choose_what_distill_answers_not_what_is_scored(
    tiny_task, tmp_path, capsys
):
    data = f"data.output_dir={tiny_task.data_dir}"
    heads = str(tmp_path / "missing")  # stopped there, after the note
    for limit in ("data.limit=4", "limit = 4"):  # the override in any form the recipe reads
        with pytest.raises(SystemExit):
            eval_heads.main([str(TINY_MEDUSA), heads, data, limit])
        assert (
            f"note: eval_heads scores every answer in {tiny_task.data_dir}: data.limit=4 only "
            "shapes what scripts/distill.py answers" in capsys.readouterr().err
        )
    with pytest.raises(SystemExit):  # the recipe's own value: nothing to say
        eval_heads.main([str(TINY_MEDUSA), heads, data, "data.num_samples=1"])
    assert "note:" not in capsys.readouterr().err


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
        # an override after the options, as the usage line puts it
        ([recipe, heads, "--out", tmp_path / "s.json", "training.eval_fraction=0"], "holds no"),
    ):
        with pytest.raises(SystemExit) as stop:
            eval_heads.main([str(a) for a in argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_held_out_metrics_weigh_every_row_the_same_whatever_the_batch_size(
    kind, medusa_run, eagle3_run, tiny_task
):
    """Held-out accuracies and taus are summed over the split and divided once: one answer at a
    time gives what all of them as one batch give, not the mean of the answers' own figures
    (which weighs a short answer's rows more)."""
    from train.features import ExampleDataset
    from train.run import evaluate

    out = (medusa_run if kind == "medusa" else eagle3_run)[0]
    base = load_tiny_base(tiny_task)
    heads = load_heads(out / "heads", base=base)
    trainee_of = train.medusa.MedusaTrainee if kind == "medusa" else train.eagle.EagleTrainee
    trainee = trainee_of(base, heads, load_recipe(out / "recipe.yaml"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_task.base_dir)
    examples = []
    for letter, new_tokens in (("b", 20), ("d", 7), ("g", 4)):
        prompt = letter_prompt(tokenizer, letter)
        answer = base.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[
            0, prompt.shape[1] :
        ]
        for tokens in (answer, answer.flip(0)):  # the base's answer; reversed, mostly missed
            ids = prompt[0].tolist() + tokens.tolist()
            mask = [0] * prompt.shape[1] + [1] * len(tokens)
            examples.append({"input_ids": ids, "loss_mask": mask, "labels": ids})

    def held_out(dataset, micro_batch_size):
        recipe = load_recipe(out / "recipe.yaml", [f"training.micro_batch_size={micro_batch_size}"])
        return evaluate(trainee, dataset, recipe, tokenizer.pad_token_id, "cpu")

    whole = held_out(ExampleDataset(examples), len(examples))
    assert held_out(ExampleDataset(examples), 1) == pytest.approx(whole, rel=1e-5)
    each = [held_out(ExampleDataset([e]), 1) for e in examples]
    top1 = "eval/head0/top1" if kind == "medusa" else "eval/step0/top1"
    assert 0.2 < whole[top1] < 0.9  # right on the base's answers, mostly wrong on the reversed
    for key in (top1, "eval/sim_tau"):
        assert whole[key] != pytest.approx(sum(e[key] for e in each) / len(each), rel=1e-2), key
