"""scripts/distill.py's work: the tokens a batch counts, the share of the prompts one process
of several answers, the vLLM backend's batches and process count, Ctrl-C's exit code, resumes
with other settings, the records' fields and prompts at max_length's edge."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from tests.scripts.test_distill import distill, read_records, recipe_file
from train.config import load_recipe


def test_a_batch_counts_its_answers_tokens_and_each_end_of_turn(smollm2_tokenizer):
    recipe = load_recipe(None, ["data.max_length=256", "data.max_new_tokens=4"])
    template = distill.resolve_chat_template(smollm2_tokenizer, None)
    first = distill.render_conversation(
        [{"role": "user", "content": "Hi?"}],
        smollm2_tokenizer,
        chat_template=template,
        add_generation_prompt=True,
    )
    ids = smollm2_tokenizer(first, add_special_tokens=False)["input_ids"]
    item = distill.WorkItem("p-0", "test", [], ["Hi?", "And?"], ids)
    answer = [11, 12, 13]
    finished = iter([True, False])  # the end-of-turn token is not in the ids returned

    def generate(prompts):
        return [(answer, next(finished)) for _ in prompts]

    tokens = distill.run_batch([item], generate, smollm2_tokenizer, template, recipe)
    assert tokens == 3 + 1 + 3


def _one_of_two_processes(monkeypatch, index: int = 0):
    """PartialState as process `index` of two (on this one CPU, no process group)."""
    state = SimpleNamespace(
        is_main_process=index == 0,
        is_local_main_process=index == 0,
        num_processes=2,
        process_index=index,
        device=torch.device("cpu"),
        wait_for_everyone=lambda: None,
    )
    monkeypatch.setattr(distill, "PartialState", lambda **kwargs: state)


def _word_prompts(tmp_path, counts=(1, 2, 3, 4)):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "word " * n}) + "\n" for n in counts))
    return prompts


def test_a_process_answers_every_other_prompt_of_the_longest_first_order(
    tmp_path, tiny_base, monkeypatch, capsys
):
    """Sorted longest first, then split: process 0 of 2 gets the longest and the third longest,
    so that both processes' batches have like lengths."""
    _one_of_two_processes(monkeypatch)
    out = tmp_path / "out"
    recipe = recipe_file(tmp_path, tiny_base, _word_prompts(tmp_path), out, batch_size=1)
    assert distill.main([str(recipe), "data.max_new_tokens=2"]) == 0
    words = sorted(r["conversations"][0]["value"].count("word") for r in read_records(out))
    assert words == [2, 4]
    assert "distill (process 0's 2 of 4):" in capsys.readouterr().err  # its bar counts its share
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["records_expected"] == 4
    assert manifest["counts"]["records_written"] == 2 and manifest["complete"] is False


def _fake_vllm(monkeypatch) -> list[int]:
    """use_vllm says yes, and vllm_generator answers "ok" at once; returns the batch sizes."""
    batches = []

    def vllm_generator(model_path, recipe, eos_ids, seed, head_counts):
        assert head_counts == (4, 2)  # the tiny base's, for vLLM's tensor-parallel size

        def generate(prompts):
            batches.append(len(prompts))
            return [([28, 29], True) for _ in prompts]

        return generate

    monkeypatch.setattr(distill, "use_vllm", lambda recipe: True)
    monkeypatch.setattr(distill, "vllm_generator", vllm_generator)
    return batches


def test_vllm_is_handed_a_shards_worth_of_prompts_at_a_time(tmp_path, tiny_base, monkeypatch):
    batches = _fake_vllm(monkeypatch)
    out = tmp_path / "out"
    prompts = _word_prompts(tmp_path, counts=(1, 2, 3, 4, 5))
    recipe = recipe_file(tmp_path, tiny_base, prompts, out, batch_size=1, records_per_shard=3)
    assert distill.main([str(recipe)]) == 0
    assert batches == [3, 2]
    assert len(read_records(out)) == 5
    assert json.loads((out / "manifest.json").read_text())["backend"] == "vllm"


def test_vllm_as_several_processes_is_refused(tmp_path, tiny_base, monkeypatch, capsys):
    batches = _fake_vllm(monkeypatch)
    _one_of_two_processes(monkeypatch)
    out = tmp_path / "out"
    recipe = recipe_file(tmp_path, tiny_base, _word_prompts(tmp_path), out)
    assert distill.main([str(recipe)]) == 2
    assert "run the vLLM backend as one process" in capsys.readouterr().err
    assert batches == [] and not list(out.glob("shard-*.jsonl"))


def test_ctrl_c_keeps_the_shards_and_exits_130(tmp_path, tiny_base, monkeypatch, capsys):
    def interrupted(recipe):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "distill", interrupted)
    recipe = recipe_file(tmp_path, tiny_base, _word_prompts(tmp_path), tmp_path / "out")
    assert distill.main([str(recipe)]) == 130
    assert "distill interrupted: the records written are kept" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # Ctrl-C stops every process: the first one says so
    assert distill.main([str(recipe)]) == 130
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm", "error"])
def test_a_run_stopped_mid_way_writes_the_answers_finished_before_it(
    tmp_path, tiny_base, monkeypatch, capsys, stop
):
    """Two answers finished, the shard of ten not yet full, Ctrl-C, SIGTERM or an error (out of
    memory) in the third: the two are written (no answer the run made is lost), and the rerun
    answers the other two alone."""
    real, calls = distill.run_batch, []

    def third_interrupted(batch, *args):
        calls.append(len(batch))
        if len(calls) == 3 and stop == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # distill's handler raises KeyboardInterrupt
        if len(calls) == 3:
            raise KeyboardInterrupt if stop == "ctrl-c" else RuntimeError("out of memory")
        return real(batch, *args)

    monkeypatch.setattr(distill, "run_batch", third_interrupted)
    out = tmp_path / "out"
    prompts = _word_prompts(tmp_path)
    recipe = recipe_file(tmp_path, tiny_base, prompts, out, batch_size=1, records_per_shard=10)
    before = signal.getsignal(signal.SIGTERM)
    if stop == "error":
        with pytest.raises(RuntimeError, match="out of memory"):
            distill.main([str(recipe), "data.max_new_tokens=2"])
    else:
        assert distill.main([str(recipe), "data.max_new_tokens=2"]) == 130
    assert signal.getsignal(signal.SIGTERM) is before  # put back
    assert len(read_records(out)) == 2
    monkeypatch.setattr(distill, "run_batch", real)
    assert distill.main([str(recipe), "data.max_new_tokens=2"]) == 0
    assert "distill: 100%|██████████| 2/2 [" in capsys.readouterr().err  # the other two alone
    assert len({r["id"] for r in read_records(out)}) == len(read_records(out)) == 4


def test_a_resume_with_other_settings_that_shape_the_answers_is_refused(
    tmp_path, tiny_base, capsys
):
    out = tmp_path / "out"
    recipe = str(recipe_file(tmp_path, tiny_base, _word_prompts(tmp_path), out))
    assert distill.main([recipe, "data.max_new_tokens=2"]) == 0
    written = read_records(out)
    for change, message in (
        ("data.seed=1", "seed: 0 in the manifest, 1 now"),
        ("data.max_length=200", "max_length: 256 in the manifest, 200 now"),
        ("data.system_prompt=Be brief.", "system_prompt: None in the manifest, 'Be brief.' now"),
    ):
        assert distill.main([recipe, "data.max_new_tokens=2", change]) == 2, change
        assert message in capsys.readouterr().err
    assert read_records(out) == written


def test_a_record_without_dropped_turns_has_the_documented_fields_only():
    item = distill.WorkItem("p-0", "file.jsonl:1", [], ["Hi?"], [1, 2], answers=["Hello."])
    assert item.record() == {
        "id": "p-0",
        "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}],
        "finished": True,
        "source": "file.jsonl:1",
    }
    item.dropped_turns = 2
    assert item.record()["dropped_turns"] == 2


def _answer_ok(prompts):
    return [([28], True) for _ in prompts]


def test_a_turn_that_just_fits_max_length_is_answered(smollm2_tokenizer):
    """A prompt of data.max_length - data.max_new_tokens tokens fits, both as a first turn
    (build_items) and as a later one (run_batch); one token more does not."""
    template = distill.resolve_chat_template(smollm2_tokenizer, None)

    def first_turn_tokens(text: str) -> int:
        rendered = distill.render_conversation(
            [{"role": "user", "content": text}],
            smollm2_tokenizer,
            chat_template=template,
            add_generation_prompt=True,
        )
        return len(smollm2_tokenizer(rendered, add_special_tokens=False)["input_ids"])

    n = first_turn_tokens("Hi?")
    for max_length, kept in ((n + 4, 1), (n + 3, 0)):
        recipe = load_recipe(None, ["data.max_new_tokens=4", f"data.max_length={max_length}"])
        item = distill.WorkItem("p-0", "test", [], ["Hi?"], [0] * n)
        distill.run_batch([item], _answer_ok, smollm2_tokenizer, template, recipe)
        assert len(item.answers) == kept and item.dropped_turns == 1 - kept


def test_a_first_turn_that_just_fits_max_length_is_kept(tmp_path, smollm2_tokenizer):
    template = distill.resolve_chat_template(smollm2_tokenizer, None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi?"}) + "\n")
    rendered = distill.render_conversation(
        [{"role": "user", "content": "Hi?"}],
        smollm2_tokenizer,
        chat_template=template,
        add_generation_prompt=True,
    )
    n = len(smollm2_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    for max_length, kept in ((n + 4, 1), (n + 3, 0)):
        recipe = load_recipe(
            None,
            [f"data.sources=[{prompts}]", "data.max_new_tokens=4", f"data.max_length={max_length}"],
        )
        items, counts = distill.build_items(recipe, smollm2_tokenizer, template)
        assert (len(items), counts["too_long_skipped"]) == (kept, 1 - kept)


def test_a_record_the_chat_template_cannot_render_is_skipped_naming_it(
    tmp_path, tiny_base, capsys, caplog
):
    """A ShareGPT record with a system turn, under a template without that role (Gemma's): that
    record is skipped with its file and line (data.on_error=skip), or stops the run there."""
    from tests.train.test_data import GEMMA_TEMPLATE

    (tmp_path / "gemma.jinja").write_text(GEMMA_TEMPLATE)
    prompts = tmp_path / "p.jsonl"
    system = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}]
    lines = [{"prompt": "word"}, {"conversations": system}, {"prompt": "word word"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    template = f"data.chat_template={tmp_path / 'gemma.jinja'}"
    recipe = str(recipe_file(tmp_path, tiny_base, prompts, out))
    assert distill.main([recipe, template, "data.on_error=stop", "data.max_new_tokens=2"]) == 2
    assert "p.jsonl:2: the chat template cannot render" in capsys.readouterr().err
    assert distill.main([recipe, template, "data.max_new_tokens=2"]) == 0
    assert "skipping " in caplog.text and "p.jsonl:2: the chat template cannot" in caplog.text
    assert "1 the chat template cannot render)" in capsys.readouterr().out
    assert len(read_records(out)) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["unrendered_skipped"] == 1 and manifest["complete"]
    # the recipe's system prompt goes in every record: the recipe is what cannot be rendered
    system = "data.system_prompt=Be brief."
    assert distill.main([recipe, template, system, "data.output_dir=" + str(tmp_path / "o2")]) == 2
    assert "data.system_prompt: the chat template cannot render" in capsys.readouterr().err
