"""scripts/distill.py end to end on a tiny random Llama that uses the embedded tokenizer."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest

from train.config import load_recipe
from train.lock import LOCK_NAME

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "distill.py"
sys.path.insert(0, str(SCRIPT.parent))
import bench  # noqa: E402  (scripts/ is not a package)
import distill  # noqa: E402


def prompts_file(tmp_path: Path, n: int = 6) -> Path:
    lines = [json.dumps({"prompt": f"Question number {i}: name a colour."}) for i in range(n)]
    lines.append(json.dumps({"turns": ["Pick a number.", "Now double it."]}))  # multi-turn
    lines.append(
        json.dumps(
            {
                "conversations": [
                    {"from": "system", "value": "You are a pirate."},
                    {"from": "human", "value": "Greet me."},
                    {"from": "gpt", "value": "an old answer that must be regenerated"},
                ]
            }
        )
    )
    lines.append("{this line is broken")
    lines.append(json.dumps({"prompt": "word " * 400}))  # longer than max_length
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def recipe_file(tmp_path: Path, base: Path, prompts: Path, out: Path, **data) -> Path:
    settings = {
        "sources": [str(prompts)],
        "max_new_tokens": 6,
        "batch_size": 3,
        "max_length": 256,
        "records_per_shard": 2,
        "output_dir": str(out),
        **data,
    }
    recipe = {"model": {"name_or_path": str(base)}, "data": settings}
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def read_records(out: Path) -> list[dict]:
    return [
        json.loads(line)
        for p in sorted(out.glob("shard-*.jsonl"))
        for line in p.read_text().splitlines()
    ]


def test_distill_end_to_end(tmp_path, tiny_base, capsys):
    out = tmp_path / "out"
    recipe = recipe_file(tmp_path, tiny_base, prompts_file(tmp_path), out)
    assert distill.main([str(recipe)]) == 0
    assert "malformed records skipped" in capsys.readouterr().out

    records = read_records(out)
    assert len(records) == 8 and len({r["id"] for r in records}) == 8
    shards = sorted(p.name for p in out.glob("shard-*.jsonl"))
    assert shards == [f"shard-r000-{i:05d}.jsonl" for i in range(4)]
    assert not list(out.glob(".*tmp"))
    for record in records:
        roles = [t["from"] for t in record["conversations"]]
        assert roles[0] in ("human", "system") and roles[-1] == "gpt"
        assert record["finished"] is False  # a random model never says <|im_end|> in 6 tokens
    by_first_user = {
        next(t["value"] for t in r["conversations"] if t["from"] == "human"): r for r in records
    }
    multi = by_first_user["Pick a number."]["conversations"]
    assert [t["from"] for t in multi] == ["human", "gpt", "human", "gpt"]
    assert multi[2]["value"] == "Now double it."
    pirate = by_first_user["Greet me."]["conversations"]
    assert pirate[0] == {"from": "system", "value": "You are a pirate."}
    assert pirate[2]["value"] != "an old answer that must be regenerated"

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["backend"] == "transformers"
    assert manifest["base_model"] == str(tiny_base) and manifest["dtype"] == "float32"
    assert (
        manifest["settings"]["max_new_tokens"] == 6 and manifest["settings"]["temperature"] == 0.0
    )
    assert manifest["chat_template"] == (tiny_base / "chat_template.jinja").read_text()
    assert manifest["counts"] == {
        "prompts": 9,
        "malformed_skipped": 1,
        "too_long_skipped": 1,
        "unrendered_skipped": 0,
        "records_expected": 8,
        "records_written": 8,
        "unfinished": 8,
        "turns_dropped_too_long": 0,
    }

    # Running again does nothing; changing a generation setting is refused.
    assert distill.main([str(recipe)]) == 0
    assert read_records(out) == records
    assert distill.main([str(recipe), "data.max_new_tokens=7"]) == 2
    assert "max_new_tokens: 6 in the manifest, 7 now" in capsys.readouterr().err


def test_sampled_answers_are_computed_in_bf16_where_the_cpu_computes_it(
    tmp_path, tiny_base, monkeypatch
):
    """model.dtype=auto on a CPU with bf16 instructions: sampled answers in bf16, recorded so;
    greedy ones in fp32 (the base's exact greedy output)."""
    import train.precision

    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: True)
    recipe = str(recipe_file(tmp_path, tiny_base, prompts_file(tmp_path), tmp_path / "out"))
    for temperature, dtype in (("0.7", "bfloat16"), ("0", "float32")):
        out = tmp_path / f"out-{temperature}"
        args = [f"data.temperature={temperature}", f"data.output_dir={out}", "data.limit=2"]
        assert distill.main([recipe, *args]) == 0
        assert json.loads((out / "manifest.json").read_text())["dtype"] == dtype
        assert len(read_records(out)) == 2


def test_a_larger_limit_extends_a_run(tmp_path, tiny_base, capsys):
    out = tmp_path / "out"
    recipe = str(recipe_file(tmp_path, tiny_base, prompts_file(tmp_path), out))
    assert distill.main([recipe, "data.limit=3"]) == 0
    first = read_records(out)
    assert len(first) == 3
    assert distill.main([recipe, "data.limit=6"]) == 0
    grown = read_records(out)
    assert len(grown) == len({r["id"] for r in grown}) == 6  # 3 more, none twice
    assert [r for r in grown if r["id"] in {f["id"] for f in first}] == first
    assert json.loads((out / "manifest.json").read_text())["settings"]["limit"] == 6
    assert distill.main([recipe, "data.limit=4"]) == 2  # a smaller limit is a different set
    assert "limit: 6 in the manifest, 4 now" in capsys.readouterr().err


def test_a_new_folder_written_meanwhile_by_another_run_is_checked_again(
    tmp_path, tiny_base, capsys, monkeypatch
):
    """Two runs started on one new folder: the other one made it and finished while this one
    loaded its base, with other settings; this one refuses it once it holds the folder."""
    other, out = tmp_path / "other", tmp_path / "out"
    recipe = str(recipe_file(tmp_path, tiny_base, prompts_file(tmp_path), out))
    assert distill.main([recipe, "data.limit=2", f"data.output_dir={other}"]) == 0
    written = {p.name: p.read_bytes() for p in other.iterdir() if p.name != LOCK_NAME}
    build_items = distill.build_items

    def the_other_run_ends_meanwhile(*args, **kwargs):
        shutil.copytree(other, out)
        return build_items(*args, **kwargs)

    monkeypatch.setattr(distill, "build_items", the_other_run_ends_meanwhile)
    assert distill.main([recipe, "data.limit=2", "data.max_new_tokens=5"]) == 2
    assert "max_new_tokens: 6 in the manifest, 5 now" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK_NAME} == written


def test_more_samples_per_prompt_extend_a_run(tmp_path, tiny_base, capsys):
    out = tmp_path / "out"
    recipe = str(recipe_file(tmp_path, tiny_base, prompts_file(tmp_path), out, temperature=0.7))
    assert distill.main([recipe, "data.limit=3"]) == 0
    first = read_records(out)
    assert distill.main([recipe, "data.limit=3", "data.num_samples=2"]) == 0
    grown = read_records(out)
    assert len(grown) == len({r["id"] for r in grown}) == 6
    assert [r for r in grown if r["id"] in {f["id"] for f in first}] == first  # kept, not redone
    assert {r["id"].removesuffix("-1") for r in grown if r["id"].endswith("-1")} == {
        f["id"].removesuffix("-0") for f in first
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["num_samples"] == 2
    assert manifest["complete"] is True
    assert distill.main([recipe, "data.limit=3"]) == 2  # fewer samples would leave some out
    assert "num_samples: 2 in the manifest, 1 now" in capsys.readouterr().err


def test_answers_are_added_under_their_own_template_and_the_backends_are_recorded(
    tmp_path, tiny_base, capsys
):
    """A changed chat template (a tokenizer update, an edited data.chat_template file) would
    mix two renderings in one folder: refused. A run continued on the other backend, or in
    another dtype (model.dtype=auto on another machine), says so and the manifest names both."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    out = tmp_path / "out"
    recipe = str(recipe_file(tmp_path, base, prompts_file(tmp_path), out))
    assert distill.main([recipe, "data.limit=3"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["backend"] = "vllm"  # as if the first answers came from vLLM
    manifest["dtype"] = "bfloat16"  # on a GPU, where model.dtype=auto is bf16
    (out / "manifest.json").write_text(json.dumps(manifest))
    template = base / "chat_template.jinja"
    own = template.read_text()
    template.write_text(own.replace("<|im_start|>", "<|im_start|> "))
    capsys.readouterr()
    assert distill.main([recipe, "data.limit=6"]) == 2
    assert "answers written under another chat template" in capsys.readouterr().err
    assert len(read_records(out)) == 3  # nothing added
    template.write_text(own)
    assert distill.main([recipe, "data.limit=6"]) == 0
    printed = capsys.readouterr().out
    assert "written by vllm, these written by transformers" in printed
    assert "computed in bfloat16, these computed in float32" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "transformers+vllm"
    assert manifest["dtype"] == "bfloat16+float32"
    assert len(read_records(out)) == 6


def test_a_run_begun_with_shuffled_prompts_extends_in_its_order(tmp_path, tiny_base):
    """A folder whose manifest predates the hash order (no settings.order) keeps its shuffle:
    a larger limit adds prompts to those answered, not another selection beside them."""
    out = tmp_path / "out"
    prompts = prompts_file(tmp_path)
    recipe = str(recipe_file(tmp_path, tiny_base, prompts, out))
    assert distill.main([recipe, "data.limit=3"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["order"] == "prompt-hash"
    del manifest["settings"]["order"]  # as an earlier headstart wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    for f in out.glob("shard-*.jsonl"):
        f.unlink()  # answers to the shuffle's first 3, as that headstart chose them
    shuffled, _ = distill.load_prompts([str(prompts)], limit=5, seed=0, order="shuffle")
    assert distill.main([recipe, "data.limit=5"]) == 0
    system_prompt = load_recipe(recipe).data.system_prompt
    want = {
        distill.record_id(
            distill.conversation_id(distill.asked_turns(p.messages, system_prompt)), 0
        )
        for p in shuffled
    }
    assert {r["id"] for r in read_records(out)} == want
    assert "order" not in json.loads((out / "manifest.json").read_text())["settings"]
    assert distill.main([recipe]) == 0  # no limit: every prompt
    assert len(read_records(out)) == 8


def test_more_sources_extend_a_run_without_a_limit(tmp_path, tiny_base, capsys):
    out = tmp_path / "out"
    first_file = prompts_file(tmp_path, n=3)
    more = tmp_path / "more.jsonl"
    more.write_text('{"prompt": "Name a river."}\n{"prompt": "Name a mountain."}\n')
    recipe = str(recipe_file(tmp_path, tiny_base, first_file, out))
    assert distill.main([recipe]) == 0
    first = read_records(out)
    both = f"data.sources=[{first_file}, {more}]"
    assert distill.main([recipe, both, "data.limit=4"]) == 2  # a limit draws another set
    assert "sources:" in capsys.readouterr().err
    assert distill.main([recipe, both]) == 0
    grown = read_records(out)
    assert len(grown) == len({r["id"] for r in grown}) == len(first) + 2
    assert [r for r in grown if r["id"] in {f["id"] for f in first}] == first  # kept, not redone
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["sources"] == [str(first_file), str(more)]
    assert manifest["complete"] is True
    assert distill.main([recipe, f"data.sources=[{more}]"]) == 2  # dropping a source is refused
    assert "sources:" in capsys.readouterr().err


def test_either_spelling_of_embedded_all_resumes_the_other(tmp_path):
    spelled_out = '[embedded, "embedded:roleplay,reasoning,knowledge,compositions"]'
    settings = [
        distill.generation_settings(load_recipe("recipes/tiny-distill.yaml", [f"data.sources={s}"]))
        for s in ("[embedded:all]", spelled_out)
    ]
    assert settings[0] == settings[1]
    (tmp_path / "manifest.json").write_text(json.dumps({"settings": settings[1]}))
    distill.check_manifest(tmp_path, settings[0])  # no DistillError
    other = distill.generation_settings(
        load_recipe("recipes/tiny-distill.yaml", ["data.sources=[embedded]"])
    )
    with pytest.raises(distill.DistillError, match="sources"):
        distill.check_manifest(tmp_path, other)


def test_several_samples_per_prompt(tmp_path, tiny_base):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a fruit."}\n{"prompt": "Name a tree."}\n')
    out = tmp_path / "out"
    recipe = recipe_file(
        tmp_path, tiny_base, prompts, out, temperature=0.9, top_p=0.95, num_samples=3
    )
    assert distill.main([str(recipe), "data.max_new_tokens=3"]) == 0
    ids = [r["id"] for r in read_records(out)]
    assert len(ids) == 3 * 2 == len(set(ids))
    assert {i.rsplit("-", 1)[1] for i in ids} == {"0", "1", "2"}
    assert json.loads((out / "manifest.json").read_text())["settings"]["num_samples"] == 3


def test_a_sample_regenerated_on_resume_does_not_repeat_its_sibling(tmp_path, tiny_base):
    """One batch of one record at a time: a resumed run that regenerates sample 1 first would
    draw it as sample 0 was first drawn, from the same seed, were the seed not moved on."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a colour."}\n')
    out = tmp_path / "out"
    settings = dict(temperature=0.7, num_samples=2, batch_size=1, records_per_shard=1)
    recipe = recipe_file(tmp_path, tiny_base, prompts, out, max_new_tokens=12, **settings)
    assert distill.main([str(recipe)]) == 0
    for shard in out.glob("shard-*.jsonl"):  # killed before sample 1's shard was written
        if json.loads(shard.read_text())["id"].endswith("-1"):
            shard.unlink()
    assert distill.main([str(recipe)]) == 0
    answers = {r["id"][-1]: r["conversations"][-1]["value"] for r in read_records(out)}
    assert len(answers) == 2 and answers["0"] != answers["1"]


def test_context_full_drops_later_turns(tmp_path, tiny_base, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["short", "word " * 60]}) + "\n")
    out = tmp_path / "out"
    # first turn fits (about 30 + 6 tokens), the second does not
    assert distill.main([str(recipe_file(tmp_path, tiny_base, prompts, out, max_length=80))]) == 0
    (record,) = read_records(out)
    assert [t["from"] for t in record["conversations"]] == ["human", "gpt"]
    assert record["dropped_turns"] == 1
    assert json.loads((out / "manifest.json").read_text())["counts"]["turns_dropped_too_long"] == 1
    assert "1 later turns of multi-turn prompts were not answered" in capsys.readouterr().out


def test_bad_input_is_a_clear_error(tmp_path, tiny_base, capsys, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert distill.main([str(recipe_file(tmp_path, tiny_base, empty, tmp_path / "o"))]) == 2
    assert "is empty" in capsys.readouterr().err
    recipe = recipe_file(
        tmp_path, tiny_base, prompts_file(tmp_path), tmp_path / "o", on_error="stop"
    )
    assert distill.main([str(recipe)]) == 2
    assert "prompts.jsonl:9: invalid JSON" in capsys.readouterr().err
    assert distill.main([str(recipe), "data.tempreature=1"]) == 2
    assert "Did you mean 'temperature'" in capsys.readouterr().err
    # every prompt too long: said, and nothing written (training would find no shards)
    no_room = [str(recipe), "data.on_error=skip", "data.max_new_tokens=300", "data.max_length=256"]
    assert distill.main(no_room) == 2
    said = capsys.readouterr().err
    assert "prompts can be answered: " in said and "are too long (a prompt must fit in" in said
    assert not (tmp_path / "o").exists()
    # a base that is neither here nor on the Hub (offline here: the Hub cannot be asked)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert distill.main([str(recipe), "model.name_or_path=nobody/no-such-model"]) == 2
    assert "distill failed: " in (err := capsys.readouterr().err) and "nobody/no-such-model" in err
    assert distill.main([str(recipe), "model.name_or_path=./no-such-model"]) == 2
    assert "base model folder not found: ./no-such-model" in capsys.readouterr().err


def test_kill_9_then_resume_loses_and_duplicates_nothing(tmp_path, tiny_base):
    out = tmp_path / "out"
    recipe = recipe_file(tmp_path, tiny_base, prompts_file(tmp_path, n=6), out, batch_size=2)
    command = [sys.executable, str(SCRIPT), str(recipe)]
    env = {**os.environ, distill.DELAY_ENV: "0.5"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(list(out.glob("shard-*.jsonl"))) < 2:
            assert proc.poll() is None, "distill ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = {p.name: p.read_text() for p in out.glob("shard-*.jsonl")}
    assert 4 <= sum(len(t.splitlines()) for t in before.values()) < 8
    assert json.loads((out / "manifest.json").read_text())["complete"] is False

    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote 8 of 8 records" in done.stdout
    ids = [r["id"] for r in read_records(out)]
    assert len(ids) == 8 == len(set(ids))
    for name, text in before.items():  # finished shards are kept as they were
        assert (out / name).read_text() == text
    assert json.loads((out / "manifest.json").read_text())["complete"] is True


@pytest.mark.slow
def test_distill_embedded_smollm2(tmp_path):
    out = tmp_path / "out"
    overrides = [
        f"data.output_dir={out}",
        "data.limit=3",
        "data.max_new_tokens=24",
        "data.sources=embedded:qa",
    ]
    assert distill.main([str(ROOT / "recipes" / "tiny-distill.yaml"), *overrides]) == 0
    records = read_records(out)
    assert len(records) == 3
    assert all(
        r["conversations"][-1]["from"] == "gpt" and r["conversations"][-1]["value"].strip()
        for r in records
    )
    assert (
        json.loads((out / "manifest.json").read_text())["base_model"]
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


@pytest.mark.slow
def test_bench_distill_splits_the_batched_run_over_processes(tiny_base, tmp_path):
    """bench_distill --processes 2: two spawned processes share the prompts the way torchrun
    splits distill.py's work, and together answer every prompt the one-process run answers."""
    import bench_distill

    out = tmp_path / "bench.json"
    argv = ["--base", str(tiny_base), "--prompts", "6", "--unbatched", "1"]
    argv += ["--max-new-tokens", "4", "--batch-size", "2", "--processes", "1", "2"]
    argv += ["--chunk-tokens", "0", "2"]
    assert bench_distill.main([*argv, "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["batched"]
    assert [(r["chunk_tokens"], r["processes"]) for r in runs] == [(0, 1), (0, 2), (2, 1), (2, 2)]
    assert all(r["threads_per_process"] >= 1 and r["prompts"] == 6 for r in runs)
    # Greedy: as many answer tokens, however split over processes and calls.
    assert len({r["tokens"] for r in runs}) == 1 and runs[0]["tokens"] > 0
    assert all(r["tokens_per_s"] > 0 and "start" not in r for r in runs)


@pytest.mark.parametrize("system_prompt", [None, "Be brief."])
def test_bench_exclude_leaves_the_prompts_distill_did_not_answer(
    tmp_path, tiny_base, system_prompt
):
    lines = prompts_file(tmp_path).read_text().splitlines()
    clean = tmp_path / "clean.jsonl"  # the well-formed prompts: multi-turn and system included
    clean.write_text(
        "\n".join(line for line in lines if "{this" not in line and "word " not in line)
    )
    every = bench.read_prompts(str(clean))
    assert len(every) == 8
    all_out, some_out = tmp_path / "all", tmp_path / "some"
    recipe = recipe_file(tmp_path, tiny_base, clean, all_out, system_prompt=system_prompt)
    assert distill.main([str(recipe)]) == 0
    with pytest.raises(bench.BenchError, match="every prompt"):
        bench.read_prompts(str(clean), exclude=bench.read_distilled(str(all_out)))
    recipe = recipe_file(tmp_path, tiny_base, clean, some_out, system_prompt=system_prompt)
    assert distill.main([str(recipe), "data.limit=3"]) == 0
    asked = {
        next(t["value"] for t in r["conversations"] if t["from"] == "human")
        for r in read_records(some_out)
    }
    held_out = bench.read_prompts(str(clean), exclude=bench.read_distilled(str(some_out)))
    assert len(asked) == 3 and len(held_out) == 5
    assert {p.users[0] for p in held_out} == {p.users[0] for p in every} - asked


@pytest.mark.parametrize("script", ["distill", "self_instruct", "eval_heads"])
def test_without_arguments_only_the_required_ones_are_asked_for(script, capsys):
    import eval_heads
    import self_instruct

    main = {"distill": distill, "self_instruct": self_instruct, "eval_heads": eval_heads}[script]
    with pytest.raises(SystemExit) as stop:
        main.main([])
    assert stop.value.code == 2
    required = "recipe, heads" if script == "eval_heads" else "recipe"  # not the overrides
    assert capsys.readouterr().err.endswith(f"the following arguments are required: {required}\n")
