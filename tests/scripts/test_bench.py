"""scripts/bench.py end to end on a tiny random Llama that uses the embedded tokenizer."""

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from inference.tree import rank_paths

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (scripts/ is not a package)
import bench_report  # noqa: E402
import replay_policy  # noqa: E402

from train.prompts import conversation_id  # noqa: E402

MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]},
    {"question_id": 82, "category": "coding", "turns": ["Reverse a list in Python.", "In C?"]},
    {"question_id": 83, "category": "writing", "turns": ["Describe a cat.", "Shorter."]},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Name a colour."},
            {"from": "gpt", "value": "Red."},
        ]
    },
    {"conversations": [{"from": "human", "value": "Count to five: 1 2 3 4 5, again: 1 2 3"}]},
    {"conversations": [{"from": "human", "value": "Say hello."}]},
]


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(folders, tmp_path, prompts, *extra) -> dict:
    out = tmp_path / "out"
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--max-new-tokens", "8"]
    # One thread: a busy shared machine makes multi-threaded tiny forwards crawl.
    assert bench.main([*argv, "--threads", "1", "--out", str(out), *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_all_methods_greedy_identical(folders, tmp_path):
    prompts = _jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT)
    heads = ["--heads", str(folders["medusa"]), str(folders["eagle3"])]
    results = _run(folders, tmp_path, prompts, *heads, "--draft-model", str(folders["base"]))
    names = [m["name"] for m in results["methods"]]
    assert names == ["baseline", "hf-lookup", "ngram", "medusa", "eagle3", "draft"]
    assert [m["kind"] for m in results["methods"]][3:] == ["medusa", "eagle3", "draft"]
    assert results["methods"][3]["options"]["tree"] == "adaptive"  # the generator's default
    assert set(results) >= {"date", "machine", "versions", "settings", "summary", "records"}
    assert results["machine"]["torch_threads"] >= 1 and results["machine"]["cpu"]
    assert isinstance(results["machine"]["cpu_bf16"], bool)
    records = results["records"]
    assert len(records) == 3 * 6
    assert all(r["identical"] for r in records), [r for r in records if not r["identical"]]
    assert all(r["new_tokens"] == 8 and r["category"] == "all" for r in records)
    by_method = {m: [r for r in records if r["method"] == m] for m in names}
    assert all(r["tau"] is None and r["accepted_lengths"] is None for r in by_method["hf-lookup"])
    for name in ("ngram", "medusa", "eagle3", "draft"):
        for r in by_method[name]:
            assert r["tau"] >= 1.0 and 0 <= r["other_share"] < 1 and r["speedup"] > 0
            gained = sum(int(k) * v for k, v in r["accepted_lengths"].items())
            assert gained + 1 >= r["new_tokens"]  # the prefill gives the first token
            assert 0 <= r["plain_steps"] <= r["accepted_lengths"].get("1", 0)
            assert r["plain_steps"] == 0 or name != "draft"  # the base's own drafts: every step
    summary = results["summary"]["overall"]
    assert summary["baseline"]["tau"] == 1.0 and summary["baseline"]["speedup_overall"] == 1.0
    # The base drafting for itself accepts all 4 drafted tokens: after the prefill's token, a
    # step of 4 + bonus, then the last step is cut to the 2 tokens left of max_new_tokens=8.
    assert summary["draft"]["tau"] == 3.5
    assert summary["draft"]["accept_at_least"][-1] == 0.5  # the full step of each prompt
    assert summary["draft"]["drafted_share"] == 1.0 and summary["baseline"]["drafted_share"] is None
    assert all(summary[n]["identical_rate"] == 1.0 for n in names)
    assert len(summary["medusa"]["accept_at_least"]) == 2
    # EAGLE as it runs: adaptive over its arms (on a CPU the deepest has two levels)
    eagle = next(m for m in results["methods"] if m["name"] == "eagle3")
    arms = [a for a in eagle["options"]["arms"] if a]
    depths = [a["depth"] if "depth" in a else max(map(len, a["choices"])) for a in arms]
    assert eagle["options"]["tree"] == "adaptive" and eagle["draft_depth"] == max(depths)
    assert eagle["draft_depth"] == 2 or results["machine"]["gpu"]
    assert len(summary["eagle3"]["accept_at_least"]) == eagle["draft_depth"]
    out = tmp_path / "out"
    md = (out / "results.md").read_text()
    assert "| eagle3 | eagle3 |" in md and "## Per category" in md and "scripts/bench.py" in md
    bf16 = "bf16 instructions" if results["machine"]["cpu_bf16"] else "no bf16 instructions"
    assert f"cores usable, {bf16} (" in md or results["machine"]["gpu"]
    for png in bench_report.PLOTS.values():
        assert (out / png).stat().st_size > 1000


def test_draft_model_static_tree(folders, tmp_path):
    prompts = _jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT)
    tree = ["--draft-tree", "[[0], [1], [0, 0], [0, 0, 0]]"]
    extra = ["--methods", "draft", "--draft-model", str(folders["base"]), *tree]
    results = _run(folders, tmp_path, prompts, *extra)
    draft = results["methods"][-1]
    assert (draft["kind"], draft["draft_depth"]) == ("draft", 3)
    assert draft["options"] == {"tree": tree[1], "nodes": 5, "depth": 3}
    assert all(r["identical"] for r in results["records"])
    # The base drafting for itself accepts its top-1 path of 3: after the prefill's token, a step
    # of 3 + bonus, then the last step is cut to the 3 tokens left of max_new_tokens=8.
    summary = results["summary"]["overall"]["draft"]
    assert summary["tau"] == 3.5 and summary["accept_at_least"] == [1.0, 1.0, 0.5]


def test_dtype_and_attention_load_the_base_and_draft_model(folders, tmp_path, monkeypatch):
    """--dtype and --attn reach load_base for the base and the draft model, and are recorded."""
    import bench_methods

    loaded, load = [], bench_methods.load_base

    def spy(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        loaded.append((model.dtype, model.config._attn_implementation))
        return model, tokenizer

    monkeypatch.setattr(bench_methods, "load_base", spy)
    prompts = _jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT)
    extra = ["--methods", "draft", "--draft-model", str(folders["base"]), "--draft-tokens", "2"]
    results = _run(folders, tmp_path, prompts, *extra, "--dtype", "bfloat16", "--attn", "eager")
    assert loaded == [(torch.bfloat16, "eager")] * 2
    assert (results["settings"]["dtype"], results["settings"]["attn"]) == ("bfloat16", "eager")
    assert all(r["new_tokens"] > 0 for r in results["records"])


def test_multi_turn_categories_and_runs(folders, tmp_path):
    prompts = _jsonl(tmp_path / "mt_bench.jsonl", MT_BENCH)
    extra = ["--turns", "all", "--runs", "2", "--methods", "ngram,heads,heads+ngram"]
    results = _run(folders, tmp_path, prompts, *extra, "--heads", str(folders["medusa"]))
    records = results["records"]
    assert len(records) == 3 * 2 * 4  # prompts x turns x (baseline, ngram, medusa, medusa+ngram)
    union = results["methods"][-1]
    assert union["name"] == "medusa+ngram" and union["kind"] == "medusa+ngram"
    assert union["options"]["ngram_tokens"] == 4 and union["options"]["arms"][0] is None
    # the lookup's 4 tokens are deeper than the 2 heads' chain: a step accepts up to 4 drafted
    assert (
        union["draft_depth"] == 4
        and len(results["summary"]["overall"]["medusa+ngram"]["accept_at_least"]) == 4
    )
    assert {r["turn"] for r in records} == {0, 1} and all(r["identical"] for r in records)
    assert all(len(r["seconds_runs"]) == 2 for r in records)
    assert {r["id"] for r in records} == {81, 82, 83}
    by_category = results["summary"]["by_category"]
    assert set(by_category) == {"coding", "writing"}
    assert by_category["writing"]["medusa"]["records"] == 4
    assert "writing (4)" in (tmp_path / "out" / "results.md").read_text()


def test_corpus_lookup_methods(folders, tmp_path):
    prompts = _jsonl(tmp_path / "mt_bench.jsonl", MT_BENCH[:2])
    corpus = _jsonl(tmp_path / "answers.jsonl", SHAREGPT[:1] * 2)  # "Red." twice
    extra = ["--methods", "ngram+corpus,heads+ngram+corpus", "--lookup-corpus", str(corpus)]
    results = _run(folders, tmp_path, prompts, *extra, "--heads", str(folders["medusa"]))
    methods = {m["name"]: m for m in results["methods"]}
    assert list(methods) == ["baseline", "ngram+corpus", "medusa+ngram+corpus"]
    assert methods["ngram+corpus"]["kind"] == "ngram"
    assert methods["medusa+ngram+corpus"]["kind"] == "medusa+ngram"
    for m in list(methods.values())[1:]:
        options = m["options"]
        assert options["corpus"] == str(corpus) and options["corpus_min_count"] == 2
        assert options["corpus_contexts"] >= 1  # "Red." then the end of the answer
    assert len(results["records"]) == 2 * 3 and all(r["identical"] for r in results["records"])


def test_humaneval_sampling(folders, tmp_path):
    extra = [
        "--limit",
        "2",
        "--methods",
        "baseline,ngram",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
    ]
    results = _run(folders, tmp_path, "humaneval", *extra)
    records = results["records"]
    assert {r["category"] for r in records} == {"humaneval"}
    assert records[0]["id"] == "HumanEval/0" and records[0]["prompt_tokens"] > 50
    assert all(r["identical"] is None for r in records)  # not applicable when sampling
    assert results["summary"]["overall"]["ngram"]["identical_rate"] is None


def test_summary_counts_steps_not_prompts():
    method = {"name": "m", "kind": "medusa", "draft_depth": 3}
    base = {"method": "baseline", "new_tokens": 10, "seconds": 1.0}
    rows = [
        {"accepted_lengths": {"1": 2, "3": 2}, "new_tokens": 10, "seconds": 0.5, "speedup": 2.0},
        {"accepted_lengths": {"4": 4}, "new_tokens": 10, "seconds": 1.0, "speedup": 1.0},
    ]
    for i, r in enumerate(rows):
        r.update(prompt=i, turn=0, tau=None, identical=True, other_share=None)
    a = bench_report.aggregate(rows, {(0, 0): base, (1, 0): base}, method)
    assert a["tau"] == pytest.approx((2 + 6 + 16) / 8)  # pooled over 8 verify steps
    assert a["accept_at_least"] == pytest.approx([6 / 8, 6 / 8, 4 / 8])
    assert a["speedup_overall"] == pytest.approx(2.0 / 1.5)  # 20 tokens in 2 s vs 1.5 s
    assert a["speedup_median"] == 1.5 and a["identical_rate"] == 1.0


def test_draft_chain_and_tree_flags_exclude_each_other(folders, tmp_path, capsys):
    argv = ["--prompts", "embedded", "--draft-model", str(folders["base"]), "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        bench.main([*argv, "--draft-tokens", "3", "--draft-tree", "chain-2"])
    assert stop.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_per_category_takes_the_first_k_of_each(tmp_path):
    records = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"Q{i}?"]} for i in range(7)]
    prompts = bench.read_prompts(str(_jsonl(tmp_path / "q.jsonl", records)))
    picked = bench.per_category(prompts, 2)
    assert [p.id for p in picked] == [0, 1, 2, 3]
    assert [p.category for p in picked] == ["a", "b", "a", "b"]
    # --limit caps the balanced sample, not the file before it is taken
    records = [{"question_id": i, "category": "aaabbbc"[i], "turns": [f"Q{i}?"]} for i in range(7)]
    path = str(_jsonl(tmp_path / "grouped.jsonl", records))
    assert [p.id for p in bench.read_prompts(path, k_per_category=1)] == [0, 3, 6]
    assert [p.id for p in bench.read_prompts(path, limit=2, k_per_category=1)] == [0, 3]
    assert [p.id for p in bench.read_prompts(path, limit=2)] == [0, 1]


def test_exclude_keeps_the_prompts_distill_did_not_answer(tmp_path):
    records = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"Q{i}?"]} for i in range(5)]
    path = str(_jsonl(tmp_path / "q.jsonl", records))
    out = tmp_path / "distill"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"settings": {"system_prompt": None}}))
    # Records as scripts/distill.py writes them: id = conversation_id(asked turns)-sample.
    answered = [
        {"id": f"{conversation_id([{'role': 'user', 'content': f'Q{i}?'}])}-0"} for i in (1, 2)
    ]
    (out / "shard-r000-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answered))
    distilled = bench.read_distilled(str(out))
    assert [p.id for p in bench.read_prompts(path, exclude=distilled)] == [0, 3, 4]
    with pytest.raises(bench.BenchError, match="every prompt"):
        bench.read_prompts(str(_jsonl(tmp_path / "two.jsonl", records[1:3])), exclude=distilled)
    with pytest.raises(bench.BenchError, match="was that run distilled from this source"):
        bench.read_prompts(str(_jsonl(tmp_path / "other.jsonl", records[3:])), exclude=distilled)
    with pytest.raises(bench.BenchError, match="not a distill output"):
        bench.read_distilled(str(tmp_path))
    with pytest.raises(SystemExit):
        bench.parse_args(["--prompts", "humaneval", "--exclude", str(out)])


def test_bench_arms_times_each_setting_against_plain_decoding(
    folders, tmp_path, capsys, monkeypatch
):
    import bench_arms

    from inference.drafters.eagle import EagleDrafter

    drafted = []  # the setting of every proposal made
    propose = EagleDrafter.propose

    def spy(self, sequence, sampling):
        if self.static is not None:
            drafted.append({"choices": sorted(map(list, rank_paths(self.static.tree)[1:]))})
        else:
            drafted.append(
                {"top_k": self.top_k, "depth": self.depth, "total_tokens": self.total_tokens}
            )
        return propose(self, sequence, sampling)

    monkeypatch.setattr(EagleDrafter, "propose", spy)
    prompts = _jsonl(tmp_path / "mt.jsonl", MT_BENCH)
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--max-new-tokens", "8"]
    argv += ["--device", "cpu", "--threads", "1"]
    out = tmp_path / "arms"
    assert bench_arms.main([*argv, "--heads", str(folders["eagle3"]), "--out", str(out)]) == 0
    rows = json.loads((out / "arms.json").read_text())["arms"]
    # plain, each of the drafter's own CPU arms fixed, then adaptive over them
    fixed = [
        {"choices": [[0], [1], [2], [3]]},
        {"top_k": 4, "depth": 2, "total_tokens": 6},
    ]
    assert [r["arm"] for r in rows] == [None, *fixed, "adaptive"]
    assert all(o in drafted for o in fixed)  # each fixed setting did draft
    assert rows[0]["tau"] == 1.0 and all(r["tau"] >= 1.0 for r in rows)
    assert all(r["identical"] == 1.0 and r["tokens"] >= r["steps"] > 0 for r in rows)
    assert all(r["draft_ms_per_step"] > 0 for r in rows[1:-1])
    assert "| `plain` | 1.00 |" in capsys.readouterr().out

    medusa = ["--heads", str(folders["medusa"])]
    custom = '[{"choices": "chain-2"}, [null, {"choices": [[0], [1], [0, 0]]}], "adaptive"]'
    out = tmp_path / "custom"
    assert bench_arms.main([*argv, *medusa, "--arms", custom, "--out", str(out), "--record"]) == 0
    rows = json.loads((out / "arms.json").read_text())["arms"]
    assert [r["arm"] for r in rows] == [
        None,
        {"choices": "chain-2"},
        [None, {"choices": [[0], [1], [0, 0]]}],
        "adaptive",
    ]
    assert all(r["identical"] == 1.0 for r in rows)
    # --record: every fixed setting's steps per prompt, for scripts/replay_policy.py
    record = json.loads((out / "steps.json").read_text())
    assert record["arms"] == [None, {"choices": "chain-2"}]
    assert len(record["prompts"]) == len(MT_BENCH)
    # the tokens each generation kept: plain decoding's steps, at most --max-new-tokens
    assert record["lengths"] == [len(p[0]) for p in record["prompts"]]
    assert all(0 < n <= 8 for n in record["lengths"])
    for i in (0, 1):  # every timed step once, the untimed warm-up's none
        assert sum(len(p[i]) for p in record["prompts"]) == rows[i]["steps"]
    for plain, chain in record["prompts"]:
        assert [s[:2] for s in plain] == [[i, 1] for i in range(len(plain))]
        assert all(s[3] is None and s[4] == [] and s[6] is False for s in plain)  # no draft
        assert [s[0] for s in chain] == [0, *itertools.accumulate(s[1] for s in chain[:-1])]
        for _, tokens, seconds, drafted, accepted, static, proposed in chain:  # a static tree's
            assert drafted == [[0], [0, 0]] and accepted in ([], [0], [0, 0]) and static
            assert tokens == 1 + len(accepted) and seconds > 0 and proposed
    capsys.readouterr()
    assert replay_policy.main([str(out / "steps.json"), "--orders", "2"]) == 0
    assert "adaptive, shared path rates (default)" in capsys.readouterr().out
    # A dynamic tree's greedy steps: the root's top 4 as paths, not the arm's shape.
    eagle = ["--heads", str(folders["eagle3"]), "--out", str(out), "--record"]
    assert (
        bench_arms.main([*argv, *eagle, "--arms", '[{"top_k": 4, "depth": 2, "total_tokens": 6}]'])
        == 0
    )
    record = json.loads((out / "steps.json").read_text())
    dynamic = [s for p in record["prompts"] for s in p[1]]
    assert dynamic and all(
        s[3] == [[0], [1], [2], [3]] and s[4] in ([], [0], [1], [2], [3]) and s[5] is False
        for s in dynamic
    )
    capsys.readouterr()
    assert replay_policy.main([str(out / "steps.json"), "--orders", "2"]) == 0
    assert "static trees' steps only" in capsys.readouterr().out

    # {} is the drafter as it is configured (the library takes it): timed, not refused.
    out = tmp_path / "as-configured"
    assert bench_arms.main([*argv, *medusa, "--arms", "[{}, [null, {}]]", "--out", str(out)]) == 0
    rows = json.loads((out / "arms.json").read_text())["arms"]
    assert [r["arm"] for r in rows] == [None, {}, [None, {}]]

    # A setting the heads cannot take fails before any timing, naming it; nothing is written.
    capsys.readouterr()
    out = tmp_path / "bad"
    for arms in ('[{"choices": "chain-3"}]', '[[null, {"choices": "chain-3"}]]'):
        assert bench_arms.main([*argv, *medusa, "--arms", arms, "--out", str(out)]) == 2
        assert 'setting {"choices": "chain-3"}' in capsys.readouterr().err
    assert not out.exists()
    for bad, message in [
        (["--arms", "{chain}"], "--arms is not JSON"),
        (["--arms", '[["adaptive"]]'], "--arms must be a JSON list"),
        (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
        (["--limit", "0"], "--limit, --per-category"),
    ]:
        with pytest.raises(SystemExit) as e:
            bench_arms.main([*argv, *medusa, *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_ids_and_categories_of_every_prompt_format_are_kept(tmp_path):
    """A record's question_id and category come with it whatever the file: gzipped, a JSON
    array, or a line holding a raw U+2028 (JSON allows it; str.splitlines splits on it)."""
    import gzip

    records = [
        {"question_id": 7, "category": "writing", "turns": ["a\u2028b"]},
        {"id": "x9", "category": "coding", "conversations": [{"from": "human", "value": "c"}]},
    ]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    (tmp_path / "q.jsonl").write_text(lines, encoding="utf-8")
    (tmp_path / "q.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "q.json").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    for name in ("q.jsonl", "q.jsonl.gz", "q.json"):
        prompts = bench.read_prompts(str(tmp_path / name))
        assert [(p.id, p.category) for p in prompts] == [(7, "writing"), ("x9", "coding")], name
        assert prompts[0].users == ["a\u2028b"]


def test_who_runs_first_rotates_over_the_prompts_benchmarked(smollm2_tokenizer):
    """With --per-category the prompts keep their file positions (here 0, 3, 6, ...: every
    category's first, with 3 categories): the order of the methods rotates by position in the
    benchmarked list, not in the file."""
    from bench_methods import Method, Run

    calls: list[str] = []

    def method(name: str) -> Method:
        def generate(ids, seed, max_new_tokens=None):
            calls.append(name)
            return Run([1, 2])

        return Method(name, "baseline", generate, torch.device("cpu"), True)

    methods = [method(n) for n in ("baseline", "a", "b")]
    prompts = [bench.BenchPrompt(3 * i, i, "c", "x", [], ["Hi"]) for i in range(6)]
    bench.run_bench(prompts, methods, smollm2_tokenizer, 1, 0)
    assert calls[::3] == ["baseline", "a", "b", "baseline", "a", "b"]  # each prompt's first


def test_turns_past_the_context_are_skipped_and_bad_flags_refused(folders, tmp_path, capsys):
    prompts = _jsonl(tmp_path / "mt_bench.jsonl", MT_BENCH[:2])
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--threads", "1"]
    out = tmp_path / "out"
    # the tiny base has 2048 positions: 2030 new tokens leave room for no chat-templated prompt
    assert bench.main([*argv, "--max-new-tokens", "2030", "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert "bench failed: every prompt passes the base's context (2048 positions)" in printed.err
    assert "with --max-new-tokens 2030: give at most 20" in printed.err  # 2048 - its 28 tokens
    assert not (out / "results.json").exists()
    # a first prompt past the context is skipped, warm-up and all: the next is benchmarked
    long = _jsonl(tmp_path / "long.jsonl", [{"turns": ["word " * 2100]}, MT_BENCH[0]])
    argv_long = ["--base", str(folders["base"]), "--prompts", str(long), "--threads", "1"]
    short = ["--max-new-tokens", "4", "--methods", "baseline,ngram", "--out", str(out)]
    longest = _jsonl(tmp_path / "longest.jsonl", [{"turns": ["word " * 2100]}])
    alone = ["--base", str(folders["base"]), "--prompts", str(longest), "--threads", "1"]
    assert bench.main([*alone, *short]) == 2  # no --max-new-tokens would do
    assert "every prompt is longer than the base's context (2048" in capsys.readouterr().err
    assert bench.main([*argv_long, *short]) == 0
    assert "turn 1: skipped" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert (results["prompts"]["count"], results["prompts"]["read"]) == (1, 2)
    assert "1 more read, skipped: past the base's context" in (out / "results.md").read_text()
    # bench_arms likewise (it stopped with a traceback there, losing the prompts timed)
    import bench_arms

    arms = ["--heads", str(folders["medusa"]), "--arms", "[]", "--out", str(tmp_path / "arms")]
    assert bench_arms.main([*argv_long, *arms, "--max-new-tokens", "4"]) == 0
    assert "skipped (its 21" in capsys.readouterr().err
    assert json.loads((tmp_path / "arms" / "arms.json").read_text())["prompts"]["count"] == 1
    assert bench_arms.main([*argv, *arms, "--max-new-tokens", "2030"]) == 2
    assert "every prompt passes the base's context" in capsys.readouterr().err
    # tree options no method reads change nothing, and are said to
    quick = ["--max-new-tokens", "4", "--methods", "baseline", "--out", str(out)]
    assert bench.main([*argv, *quick, "--tree", "cpu-8", "--eagle-top-k", "2"]) == 0
    assert "--tree (Medusa heads) and --eagle-* (EAGLE heads) ignored" in capsys.readouterr().err
    for bad, message in (
        (["--temperature", "-1"], "need --temperature >= 0"),
        (["--top-p", "0"], "0 < --top-p <= 1"),
        (["--lookup-tokens", "0"], "--lookup-tokens, --eagle-top-k and --eagle-total-tokens"),
        (["--dtype", "float64"], "invalid choice: 'float64'"),
        (["--threads", "0"], "--threads must be >= 1"),
    ):
        with pytest.raises(SystemExit) as stop:
            bench.main([*argv, *bad])
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_template_error_or_an_unwritable_out_stops_before_any_timing(folders, tmp_path, capsys):
    prompts = _jsonl(
        tmp_path / "p.jsonl",
        [
            {"turns": ["Hi"]},
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]},
        ],
    )
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--threads", "1"]
    argv += ["--methods", "baseline", "--max-new-tokens", "2"]
    template = tmp_path / "no-system.jinja"  # refuses a system turn, as Gemma's does
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    assert bench.main([*argv, "--chat-template", str(template), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert (
        "bench failed: the chat template cannot render a conversation of turns [system, user]"
        in err
    )
    assert "System role not supported" in err and "bench:" not in err  # nothing timed
    (tmp_path / "file").write_text("")
    assert bench.main([*argv, "--out", str(tmp_path / "file")]) == 2
    assert "bench failed:" in capsys.readouterr().err
