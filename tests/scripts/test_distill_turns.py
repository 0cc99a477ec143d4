"""distill.py answering turn by turn, a question given twice, a killed run's leftovers, the lock
on a new folder and the manifest's merged backends."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from types import SimpleNamespace

from tests.scripts.test_distill import distill, read_records, recipe_file
from train.config import load_recipe
from train.lock import LOCK_NAME


def _turn_by_turn(smollm2_tokenizer, users, finished, max_length=256):
    """run_batch over one item with a fake generator; returns (item, the prompts it was given)."""
    recipe = load_recipe(None, [f"data.max_length={max_length}", "data.max_new_tokens=4"])
    template = distill.resolve_chat_template(smollm2_tokenizer, None)
    first = distill.render_conversation(
        [{"role": "user", "content": users[0]}],
        smollm2_tokenizer,
        chat_template=template,
        add_generation_prompt=True,
    )
    ids = smollm2_tokenizer(first, add_special_tokens=False)["input_ids"]
    item = distill.WorkItem("p-0", "test", [], list(users), ids)
    seen, answers = [], iter(finished)
    answer_ids = smollm2_tokenizer("fine", add_special_tokens=False)["input_ids"]

    def generate(prompts):
        seen.extend(smollm2_tokenizer.decode(p) for p in prompts)
        return [(answer_ids, next(answers)) for _ in prompts]

    distill.run_batch([item], generate, smollm2_tokenizer, template, recipe)
    return item, seen


def test_each_turn_is_asked_its_own_question_and_a_cut_turn_leaves_the_record_unfinished(
    smollm2_tokenizer,
):
    item, seen = _turn_by_turn(
        smollm2_tokenizer, ["First question?", "Second question?"], [False, True]
    )
    assert len(seen) == 2
    assert "First question?" in seen[1] and seen[1].rstrip().count("Second question?") == 1
    assert seen[1].rindex("Second question?") > seen[1].rindex("fine")  # asked after answer 1
    record = item.record()
    assert [t["from"] for t in record["conversations"]] == ["human", "gpt", "human", "gpt"]
    # the first answer was cut at max_new_tokens: the record is not a finished one
    assert record["finished"] is False


def test_every_turn_that_no_longer_fits_is_counted_as_dropped(smollm2_tokenizer):
    users = ["Hi.", "word " * 300, "And a third?"]  # turn 2 does not fit: turns 2 and 3 dropped
    item, seen = _turn_by_turn(smollm2_tokenizer, users, [True], max_length=80)
    assert len(seen) == 1
    assert item.record()["dropped_turns"] == 2


def test_a_question_given_twice_is_answered_once(tmp_path, tiny_base):
    prompts = tmp_path / "p.jsonl"
    old_answer = {  # the same question with an answer of another model: asked the same
        "conversations": [
            {"from": "human", "value": "Name a fruit."},
            {"from": "gpt", "value": "A pear."},
        ]
    }
    prompts.write_text('{"prompt": "Name a fruit."}\n' + json.dumps(old_answer) + "\n")
    out = tmp_path / "out"
    assert distill.main([str(recipe_file(tmp_path, tiny_base, prompts, out))]) == 0
    ids = [r["id"] for r in read_records(out)]
    assert len(ids) == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["records_written"] == manifest["counts"]["records_expected"] == 1
    assert manifest["complete"] is True


def test_a_rerun_removes_the_temporary_files_of_a_killed_run(tmp_path, tiny_base):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a fruit."}\n{"prompt": "Name a tree."}\n')
    out = tmp_path / "out"
    recipe = str(recipe_file(tmp_path, tiny_base, prompts, out))
    assert distill.main([recipe, "data.limit=1"]) == 0
    torn = out / ".shard-r000-00001.jsonl.999999.tmp"  # a kill mid-write left it
    torn.write_text('{"id": "x-0", "conv')
    assert distill.main([recipe]) == 0
    assert not list(out.glob(".*.tmp")) and len(read_records(out)) == 2


def test_a_new_folder_is_locked_for_the_whole_run(tmp_path, tiny_base, monkeypatch):
    """The folder did not exist when the run began (nothing could be locked): once the run makes
    it, it holds it, and another run started meanwhile is refused."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a fruit."}\n')
    out = tmp_path / "new" / "out"
    attempts = []
    real = distill.read_done_ids

    def another_run_tries(folder):
        # What lock_output does in another run: its own open file description of the lock file
        # (flock treats two descriptors of one file as two holders, even in one process).
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            attempts.append("taken")
        except BlockingIOError:
            attempts.append("refused")
        finally:
            os.close(fd)
        return real(folder)

    monkeypatch.setattr(distill, "read_done_ids", another_run_tries)
    assert distill.main([str(recipe_file(tmp_path, tiny_base, prompts, out))]) == 0
    assert attempts == ["refused"]  # refused while this run wrote the folder


def test_a_backend_already_in_the_record_adds_no_note(tmp_path, capsys):
    state = SimpleNamespace(is_main_process=True)
    recorded = {"backend": "transformers+vllm"}
    merged = distill.merged_record(
        recorded, "backend", "transformers", "written by", Path("o"), state
    )
    assert merged == "transformers+vllm"
    assert capsys.readouterr().out == ""
    merged = distill.merged_record(
        {"backend": "vllm"}, "backend", "transformers", "written by", Path("o"), state
    )
    assert (
        merged == "transformers+vllm"
        and "written by vllm, these written by" in capsys.readouterr().out
    )
