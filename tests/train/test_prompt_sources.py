"""Prompt sources in detail: ShareGPT / OpenAI role names, leading assistant turns, content
parts, empty turns, cut gzip files, line numbers, hf: splits, pinned conversation ids, skip and
collect; the embedded set's clipping, docstring prompts and stdlib cap."""

import gzip
import json
import re

import pytest

import train.prompt_set as prompt_set
from tests.train.test_prompts import write_jsonl
from train.prompts import PromptSourceError, normalize_record, read_source


def test_sharegpt_role_names_of_other_dumps_and_any_case():
    # "model" (Gemini-style dumps) and "chatgpt" are the assistant
    # role names are matched case-insensitively ("Human", "GPT")
    record = {
        "conversations": [
            {"from": "Human", "value": "Q1"},
            {"from": "model", "value": "A1"},
            {"from": "HUMAN", "value": "Q2"},
            {"from": "GPT", "value": "A2"},
            {"from": "user", "value": "Q3"},
            {"from": "chatgpt", "value": "A3"},
        ]
    }
    assert [m["role"] for m in normalize_record(record)] == ["user", "assistant"] * 3
    openai = {"messages": [{"role": "System", "content": "S"}, {"role": "User", "content": "Q"}]}
    assert normalize_record(openai) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
    ]


def test_every_leading_assistant_turn_is_dropped():
    # not only the first of several
    record = {
        "conversations": [
            {"from": "gpt", "value": "Welcome!"},
            {"from": "gpt", "value": "Ask me anything."},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
        ]
    }
    assert normalize_record(record) == [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    with_system = {"conversations": [{"from": "system", "value": "S"}, *record["conversations"]]}
    assert [m["role"] for m in normalize_record(with_system)] == ["system", "user", "assistant"]


def test_a_non_text_content_part_is_refused_not_dropped():
    # an image beside the text would leave a prompt that refers to a picture it lacks
    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe this picture."},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                ],
            }
        ]
    }
    with pytest.raises(ValueError, match="turn 0: only text content parts are supported"):
        normalize_record(record)


def test_empty_answers_are_taken_but_not_empty_questions(tmp_path):
    # `empty_answers` lets an assistant turn be empty, never a user turn
    record = {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": ""}]}
    with pytest.raises(ValueError, match="turn 0: empty text"):
        normalize_record(record, empty_answers=True)
    good = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": ""}]}
    path = write_jsonl(tmp_path / "shard.jsonl", [record, good])
    prompts, skipped = read_source(str(path))
    assert [p.source for p in prompts] == [f"{path}:2"]
    assert skipped == [f"{path}:1: turn 0: empty text"]


def test_a_gzip_file_cut_short_names_the_line_it_could_not_read(tmp_path):
    # three whole lines decompress, the trailer is missing: line 4 is the unreadable one
    lines = "".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)).encode()
    packed = gzip.compress(lines, mtime=0)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed[:-8])  # the CRC and size trailer gone
    with pytest.raises(PromptSourceError, match=re.escape(f"{cut}:4: unreadable gzip data")):
        read_source(str(cut))


def test_a_json_file_of_one_object_names_the_line_it_starts_on(tmp_path):
    # the location of a single-object .json file is 1-based like every other
    single = tmp_path / "single.json"
    single.write_text('{"prompt": "only"}')
    assert read_source(str(single))[0][0].source == f"{single}:1"
    single.write_text('\n\n  {"prompt": "only"}\n')
    assert read_source(str(single))[0][0].source == f"{single}:3"
    single.write_text('\n{"oops": 1}\n')
    prompts, skipped = read_source(str(single), on_error="collect")
    assert prompts == [] and skipped[0].startswith(f"{single}:2: no 'conversations'")


def test_gzip_bytes_under_any_plain_name_are_said_so(tmp_path):
    # not only a .jsonl name: a JSON Lines file named .ndjson or without a suffix too
    packed = gzip.compress(json.dumps({"prompt": "q"}).encode() + b"\n", mtime=0)
    for name in ("prompts.ndjson", "prompts"):
        path = tmp_path / name
        path.write_bytes(packed)
        with pytest.raises(PromptSourceError, match=re.escape(f"is gzipped: name it {name}.gz")):
            read_source(str(path))


def test_all_stands_alone_wherever_it_is_in_the_list():
    # `embedded:coding,all` gets the same clear message as `embedded:all,coding`
    for spec in ("embedded:coding,all", "embedded:all,coding"):
        with pytest.raises(PromptSourceError, match="'all' stands alone: write embedded:all"):
            read_source(spec)


def test_conversation_ids_are_pinned_across_versions():
    # ids hash the UTF-8 of the JSON with ensure_ascii=False; distill resumes and bench
    # excludes by these ids, so any change of the canonical form orphans earlier runs' records
    from train.prompts import conversation_id

    french = [{"role": "user", "content": "Traduis « café » en japonais : コーヒー"}]
    assert conversation_id(french) == "7c79943329bea8b7"
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert conversation_id(system) == "1a5f73268af528b4"


def test_skip_warns_per_malformed_record_and_collect_stays_quiet(tmp_path, caplog):
    # on_error=skip logs each skipped record; "collect" leaves the report to the caller
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"bad": 1}])
    with caplog.at_level("WARNING", logger="train.prompts"):
        read_source(str(path), on_error="skip")
    assert f"skipping malformed record {path}:2: no 'conversations'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="train.prompts"):
        prompts, skipped = read_source(str(path), on_error="collect")
    assert caplog.text == "" and len(prompts) == 1 and len(skipped) == 1


def test_an_unknown_prompt_order_is_refused(tmp_path):
    # a misspelt order is an error, not silently the prompt-hash order
    from train.prompts import load_prompts

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q"}])
    with pytest.raises(ValueError, match="order='random': 'prompt-hash' or 'shuffle'"):
        load_prompts([str(path)], order="random")


def test_clip_cuts_at_a_paragraph_or_hard_cuts_one_long_paragraph():
    # one paragraph longer than the limit is cut at the limit, not kept whole (less a char)
    assert prompt_set._clip("x" * 3000, 2000) == "x" * 2000
    assert prompt_set._clip("short", 2000) == "short"
    text = "a" * 50 + "\n\n" + "b" * 50 + "\n\n" + "c" * 50
    assert prompt_set._clip(text, 120) == "a" * 50 + "\n\n" + "b" * 50
    for _, turns in prompt_set.embedded_turns():
        for turn in turns:
            assert len(turn) < 2600  # a template (< 600 chars) around a clip of <= 2000


def test_docstring_prompts_show_the_function_without_its_docstring():
    # the docstring's last line (all of a one-line docstring) is cut too
    # and the code left is still a function (a body besides the docstring)
    import ast

    head = prompt_set._DOCSTRING_TEMPLATE.split("{code}")[0]
    asked = [
        t[0][len(head) :].removesuffix("\n```")
        for c, t in prompt_set.embedded_turns()
        if c == "coding" and t[0].startswith(head)
    ]
    assert len(asked) >= 10
    for code in asked:
        function = ast.parse(code).body[0]
        assert isinstance(function, ast.FunctionDef)
        assert ast.get_docstring(function) is None, code


def test_the_stdlib_function_prompts_are_capped_at_the_limit(monkeypatch):
    # the cap keeps _MAX_STDLIB_FUNCTIONS of them (a seeded sample), not the rest
    monkeypatch.setattr(prompt_set, "_MAX_STDLIB_FUNCTIONS", 10**9)
    full = prompt_set._stdlib_prompts()
    full_code = [text for cat, text in full if cat == "coding"]
    assert len(full_code) > 20
    monkeypatch.setattr(prompt_set, "_MAX_STDLIB_FUNCTIONS", 7)
    capped = prompt_set._stdlib_prompts()
    capped_code = [text for cat, text in capped if cat == "coding"]
    assert len(capped_code) == 7 and set(capped_code) <= set(full_code)
    # the other categories are untouched by the cap
    assert [x for x in capped if x[0] != "coding"] == [x for x in full if x[0] != "coding"]


def _function(name: str, lines: int, decorator: str = "") -> str:
    """A function of exactly `lines` lines (its `def` line included), without a docstring."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return f"{decorator}def {name}(a):\n{body}    return a\n"


def _stdlib(tmp_path, monkeypatch, files: dict[str, str]) -> list[tuple[str, str]]:
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    monkeypatch.setattr(prompt_set.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    return prompt_set._stdlib_prompts()


def test_functions_of_6_to_30_lines_without_decorators_are_asked_about(tmp_path, monkeypatch):
    source = "".join(
        [
            _function("five", 5),
            _function("six", 6),
            _function("thirty", 30),
            _function("thirty_one", 31),
            _function("cached", 6, decorator="@functools.cache\n"),
            _function("_private", 6),
            _function("test_it", 6),
            _function("main_loop", 6),
        ]
    )
    prompts = _stdlib(tmp_path, monkeypatch, {"mod.py": "import functools\n" + source})
    assert {category for category, _ in prompts} == {"coding"}
    names = ("five", "six", "thirty", "thirty_one", "cached", "_private", "test_it", "main_loop")
    asked = [name for name in names for _, text in prompts if f"def {name}(a):" in text]
    assert asked == ["six", "thirty"] and len(prompts) == 2


def test_test_and_private_modules_give_no_prompts(tmp_path, monkeypatch):
    function = _function("six", 6)
    prompts = _stdlib(
        tmp_path,
        monkeypatch,
        {"test_mod.py": function, "testing.py": function, "_mod.py": function, "mod.py": function},
    )
    assert len(prompts) == 1  # mod.py's function only
    assert prompts[0][0] == "coding" and "def six(a):" in prompts[0][1]


def test_a_module_docstring_is_summarised_from_200_characters(tmp_path, monkeypatch):
    short, long = "s" * 199, "l" * 200
    prompts = _stdlib(
        tmp_path,
        monkeypatch,
        {"short.py": f'"""{short}"""\n', "long.py": f'"""{long}"""\n'},
    )
    assert len(prompts) == 1
    category, text = prompts[0]
    assert category == "summarization" and long in text and short not in text


def test_a_function_that_is_only_its_docstring_is_never_asked_for_one(tmp_path, monkeypatch):
    # dropping its docstring would leave a `def` line and no body: it is explained instead
    docstring_only = "".join(
        f'def only_doc_{i}(a):\n    """Line one.\n\n    Line two.\n    Line three.\n    """\n'
        for i in range(40)
    )
    with_body = "".join(
        f'def doc_and_body_{i}(a):\n    """Line one.\n\n    Line two.\n    """\n    return a\n'
        for i in range(40)
    )
    prompts = _stdlib(tmp_path, monkeypatch, {"mod.py": docstring_only + with_body})
    head = prompt_set._DOCSTRING_TEMPLATE.split("{code}")[0]
    asked_for_docstring = [text for _, text in prompts if text.startswith(head)]
    assert len(prompts) == 80
    assert asked_for_docstring  # some functions with a body lose their docstring
    assert all("def doc_and_body_" in text for text in asked_for_docstring)


def test_a_group_expands_every_template_and_slot_combination_in_order():
    group = {
        "templates": ["A {x} {y}", "B {x} {y}"],
        "slots": {"x": ["1", "2", "3"], "y": ["p", "q", "r", "s"]},
    }
    texts = prompt_set._expand_group(group, "chat")
    assert texts == [f"{t} {x} {y}" for t in "AB" for x in "123" for y in "pqrs"]
    literal = {"templates": ["print({})", "{x}"]}  # no slots: braces are literal text
    assert prompt_set._expand_group(literal, "coding") == ["print({})", "{x}"]
    picked = prompt_set._expand_group({**group, "count": 24}, "chat")
    assert picked == texts  # a count of all of them keeps the order


def test_the_stdlib_function_prompts_are_capped_at_320():
    coding = [text for category, text in prompt_set._stdlib_prompts() if category == "coding"]
    assert len(coding) == 320


def test_an_empty_system_turn_is_none_in_a_prompt_file_and_kept_in_distills_answers(tmp_path):
    """A prompt file's empty system turn (some ShareGPT dumps write one for none) leaves the
    template's default system prompt; distill writes one for data.system_prompt="", which
    training keeps."""
    turns = [{"from": "system", "value": ""}, {"from": "human", "value": "Hi"}]
    record = {"conversations": [*turns, {"from": "gpt", "value": "Hello."}]}
    assert [m["role"] for m in normalize_record(record)] == ["user", "assistant"]
    kept = normalize_record(record, empty_system=True)
    assert kept[0] == {"role": "system", "content": ""}
    prompts, skipped = read_source(str(write_jsonl(tmp_path / "p.jsonl", [record])))
    assert skipped == [] and [m["role"] for m in prompts[0].messages] == ["user", "assistant"]
