"""chat.py's turns and stats line: /reset keeps the system prompt, seeds per answer, empty lines,
a conversation that just fits, --compare's speedup and "different" verdict, characters split
over steps, --lookup beside heads, Medusa-2 heads on their merged base."""

import copy
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import chat  # noqa: E402  (scripts/ is not a package)


def _stub_answers(monkeypatch, new=(330, 331, 332), seconds=1.0):
    """chat.answer replaced: records (the messages' prompt ids, the seed) and answers `new`."""
    calls = []

    def answer(gen, ids, args, tokenizer, eos, seed):
        calls.append((ids, seed))
        print(tokenizer.decode(list(new)))
        return list(new), seconds, 1.0

    monkeypatch.setattr(chat, "answer", answer)
    return calls


def _conversations(monkeypatch):
    """The messages of every turn sent to the template, as chat.prompt_ids was given them."""
    seen, prompt_ids = [], chat.prompt_ids

    def spy(messages, tokenizer):
        seen.append(copy.deepcopy(messages))
        return prompt_ids(messages, tokenizer)

    monkeypatch.setattr(chat, "prompt_ids", spy)
    return seen


def _main(monkeypatch, lines, *argv):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    return chat.main([*argv, "--threads", "1"])


def test_reset_keeps_the_system_prompt(folders, monkeypatch):
    _stub_answers(monkeypatch)
    seen = _conversations(monkeypatch)
    argv = ["--base", str(folders["base"]), "--system-prompt", "Be brief."]
    assert _main(monkeypatch, ["Hi.", "/reset", "Again."], *argv) == 0
    system = {"role": "system", "content": "Be brief."}
    assert seen[0] == [system, {"role": "user", "content": "Hi."}]
    assert seen[1] == [system, {"role": "user", "content": "Again."}]


def test_each_answer_takes_the_next_seed_and_empty_lines_are_no_turns(folders, monkeypatch):
    calls = _stub_answers(monkeypatch)
    seen = _conversations(monkeypatch)
    argv = ["--base", str(folders["base"]), "--seed", "7", "--temperature", "0.5"]
    assert _main(monkeypatch, ["Hi.", "", "Again."], *argv) == 0
    assert [seed for _, seed in calls] == [7, 8]
    users = [m["content"] for m in seen[-1] if m["role"] == "user"]
    assert users == ["Hi.", "Again."]  # the empty line sent no turn


def test_a_conversation_that_just_fits_the_context_is_answered(folders, monkeypatch, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    length = chat.prompt_ids([{"role": "user", "content": "Hi."}], tokenizer).shape[1]
    calls = _stub_answers(monkeypatch)
    argv = ["--base", str(folders["base"]), "--max-new-tokens", str(2048 - length)]
    assert _main(monkeypatch, ["Hi."], *argv) == 0  # prompt + answer = 2,048 positions
    assert len(calls) == 1 and "passes the base's context" not in capsys.readouterr().err


def test_a_conversation_grown_past_the_context_is_told_to_reset(folders, monkeypatch, capsys):
    """Each message fits alone; the second, after the first and its answer, does not: /reset."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    calls = _stub_answers(monkeypatch)
    text = "word " * 150
    alone = chat.prompt_ids([{"role": "user", "content": text}], tokenizer).shape[1]
    argv = ["--base", str(folders["base"]), "--max-new-tokens", str(2048 - alone)]
    assert _main(monkeypatch, [text, text, "/reset", text], *argv) == 0
    err = capsys.readouterr().err
    assert len(calls) == 2  # the first and the one after /reset
    assert "(not sent: the conversation has" in err and "/reset to start anew" in err
    assert torch.equal(calls[1][0], calls[0][0])  # sent again alone after /reset


def test_compare_reports_the_speedup_over_hf(folders, monkeypatch, capsys):
    # the answer: 10 tokens in 1 s; HF greedy: the same 10 tokens in 4 s, so 4.00x
    _stub_answers(monkeypatch, new=[5] * 10, seconds=1.0)
    monkeypatch.setattr(
        chat, "hf_runner", lambda *a, **k: lambda ids, seed: SimpleNamespace(new_ids=[5] * 10)
    )
    clock = iter([100.0, 104.0])
    monkeypatch.setattr(chat, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert _main(monkeypatch, ["Hi."], "--base", str(folders["base"]), "--compare") == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert stats == [
        "[10 tokens in 1.0 s: 10.0 tok/s, tau 1.00; HF greedy 2.5 tok/s, 4.00x, identical]"
    ]


def test_an_answer_cut_at_max_new_tokens_is_said_so(folders, monkeypatch, capsys):
    """Three tokens, none an end of turn, with --max-new-tokens 3: the answer did not end."""
    _stub_answers(monkeypatch, new=(330, 331, 332))
    argv = ["--base", str(folders["base"]), "--max-new-tokens"]
    assert _main(monkeypatch, ["Hi."], *argv, "3") == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert stats == ["[3 tokens in 1.0 s: 3.0 tok/s, tau 1.00; cut at --max-new-tokens 3]"]
    assert _main(monkeypatch, ["Hi."], *argv, "4") == 0  # ended before the limit
    assert "cut at" not in capsys.readouterr().err
    monkeypatch.setattr(chat, "stop_token_ids", lambda base, tokenizer: [332])
    assert _main(monkeypatch, ["Hi."], *argv, "3") == 0  # its last token ends the turn
    assert "cut at" not in capsys.readouterr().err


def test_a_character_split_over_steps_is_shown_once_whole(capsys):
    # the tokenizer decodes a character's first byte alone as U+FFFD: it waits for the rest
    texts = {(1,): "a", (1, 2): "a\ufffd", (1, 2, 3): "a\u00e9"}
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[tuple(ids)])

    def stream(ids, stats, **kwargs):
        stats["accepted_lengths"] = [1, 1, 1]
        yield from ([1], [2], [3])

    args = SimpleNamespace(max_new_tokens=3, temperature=0.0, top_p=1.0, top_k=0)
    new, _, tau = chat.answer(SimpleNamespace(stream=stream), None, args, tokenizer, [], 0)
    assert new == [1, 2, 3] and tau == 1.0
    assert capsys.readouterr().out == "a\u00e9\n"


def test_lookup_beside_heads_drafts_with_them(folders):
    from heads import load_base
    from inference import NgramDrafter
    from inference.drafters.union import UnionDrafter

    base, tokenizer = load_base(str(folders["base"]), device="cpu")
    args = chat.parse_args(["--heads", str(folders["medusa"]), "--lookup"])
    gen = chat.build_generator(args, base, tokenizer)
    assert isinstance(gen.drafter, UnionDrafter)
    assert any(isinstance(d, NgramDrafter) for d in gen.drafter.drafters)


def test_medusa2_heads_chat_on_the_base_with_their_adapter_merged(
    folders, tmp_path, monkeypatch, capsys
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from heads import MedusaConfig, MedusaHeads
    from heads.lora import lora_probe

    plain = AutoModelForCausalLM.from_pretrained(folders["base"], dtype=torch.float32)
    plain.config.name_or_path = str(folders["base"])
    adapted = get_peft_model(copy.deepcopy(plain), LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    adapted.save_pretrained(tmp_path / "m2" / "lora")
    config = MedusaConfig.from_base(
        plain.config, num_heads=2, base_lora="lora", base_lora_probe=lora_probe(adapted)
    )
    MedusaHeads(config).init_from_base(plain).save_pretrained(tmp_path / "m2")
    argv = [
        "--base",
        str(folders["base"]),
        "--heads",
        str(tmp_path / "m2"),
        "--max-new-tokens",
        "2",
    ]
    assert _main(monkeypatch, ["Hi."], *argv) == 0
    err = capsys.readouterr().err
    assert "chat: the base with the LoRA adapter of the Medusa-2 heads" in err
    assert "trained on the base with the LoRA adapter" not in err  # no warning of an unmerged one


def test_compare_says_an_answer_that_stops_early_differs(folders, monkeypatch, capsys):
    # the answer is HF's first 10 tokens, but HF went on: not the same answer
    _stub_answers(monkeypatch, new=[330] * 10)
    monkeypatch.setattr(
        chat, "hf_runner", lambda *a, **k: lambda ids, seed: SimpleNamespace(new_ids=[330] * 12)
    )
    assert _main(monkeypatch, ["Hi."], "--base", str(folders["base"]), "--compare") == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert len(stats) == 1 and "DIFFERENT from HF's" in stats[0] and "identical" not in stats[0]
