"""scripts/chat.py on a tiny random Llama that uses the embedded tokenizer: turns read from
stdin, answers streamed to stdout, one statistics line per answer on stderr."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import chat  # noqa: E402  (scripts/ is not a package)
from bench_methods import stop_token_ids  # noqa: E402

from tests.scripts.conftest import heads_trained_under  # noqa: E402


def _chat(monkeypatch, lines: list[str], *argv) -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    return chat.main([*argv, "--threads", "1"])


def _hf_answer(model, tokenizer, messages, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    eos = stop_token_ids(model, tokenizer)
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_turns_answers_and_reset_are_the_base_greedy_ones(folders, monkeypatch, capsys):
    """Three turns, a /reset before the third: every streamed answer is HF greedy's answer to
    the whole conversation so far (the second sees the first answer, the third does not), and
    each statistics line says the answer is identical to HF's."""
    turns = ["Name a colour.", "And another?", "/reset", "Count to three.", "/quit", "Unread."]
    argv = ["--base", str(folders["base"]), "--heads", str(folders["medusa"])]
    argv += [str(folders["eagle3"]), "--lookup", "--max-new-tokens", "12", "--compare"]
    assert _chat(monkeypatch, turns, *argv) == 0
    out, err = capsys.readouterr()

    model = AutoModelForCausalLM.from_pretrained(folders["base"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    first = _hf_answer(model, tokenizer, [{"role": "user", "content": turns[0]}], 12)
    conversation = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": turns[1]},
    ]
    second = _hf_answer(model, tokenizer, conversation, 12)
    third = _hf_answer(model, tokenizer, [{"role": "user", "content": turns[3]}], 12)
    assert out == f"{first}\n{second}\n{third}\n"
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert len(stats) == 3
    assert all("identical" in line and "tok/s" in line and "tau" in line for line in stats)
    assert "(a new conversation)" in err


def test_sampling_without_heads_streams_an_answer(folders, monkeypatch, capsys):
    argv = ["--base", str(folders["base"]), "--temperature", "0.8", "--max-new-tokens", "6"]
    assert _chat(monkeypatch, ["Say hello."], *argv) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "[" in err and "HF greedy" not in err


def test_a_conversation_past_the_context_is_refused_and_dropped(folders, monkeypatch, capsys):
    """A turn that would pass the base's context (2,048 positions here) is not sent: the
    message says to shorten it, and the next turn goes on without it."""
    argv = ["--base", str(folders["base"]), "--max-new-tokens", "1900"]
    assert _chat(monkeypatch, ["word " * 200, "Hi."], *argv) == 0
    out, err = capsys.readouterr()
    assert "(not sent: this message alone has" in err and "shorten it or lower" in err
    assert "/reset to start anew" not in err  # it would not help
    # a message that fills the context alone: fewer new tokens would not help either
    assert _chat(monkeypatch, ["word " * 2100, "Hi."], *argv) == 0
    err = capsys.readouterr().err
    assert "shorten it)" in err and "lower --max-new-tokens" not in err
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 1


def test_bad_heads_an_empty_corpus_and_sampled_compare_are_refused(
    folders, tmp_path, monkeypatch, capsys
):
    argv = ["--base", str(folders["base"]), "--heads", str(folders["other-medusa"])]
    assert _chat(monkeypatch, ["Hi."], *argv) == 2
    assert "chat failed" in capsys.readouterr().err
    empty = tmp_path / "answers"  # a lookup corpus with no answers is refused, as in bench.py
    empty.mkdir()
    (empty / "shard.jsonl").write_text("")
    argv = ["--base", str(folders["base"]), "--lookup-corpus", str(empty)]
    assert _chat(monkeypatch, ["Hi."], *argv) == 2
    assert "chat failed: --lookup-corpus" in capsys.readouterr().err
    for bad in (
        ["--compare", "--temperature", "0.5"],
        ["--temperature", "-1"],
        ["--temperature", "nan"],
        ["--temperature", "inf"],
        ["--top-p", "0"],
        ["--threads", "0"],
        ["--threads", "-1"],
    ):
        with pytest.raises(SystemExit) as e:
            chat.parse_args(bad)
        assert e.value.code == 2, bad


def test_a_missing_heads_folder_is_said_before_the_base_loads(tmp_path, monkeypatch, capsys):
    def load_base(*args, **kwargs):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr(chat, "load_base", load_base)
    assert _chat(monkeypatch, ["Hi."], "--heads", str(tmp_path / "missing")) == 2
    assert "chat failed: heads folder not found" in capsys.readouterr().err


def test_max_new_tokens_that_leave_no_room_are_refused_before_any_turn(
    folders, monkeypatch, capsys
):
    argv = ["--base", str(folders["base"]), "--max-new-tokens", "2048"]  # the base's context
    assert _chat(monkeypatch, ["Hi."], *argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "chat failed: --max-new-tokens 2048 leaves no room" in err


def test_a_line_that_is_not_utf8_is_said_and_the_chat_goes_on(folders, monkeypatch, capsys):
    """A Latin-1 line ("Caf\\xe9") on a stdin that decodes UTF-8 strictly, as a UTF-8 locale's
    does: that line is not sent, and the next one is answered."""
    latin1 = io.TextIOWrapper(io.BytesIO(b"Caf\xe9 au lait?\nHi.\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", latin1)
    argv = ["--base", str(folders["base"]), "--max-new-tokens", "4", "--threads", "1"]
    assert chat.main(argv) == 0
    out, err = capsys.readouterr()
    assert "(not sent: the line is not UTF-8 text" in err
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 1
    assert len(out.splitlines()) == 1


def test_an_empty_system_prompt_is_an_empty_system_turn(folders, monkeypatch):
    """As training gives it (data.system_prompt: ""), not the template's default system turn."""
    sent = []

    def prompt_ids(messages, tokenizer):
        sent.append(list(messages))
        raise chat.ChatTemplateError("stop here")

    monkeypatch.setattr(chat, "prompt_ids", prompt_ids)
    argv = ["--base", str(folders["base"]), "--system-prompt", ""]
    assert _chat(monkeypatch, ["Hi."], *argv) == 2
    assert sent == [[{"role": "system", "content": ""}, {"role": "user", "content": "Hi."}]]


def test_top_p_and_top_k_without_a_temperature_are_said_to_do_nothing(folders, monkeypatch, capsys):
    argv = ["--base", str(folders["base"]), "--max-new-tokens", "4", "--top-k", "3"]
    assert _chat(monkeypatch, ["Hi."], *argv) == 0
    assert "note: --top-p and --top-k shape sampling" in capsys.readouterr().err


def test_ctrl_c_stops_an_answer_and_leaves_its_turn_out(folders, monkeypatch, capsys):
    """Ctrl-C during the first answer: the conversation goes on without that turn, so the
    second answer is HF greedy's answer to the second turn alone."""
    answer, calls = chat.answer, []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return answer(*args, **kwargs)

    monkeypatch.setattr(chat, "answer", interrupted_once)
    argv = ["--base", str(folders["base"]), "--max-new-tokens", "8"]
    assert _chat(monkeypatch, ["Name a colour.", "Count to three."], *argv) == 0
    out, err = capsys.readouterr()
    assert "answer stopped" in err
    model = AutoModelForCausalLM.from_pretrained(folders["base"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    expected = _hf_answer(model, tokenizer, [{"role": "user", "content": "Count to three."}], 8)
    assert out == f"{expected}\n"


def test_ctrl_c_during_the_comparison_keeps_the_answer(folders, monkeypatch, capsys):
    """Ctrl-C while HF greedy runs for --compare leaves out the comparison, not the answer: the
    second turn sees the first answer."""
    monkeypatch.setattr(chat, "hf_runner", lambda *a, **k: _raise(KeyboardInterrupt))
    argv = ["--base", str(folders["base"]), "--max-new-tokens", "8", "--compare"]
    assert _chat(monkeypatch, ["Name a colour.", "And another?"], *argv) == 0
    out, err = capsys.readouterr()
    assert err.count("HF greedy stopped") == 2
    model = AutoModelForCausalLM.from_pretrained(folders["base"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    first = _hf_answer(model, tokenizer, [{"role": "user", "content": "Name a colour."}], 8)
    conversation = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And another?"},
    ]
    assert out == f"{first}\n{_hf_answer(model, tokenizer, conversation, 8)}\n"


def _raise(error):
    def run(*args, **kwargs):
        raise error

    return run


def test_a_base_without_chat_template_is_refused_before_any_turn(folders, tmp_path, monkeypatch):
    from tests.scripts.conftest import copy_without_chat_template

    base = copy_without_chat_template(folders["base"], tmp_path / "no-template")
    stdin = io.StringIO("Hi.\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert chat.main(["--base", str(base), "--threads", "1"]) == 2
    assert stdin.tell() == 0  # refused before reading a turn


def test_max_new_tokens_below_one_is_a_usage_error():
    chat.parse_args(["--max-new-tokens", "1"])
    with pytest.raises(SystemExit) as e:
        chat.parse_args(["--max-new-tokens", "0"])
    assert e.value.code == 2


def test_a_lookup_corpus_beside_heads_drafts_with_the_heads_and_the_corpus(folders, tmp_path):
    """--lookup-corpus implies --lookup: the n-gram drafter joins the heads and reads the corpus."""
    from heads import load_base
    from inference import NgramDrafter
    from inference.drafters.union import UnionDrafter

    corpus = tmp_path / "answers"
    corpus.mkdir()
    record = {
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "The cat sat on the mat. The cat sat on the mat."},
        ]
    }
    (corpus / "shard.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    base, tokenizer = load_base(str(folders["base"]), device="cpu")
    args = chat.parse_args(["--heads", str(folders["medusa"]), "--lookup-corpus", str(corpus)])
    gen = chat.build_generator(args, base, tokenizer)
    assert isinstance(gen.drafter, UnionDrafter)
    lookups = [d for d in gen.drafter.drafters if isinstance(d, NgramDrafter)]
    assert len(lookups) == 1 and lookups[0].corpus is not None
    assert lookups[0].corpus.num_contexts > 0


def test_an_answer_of_the_prefills_token_alone_has_tau_one(folders, monkeypatch, capsys):
    """With --max-new-tokens 1 no verify step runs: tau is 1 token per step, not 0."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi.\n"))
    argv = ["--base", str(folders["base"]), "--max-new-tokens", "1", "--threads", "1"]
    assert chat.main(argv) == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert len(stats) == 1
    assert stats[0].startswith("[1 tokens in ") and stats[0].endswith(
        ", tau 1.00; cut at --max-new-tokens 1]"
    )


def test_an_answer_that_ends_inside_a_character_shows_its_last_bytes(capsys):
    # the answer stops (max_new_tokens) after a character's first byte: what was held back shows
    texts = {(1,): "a", (1, 2): "a\ufffd"}
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[tuple(ids)])

    def stream(ids, stats, **kwargs):
        stats["accepted_lengths"] = [1]
        yield from ([1], [2])

    args = SimpleNamespace(max_new_tokens=2, temperature=0.0, top_p=1.0, top_k=0)
    new, _, tau = chat.answer(SimpleNamespace(stream=stream), None, args, tokenizer, [], 0)
    assert new == [1, 2] and tau == 1.0
    assert capsys.readouterr().out == "a\ufffd\n"


def test_a_message_that_just_fits_alone_is_told_to_reset_not_to_shorten(
    folders, monkeypatch, capsys
):
    """The message alone fills the context exactly (prompt + answer = 2,048 positions): it can
    be sent after /reset, so that is what the refusal of the grown conversation says."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    text = ("word " * 150).strip()  # as chat.py reads the line
    alone = chat.prompt_ids([{"role": "user", "content": text}], tokenizer).shape[1]
    answered = []

    def answer(gen, ids, args, tokenizer, eos, seed):
        answered.append(ids.shape[1])
        print("ok")
        return [330], 1.0, 1.0

    monkeypatch.setattr(chat, "answer", answer)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{text}\n{text}\n"))
    argv = ["--base", str(folders["base"]), "--max-new-tokens", str(2048 - alone)]
    assert chat.main([*argv, "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert answered == [alone]  # the first is answered; the second is not sent
    assert "(not sent: the conversation has" in err and "/reset to start anew" in err
    assert "shorten it" not in err


def test_heads_trained_under_another_system_prompt_or_template_are_said(
    folders, tmp_path, monkeypatch, capsys
):
    """Heads whose recipe set a system prompt and a chat template record them: chat says when it
    runs under others, and is quiet under the same."""
    from transformers import AutoTokenizer

    heads = tmp_path / "heads"
    shutil.copytree(folders["medusa"], heads)
    config = json.loads((heads / "config.json").read_text())
    own = AutoTokenizer.from_pretrained(folders["base"]).chat_template
    other = own.replace("<|im_start|>", "<|im_start|> ")  # another template
    config.update(training_system_prompt="Réponds brièvement.", training_chat_template=other)
    (heads / "config.json").write_text(json.dumps(config))
    (tmp_path / "chat.jinja").write_text(other + "\n")  # a file's last newline, as saved
    argv = ["--base", str(folders["base"]), "--heads", str(heads), "--max-new-tokens", "2"]

    assert _chat(monkeypatch, ["/quit"], *argv) == 0
    err = capsys.readouterr().err
    said = f'note: {heads} learned under the system prompt "Réponds brièvement.": --as-trained'
    assert said in err
    assert f"note: {heads} learned under another chat template (training_chat_template of" in err

    same = [
        "--system-prompt",
        "Réponds brièvement.",
        "--chat-template",
        str(tmp_path / "chat.jinja"),
    ]
    assert _chat(monkeypatch, ["/quit"], *argv, *same) == 0
    assert "note:" not in capsys.readouterr().err


def test_as_trained_chats_under_the_prompts_the_heads_record(
    folders, tmp_path, monkeypatch, capsys
):
    """--as-trained: each turn's prompt is the one --system-prompt and --chat-template would give
    with what the heads record, and no note says otherwise; it needs --heads."""
    own = AutoTokenizer.from_pretrained(folders["base"]).chat_template
    other = own.replace("<|im_start|>", "<|im_start|> ")
    heads = heads_trained_under(
        folders["medusa"],
        tmp_path / "heads",
        training_system_prompt="Réponds brièvement.",
        training_chat_template=other,
    )
    prompts = []

    def answer(gen, ids, args, tokenizer, eos, seed):
        prompts.append(ids[0].tolist())
        print("ok")
        return [330], 1.0, 1.0

    monkeypatch.setattr(chat, "answer", answer)
    argv = ["--base", str(folders["base"]), "--heads", str(heads), "--max-new-tokens", "2"]
    assert _chat(monkeypatch, ["Hi."], *argv, "--as-trained") == 0
    err = capsys.readouterr().err
    assert 'as trained: the system prompt "Réponds brièvement."; the chat template' in err
    assert "note:" not in err
    (tmp_path / "chat.jinja").write_text(other)
    flags = [
        "--system-prompt",
        "Réponds brièvement.",
        "--chat-template",
        str(tmp_path / "chat.jinja"),
    ]
    assert _chat(monkeypatch, ["Hi."], *argv, *flags) == 0
    assert _chat(monkeypatch, ["Hi."], *argv) == 0  # the tokenizer's template, no system turn
    assert prompts[0] == prompts[1] != prompts[2]
    capsys.readouterr()
    # a template that ends in text and two newlines: Jinja drops one, the other is the template's
    ending = other + "Answer:\n\n"
    two = heads_trained_under(folders["medusa"], tmp_path / "two", training_chat_template=ending)
    argv = ["--base", str(folders["base"]), "--heads", str(two), "--max-new-tokens", "2"]
    assert _chat(monkeypatch, ["Hi."], *argv, "--as-trained") == 0
    (tmp_path / "two.jinja").write_text(ending)
    assert _chat(monkeypatch, ["Hi."], *argv, "--chat-template", str(tmp_path / "two.jinja")) == 0
    assert "note:" not in capsys.readouterr().err
    assert prompts[3] == prompts[4]
    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    assert tokenizer.decode(prompts[3]).endswith("assistant\nAnswer:\n")  # the newline it kept
    with pytest.raises(SystemExit) as stop:
        _chat(monkeypatch, ["Hi."], "--base", str(folders["base"]), "--as-trained")
    assert stop.value.code == 2 and "give --heads" in capsys.readouterr().err


def test_the_command_line_says_a_library_warning_as_one_line(folders, tmp_path):
    """Heads recorded for another base of the same sizes: chat.py run as a command says so in
    one `warning:` line, without Python's file, line and source line."""
    renamed = shutil.copytree(folders["base"], tmp_path / "renamed-base")
    argv = [sys.executable, str(ROOT / "scripts" / "chat.py"), "--base", str(renamed)]
    argv += ["--heads", str(folders["medusa"]), "--threads", "1"]
    done = subprocess.run(argv, input="", capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "trained on" in line]
    assert len(said) == 1 and said[0].startswith("warning: these heads were trained on '")
    assert "UserWarning" not in done.stderr and "warnings.warn(" not in done.stderr
