"""scripts/bench.py's inputs: what the prompts read are, how each turn of each method is
asked, the flags' defaults and refusals, and the first-turn context checks of main."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.scripts.test_bench import MT_BENCH, _jsonl, bench


def test_humaneval_limit_and_per_category_count_problems():
    ids = [p.id for p in bench.read_prompts("humaneval", limit=3)]
    assert ids == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert [p.id for p in bench.read_prompts("humaneval", k_per_category=2)] == [
        "HumanEval/0",
        "HumanEval/1",
    ]
    assert len(bench.read_prompts("humaneval", limit=3, k_per_category=2)) == 2


def test_a_prompt_keeps_its_file_position_through_per_category(tmp_path):
    """The position seeds a prompt's sampled runs: a prompt is drawn the same however many of
    the others are benchmarked with it."""
    records = [{"question_id": i, "category": "aab"[i % 3], "turns": [f"Q{i}?"]} for i in range(6)]
    path = str(_jsonl(tmp_path / "q.jsonl", records))
    assert [p.index for p in bench.read_prompts(path)] == [0, 1, 2, 3, 4, 5]
    assert [p.index for p in bench.read_prompts(path, k_per_category=1)] == [0, 2]


def test_a_records_question_id_names_it_before_its_id(tmp_path):
    """MT-bench's question_id is what its judgments are keyed by, whatever other id it has."""
    records = [
        {"question_id": 81, "id": "conv-1", "turns": ["Hi?"]},
        {"id": "conv-2", "turns": ["Yo?"]},
    ]
    prompts = bench.read_prompts(str(_jsonl(tmp_path / "q.jsonl", records)))
    assert [p.id for p in prompts] == [81, "conv-2"]


def test_a_prompt_ends_ready_for_the_assistants_turn(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi?"}]
    text = smollm2_tokenizer.decode(bench.prompt_ids(messages, smollm2_tokenizer)[0])
    assert text.endswith("Hi?<|im_end|>\n<|im_start|>assistant\n")


def _scripted(name: str, answers: dict[int, str], tokenizer, asked: list, seeds: list):
    """A greedy Method answering turn t (counted by its calls) with `answers[t]`; it notes the
    conversation it was given and the seed."""
    from bench_methods import Method, Run

    def generate(ids, seed, max_new_tokens=None):
        asked.append((name, tokenizer.decode(ids[0])))
        seeds.append((name, seed))
        turn = sum(1 for n, _ in asked if n == name) - 1
        return Run(tokenizer(answers[turn], add_special_tokens=False).input_ids)

    return Method(name, "baseline", generate, torch.device("cpu"), True)


def test_each_method_is_asked_in_its_own_conversation_with_a_seed_per_prompt_and_turn(
    smollm2_tokenizer,
):
    tok = smollm2_tokenizer
    asked, seeds = [], []
    methods = [
        _scripted("baseline", {0: "Apples.", 1: "Done."}, tok, asked, seeds),
        _scripted("other", {0: "Bananas.", 1: "Done."}, tok, asked, seeds),
    ]
    system = [{"role": "system", "content": "Be a grocer."}]
    prompt = bench.BenchPrompt(7, "q7", "c", "x", system, ["Name a fruit.", "Another?"])
    records = bench.run_bench([prompt], methods, tok, 1, 5)
    assert [(r["turn"], r["method"]) for r in records] == [
        (0, "baseline"),
        (0, "other"),
        (1, "baseline"),
        (1, "other"),
    ]
    second = dict(asked[2:])  # turn 2 of each method
    assert "Be a grocer." in second["baseline"] and "Be a grocer." in second["other"]
    assert "Apples." in second["baseline"] and "Bananas." not in second["baseline"]
    assert "Bananas." in second["other"] and "Apples." not in second["other"]
    # the seed: --seed + 1000 x the prompt's position + the turn
    assert sorted(set(seeds)) == [
        ("baseline", 7005),
        ("baseline", 7006),
        ("other", 7005),
        ("other", 7006),
    ]


def test_a_turn_is_skipped_with_the_turns_after_it_once_any_methods_prompt_passes_room(
    smollm2_tokenizer, capsys
):
    """The second turn's prompt holds each method's own first answer: the method whose long
    answer makes it pass `room` skips that turn for every method, and the turn after it too."""
    tok = smollm2_tokenizer
    asked, seeds = [], []
    long_answer = "word " * 50
    methods = [
        _scripted("baseline", {0: "Yes.", 1: "Yes.", 2: "Yes."}, tok, asked, seeds),
        _scripted("other", {0: long_answer, 1: "Yes.", 2: "Yes."}, tok, asked, seeds),
    ]
    prompt = bench.BenchPrompt(0, "q0", "c", "x", [], ["Hi.", "Again?", "And?"])
    first = bench.first_turn_ids(prompt, tok).shape[1]
    records = bench.run_bench([prompt], methods, tok, 1, 0, room=first + 30)
    assert {r["turn"] for r in records} == {0}
    assert "prompt q0 turn 2: skipped" in capsys.readouterr().err
    # a turn whose longest prompt is exactly `room` tokens long is run
    records = bench.run_bench([prompt], methods[:1], tok, 1, 0, room=first)
    assert len(records) == 1 and records[0]["prompt_tokens"] == first


def test_flag_defaults():
    args = bench.parse_args(["--prompts", "embedded"])
    assert (args.max_new_tokens, args.runs, args.turns, args.lookup_tokens) == (128, 1, "first", 4)
    assert (args.attn, args.dtype, args.temperature, args.top_p) == ("sdpa", "auto", 0.0, 1.0)
    assert (args.seed, args.out, args.limit, args.per_category) == (0, "runs/bench", None, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens, --runs, --limit and --per-category"),
        (["--runs", "0"], "--max-new-tokens, --runs, --limit and --per-category"),
        (["--limit", "0"], "--max-new-tokens, --runs, --limit and --per-category"),
        (["--per-category", "0"], "--max-new-tokens, --runs, --limit and --per-category"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--eagle-top-k", "0"], "--lookup-tokens, --eagle-top-k and --eagle-total-tokens"),
        (["--eagle-total-tokens", "0"], "--lookup-tokens, --eagle-top-k and --eagle-total-tokens"),
        (["--eagle-depth", "-1"], "--eagle-depth >= 0"),
        (["--temperature", "nan"], "need --temperature >= 0 (0: greedy)"),
        (["--temperature", "inf"], "need --temperature >= 0 (0: greedy)"),
    ],
)
def test_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--prompts", "embedded", *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_smallest_allowed_values_are_accepted():
    args = bench.parse_args(
        ["--prompts", "embedded", "--eagle-depth", "0", "--temperature", "0", "--top-p", "1"]
    )
    assert (args.eagle_depth, args.temperature, args.top_p) == (0, 0.0, 1.0)


def test_threads_sets_torchs_threads(tmp_path, monkeypatch):
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    assert bench.main(["--prompts", str(tmp_path / "nope.jsonl"), "--threads", "3"]) == 2
    assert threads == [3]


def _main(folders, tmp_path, records, *extra) -> int:
    prompts = _jsonl(tmp_path / "p.jsonl", records)
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--threads", "1"]
    return bench.main([*argv, "--methods", "baseline", "--out", str(tmp_path / "out"), *extra])


def test_a_first_turn_that_just_fits_is_benchmarked(folders, tmp_path, smollm2_tokenizer, capsys):
    """One token more is refused, and the refusal names the most --max-new-tokens that fits."""
    records = [{"turns": ["word " * 2000]}]  # a long prompt: few new tokens fit
    prompt = bench.read_prompts(str(_jsonl(tmp_path / "q.jsonl", records)))[0]
    tokens = bench.first_turn_ids(prompt, smollm2_tokenizer).shape[1]
    assert _main(folders, tmp_path, records, "--max-new-tokens", str(2049 - tokens)) == 2
    most = re.search(r"give at most (\d+)", capsys.readouterr().err)
    assert most is not None and int(most.group(1)) == 2048 - tokens
    assert _main(folders, tmp_path, records, "--max-new-tokens", str(2048 - tokens)) == 0
    (record,) = json.loads((tmp_path / "out" / "results.json").read_text())["records"]
    assert record["prompt_tokens"] == tokens


def test_a_prompt_as_long_as_the_context_needs_shorter_prompts(
    folders, tmp_path, smollm2_tokenizer, capsys
):
    def tokens(n: int) -> int:
        prompt = bench.BenchPrompt(0, 0, "all", "x", [], ["word " * n])
        return bench.first_turn_ids(prompt, smollm2_tokenizer).shape[1]

    n = 2048 - tokens(0)
    while tokens(n) > 2048:  # " word" is one token, but the template's own may merge
        n -= 1
    assert tokens(n) == 2048  # the base's whole context
    assert _main(folders, tmp_path, [{"turns": ["word " * n]}], "--max-new-tokens", "1") == 2
    assert "every prompt is longer than the base's context (2048" in capsys.readouterr().err


def test_only_the_first_turn_must_fit_before_timing(folders, tmp_path, capsys):
    """--turns all: a later turn past the context is skipped, it does not stop the run."""
    records = [{"turns": ["Hi.", "word " * 2100]}]
    assert _main(folders, tmp_path, records, "--turns", "all", "--max-new-tokens", "2") == 0
    assert "turn 2: skipped" in capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["turn"] for r in results["records"]] == [0]


def test_plots_an_earlier_run_drew_and_this_one_does_not_are_removed(folders, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("accepted_lengths.png", "medusa_head_accuracy.png"):
        (out / name).write_bytes(b"an earlier run's plot")
    assert _main(folders, tmp_path, MT_BENCH[:1], "--max-new-tokens", "2") == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["speedup.png", "tau_by_category.png"]


def test_heads_methods_are_named_after_their_runs_and_told_apart_by_the_folders_above(
    tmp_path, monkeypatch
):
    from bench_methods import heads_names

    monkeypatch.chdir(tmp_path)
    for folder in ("runs/a/heads", "exp/c/a/heads", "runs/eagle", "exp2/a"):
        (tmp_path / folder).mkdir(parents=True)
    names = heads_names(["runs/a/heads", "exp/c/a/heads", "runs/eagle", "exp2/a"])
    assert names == {
        "runs/a/heads": "runs/a",
        "exp/c/a/heads": "c/a",
        "runs/eagle": "eagle",
        "exp2/a": "exp2/a",
    }
    assert heads_names(["me/medusa-demo"]) == {"me/medusa-demo": "medusa-demo"}  # a Hub id
    assert heads_names(["me/heads"]) == {"me/heads": "heads"}  # no local OUTPUT/heads
    assert heads_names(["/a", "/x/a"]) == {"/a": "a", "/x/a": "x/a"}  # no "//a"


def test_one_heads_folder_named_twice_is_refused(tmp_path, monkeypatch):
    from bench_methods import BenchError, parse_methods

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    for heads in (["run", "run"], ["run", "./run/"], ["run", str(tmp_path / "run")]):
        with pytest.raises(BenchError, match=r"--heads names one folder twice \(run, "):
            parse_methods(None, heads, None, None)
    assert parse_methods(None, ["run", "run2"], None, None) == [
        "baseline",
        "hf-lookup",
        "ngram",
        "heads",
    ]
