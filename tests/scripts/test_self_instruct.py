"""scripts/self_instruct.py: the list prompt, filtering, resume and the model writer."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import self_instruct as si  # noqa: E402  (scripts/ is not a package)

from tests.conftest import make_tiny_llama  # noqa: E402
from train.config import load_recipe  # noqa: E402
from train.prompts import Prompt, PromptSourceError, load_prompts  # noqa: E402


def seeds_file(tmp_path: Path) -> Path:
    lines = [{"prompt": f"Name a colour that rhymes with word {i}."} for i in range(6)]
    lines += [
        {"prompt": "Two\nlines are not shown in a numbered list."},
        {"turns": ["A two-turn", "conversation is not shown either."]},
    ]
    path = tmp_path / "seeds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def recipe(tmp_path: Path, *overrides: str):
    return load_recipe(
        None,
        [
            f"self_instruct.seed_sources=[{seeds_file(tmp_path)}]",
            f"self_instruct.output={tmp_path / 'out' / 'prompts.jsonl'}",
            "self_instruct.examples_per_prompt=3",
            "data.batch_size=4",
            *overrides,
        ],
    )


class Writer:
    """Stands in for the base: answers each list prompt with the next line of a script."""

    def __init__(self, lines):
        self.lines, self.seen = list(lines), []

    def __call__(self, prompts):
        self.seen += prompts
        return [self.lines.pop(0) for _ in prompts]


def test_pools_keep_one_line_single_turn_requests(tmp_path):
    prompts, _ = load_prompts([str(seeds_file(tmp_path))])
    pools = si.seed_pools(prompts)
    assert list(pools) == [str(tmp_path / "seeds.jsonl")]  # a file is one category
    assert len(pools[str(tmp_path / "seeds.jsonl")]) == 6
    from train.prompts import Prompt

    rows = [  # a Hub dataset is one category too, whatever its rows
        Prompt(str(i), [{"role": "user", "content": f"Ask {i}."}], f"hf:org/set:train row {i}")
        for i in range(12)
    ]
    assert {k: len(v) for k, v in si.seed_pools(rows).items()} == {"hf:org/set:train": 12}
    assert si.list_prompt(["Say hi.", "Count to 3."]) == (
        "Requests that users sent to an AI assistant:\n1. Say hi.\n2. Count to 3.\n3."
    )
    assert si.clean(' 4. "Write a poem about rain." ') == "Write a poem about rain."
    assert si.clean("Hi") is None and si.clean("word " * 81) is None


def test_filters_resume_and_extend(tmp_path):
    r = recipe(tmp_path, "self_instruct.num_prompts=3")
    writer = Writer(
        [
            ("Write a short poem about the sea.", True),
            ("Name a colour that rhymes with word 2.", True),  # a seed: near duplicate
            ("Explain how tides work in two sentences and then keep going", False),  # cut
            ("Ok", True),  # too short
            ("What is the boiling point of water at altitude?", True),
            ("Write a short poem about the sea!", True),  # same words as a kept one
            ("Give three tips for learning to juggle.", True),
            ("One more request that is not needed.", True),  # past num_prompts
        ]
    )
    summary = si.self_instruct(r, write=writer)
    assert summary["kept"] == 3
    assert summary["rejected"] == {"near duplicate": 2, "cut at max_new_tokens": 1, "length": 1}
    out = tmp_path / "out" / "prompts.jsonl"
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [k["prompt"] for k in kept] == [
        "Write a short poem about the sea.",
        "What is the boiling point of water at altitude?",
        "Give three tips for learning to juggle.",
    ]
    # Every prompt shown lists 3 seeds and asks for item 4.
    assert all(p.count("\n") == 4 and p.endswith("\n4.") for p in writer.seen)
    # The output is a prompt source as it is.
    prompts, _ = load_prompts([str(out)])
    assert sorted(p.messages[0]["content"] for p in prompts) == sorted(k["prompt"] for k in kept)

    # Done: a rerun writes nothing; a larger num_prompts extends the file.
    assert si.self_instruct(r, write=Writer([]))["kept"] == 3
    more = recipe(tmp_path, "self_instruct.num_prompts=4")
    si.self_instruct(more, write=Writer([("Write a haiku about autumn leaves.", True)] * 4))
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()][:3] == [
        k["prompt"] for k in kept
    ]
    assert len(out.read_text().splitlines()) == 4


def test_everything_rejected_stops_with_a_warning(tmp_path, caplog):
    r = recipe(tmp_path, "self_instruct.num_prompts=1")
    summary = si.self_instruct(r, write=Writer([("Ok", True)] * 100))
    assert summary["kept"] == 0 and "almost every line is rejected" in caplog.text


def test_no_usable_seeds_is_a_clear_error(tmp_path, capsys):
    seeds = tmp_path / "multi.jsonl"
    seeds.write_text(json.dumps({"prompt": "line one\nline two"}) + "\n")
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(json.dumps({"self_instruct": {"seed_sources": [str(seeds)]}}))
    assert si.main([str(recipe_file)]) == 2
    assert "no single-turn one-line requests" in capsys.readouterr().err
    assert si.main([str(recipe_file), "self_instruct.temperature=0"]) == 2
    assert "temperature > 0" in capsys.readouterr().err


def test_model_writer_returns_one_line(smollm2_tokenizer):
    model = make_tiny_llama(seed=1, vocab_size=len(smollm2_tokenizer))
    cfg = load_recipe(None, ["self_instruct.max_new_tokens=12"]).self_instruct
    write = si.transformers_writer(model, smollm2_tokenizer, cfg)
    torch.manual_seed(0)
    out = write([si.list_prompt(["Say hi.", "Count to three."]), si.list_prompt(["Hello."])])
    assert len(out) == 2
    for text, ended in out:
        assert "\n" not in text
        n_tokens = len(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"])
        assert ended or n_tokens >= 10  # cut lines used up (about) max_new_tokens


def test_a_batch_that_keeps_nothing_is_not_drawn_again(tmp_path):
    draws = []

    def writer(prompts):  # rejects everything; records the sampling seed's first draw
        draws.append(torch.randint(1 << 30, ()).item())
        return [("Ok", True)] * len(prompts)

    si.self_instruct(recipe(tmp_path, "self_instruct.num_prompts=1"), write=writer)
    assert len(draws) == 13 and len(set(draws)) == 13  # 50 rejections, batches of 4
    draws_again = list(draws)
    draws.clear()
    si.self_instruct(recipe(tmp_path, "self_instruct.num_prompts=1"), write=writer)
    assert draws == draws_again  # the same command, the same draws


def test_unknown_method_is_a_clear_error(tmp_path, capsys):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("{}")
    assert si.main([str(recipe_file), "self_instruct.method=chat"]) == 2
    assert "must be one of 'list', 'magpie'" in capsys.readouterr().err


def test_kept_prompts_holding_a_line_separator_read_back(tmp_path):
    """The prompt file is written with ensure_ascii=False: a raw U+2028 inside a prompt is not
    a line break of the JSONL file (str.splitlines would split there)."""
    records = [{"prompt": "one\u2028two", "source": "self-instruct"}, {"prompt": "three"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "utf-8")
    assert si.read_kept(path) == records
    for line in ('["a list"]\n', '{"text": "no prompt"}\n'):  # edited by hand
        path.write_text(json.dumps(records[1]) + "\n" + line, "utf-8")
        with pytest.raises(PromptSourceError, match=r"prompts.jsonl:2: not a \{\"prompt\""):
            si.read_kept(path)


def test_seeds_of_at_most_300_characters_are_shown():
    def prompt(text):
        return Prompt(text[:8], [{"role": "user", "content": text}], "seeds.jsonl:1")

    exact, longer = "a" * 300, "b" * 301
    assert si.seed_pools([prompt(exact), prompt(longer)]) == {"seeds.jsonl": [exact]}


def test_clean_keeps_3_to_80_words_and_cuts_only_the_lines_number():
    assert si.clean("Say hi now") == "Say hi now" and si.clean("Say hi") is None
    assert si.clean("word " * 80) == " ".join(["word"] * 80)
    assert si.clean("word " * 81) is None
    assert si.clean("8. Convert 2.5 kg to pounds.") == "Convert 2.5 kg to pounds."
    assert si.clean("List 3. things you see.", numbered=False) == "List 3. things you see."
    assert si.clean("2.5 kg in pounds, please?") == "2.5 kg in pounds, please?"
    assert si.clean("1. Rank the top 10. Then say why.") == "Rank the top 10. Then say why."
    # a quoted request loses its quotes; a request that quotes keeps them
    assert si.clean('3. "Write a poem about rain."') == "Write a poem about rain."
    assert si.clean('4. Explain the phrase "carpe diem"') == 'Explain the phrase "carpe diem"'
    assert si.clean('5. "Hamlet" was written by whom?') == '"Hamlet" was written by whom?'


def test_a_similarity_at_the_threshold_is_no_near_duplicate():
    seen = si.NearDuplicates(0.5)
    seen.add("red green blue")
    assert not seen.near("red green blue cyan magenta yellow")  # 3 / 6 = 0.5: kept
    assert seen.near("red green blue cyan")  # 3 / 4
    same = si.NearDuplicates(1.0)  # max_similarity=1 keeps even the same words
    same.add("Write a short poem.")
    assert not same.near("write a short poem!")


def test_near_duplicates_ignore_case_and_punctuation():
    seen = si.NearDuplicates(0.7)
    seen.add("Write a poem about rain.")
    assert seen.near("WRITE A POEM ABOUT RAIN!")


def test_an_extended_run_rejects_near_duplicates_of_what_it_kept_before(tmp_path):
    si.self_instruct(
        recipe(tmp_path, "self_instruct.num_prompts=1"),
        write=Writer([("Write a short poem about the sea.", True)] * 4),
    )
    summary = si.self_instruct(
        recipe(tmp_path, "self_instruct.num_prompts=2"),
        write=Writer(
            [("Write a short poem about the sea!", True), ("Give three tips for juggling.", True)]
            + [("Ok", True)] * 2
        ),
    )
    assert summary["kept"] == 2
    assert summary["rejected"] == {"near duplicate": 1, "length": 2}
    out = tmp_path / "out" / "prompts.jsonl"
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()] == [
        "Write a short poem about the sea.",
        "Give three tips for juggling.",
    ]


def test_categories_take_turns_across_batches(tmp_path):
    files = []
    for name, word in (("animals", "animal"), ("cities", "city")):
        path = tmp_path / f"{name}.jsonl"
        lines = [{"prompt": f"Tell me about the {word} number {i}."} for i in range(4)]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        files.append(str(path))
    requests = [
        "Write a haiku about rain.",
        "Plan a trip to Rome.",
        "Explain photosynthesis simply.",
        "Name three prime numbers.",
    ]
    writer = Writer([(r, True) for r in requests])
    r = recipe(
        tmp_path,
        f"self_instruct.seed_sources=[{files[0]},{files[1]}]",
        "self_instruct.num_prompts=4",
        "data.batch_size=1",
    )
    si.self_instruct(r, write=writer)
    kept = [json.loads(x) for x in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()]
    assert [k["category"] for k in kept] == [files[0], files[1], files[0], files[1]]
    # each prompt shown lists seeds of its own category
    assert ["animal" in p for p in writer.seen] == [True, False, True, False]
    assert ["city" in p for p in writer.seen] == [False, True, False, True]


def test_a_seed_pool_smaller_than_examples_per_prompt_is_shown_whole(tmp_path):
    writer = Writer([("Write a short poem about the sea.", True)] * 4)
    r = recipe(tmp_path, "self_instruct.num_prompts=1", "self_instruct.examples_per_prompt=10")
    assert si.self_instruct(r, write=writer)["kept"] == 1
    assert all(p.endswith("\n7.") for p in writer.seen)  # the 6 usable seeds, then item 7


def test_a_line_cut_at_max_new_tokens_counts_as_cut_whatever_its_length(tmp_path):
    writer = Writer(
        [("Ok", False), ("Write a short poem about the sea.", True)] + [("Ok", True)] * 2
    )
    summary = si.self_instruct(recipe(tmp_path, "self_instruct.num_prompts=1"), write=writer)
    assert summary["rejected"] == {"cut at max_new_tokens": 1, "length": 2}


def test_a_run_stops_after_more_than_50_rejections_per_prompt(tmp_path):
    calls = []

    def writer(prompts):
        calls.append(len(prompts))
        return [("Ok", True)] * len(prompts)

    r = recipe(tmp_path, "self_instruct.num_prompts=1", "data.batch_size=5")
    assert si.self_instruct(r, write=writer)["rejected"] == {"length": 55}
    assert calls == [5] * 11  # 50 rejected is not yet "more than 50"


def test_a_file_holding_both_methods_prompts_is_refused(tmp_path):
    out = tmp_path / "out" / "prompts.jsonl"
    out.parent.mkdir()
    records = [
        {"prompt": "Write a short poem about the sea.", "category": "seeds.jsonl"},
        {"prompt": "What should I pack for a hike?", "category": "magpie"},
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(PromptSourceError, match="other self_instruct method"):
        si.self_instruct(recipe(tmp_path, "self_instruct.num_prompts=3"), write=Writer([]))


def test_a_kept_line_whose_prompt_is_no_text_is_a_clear_error(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": 3, "category": "x"}) + "\n")
    with pytest.raises(PromptSourceError, match=r"prompts.jsonl:1: not a \{\"prompt\""):
        si.read_kept(path)


def test_main_reports_the_kept_and_rejected_counts(tmp_path, capsys, monkeypatch):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("{}")
    for rejected, said in [
        ({}, "(rejected: none)"),
        ({"near duplicate": 2, "length": 1}, "(rejected: 1 length, 2 near duplicate)"),
    ]:
        summary = {"kept": 4, "rejected": rejected, "output": "o.jsonl"}
        monkeypatch.setattr(si, "self_instruct", lambda r, s=summary: s)
        assert si.main([str(recipe_file)]) == 0
        assert capsys.readouterr().out == f"4 prompts in o.jsonl {said}\n"


def _scripted_model(tokenizer, continuation: str):
    """A tiny model whose generate appends `continuation`'s tokens to every row."""
    model = make_tiny_llama(seed=1, vocab_size=len(tokenizer))
    new = torch.tensor(tokenizer(continuation, add_special_tokens=False)["input_ids"])

    def generate(input_ids, **kwargs):
        return torch.cat([input_ids, new.expand(len(input_ids), -1)], dim=1)

    model.generate = generate
    return model


def test_a_list_line_ended_by_its_newline_counts_as_ended(smollm2_tokenizer):
    model = _scripted_model(smollm2_tokenizer, "Say hello to me\nand more")  # no EOS
    cfg = load_recipe(None, ["self_instruct.max_new_tokens=32"]).self_instruct
    write = si.transformers_writer(model, smollm2_tokenizer, cfg)
    assert write([si.list_prompt(["Say hi."])]) == [("Say hello to me", True)]


def test_special_tokens_are_left_out_of_a_request(smollm2_tokenizer):
    model = _scripted_model(smollm2_tokenizer, "Say<|im_start|> hello to me\n")
    cfg = load_recipe(None, ["self_instruct.max_new_tokens=32"]).self_instruct
    write = si.transformers_writer(model, smollm2_tokenizer, cfg)
    assert write([si.list_prompt(["Say hi."])]) == [("Say hello to me", True)]


def test_a_rerun_under_other_settings_is_refused_and_ctrl_c_is_one_line(
    tmp_path, capsys, monkeypatch
):
    """The prompts kept came from the recorded settings: adding others' to them would make a
    file no command writes; num_prompts may grow."""
    r = recipe(tmp_path, "self_instruct.num_prompts=1")
    si.self_instruct(r, write=Writer([("Write a short poem about the sea.", True)] * 4))
    recorded = json.loads((tmp_path / "out" / "prompts.jsonl.settings.json").read_text())
    assert recorded["temperature"] == 1.0 and "num_prompts" not in recorded
    hotter = recipe(tmp_path, "self_instruct.num_prompts=2", "self_instruct.temperature=1.3")
    with pytest.raises(PromptSourceError, match=r"temperature: 1.0 there, 1.3 now\): rerun"):
        si.self_instruct(hotter, write=Writer([]))
    more = recipe(tmp_path, "self_instruct.num_prompts=2")
    assert (
        si.self_instruct(more, write=Writer([("Name three rivers in Asia.", True)] * 4))["kept"]
        == 2
    )

    def interrupted(recipe):
        raise KeyboardInterrupt

    monkeypatch.setattr(si, "self_instruct", interrupted)
    (tmp_path / "r.yaml").write_text("{}")
    assert si.main([str(tmp_path / "r.yaml")]) == 130
    assert "self_instruct interrupted: the prompts kept are in the file" in capsys.readouterr().err
