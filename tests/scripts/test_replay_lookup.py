"""scripts/replay_lookup.py: exact tau of n-gram drafting replayed over given answers."""

import json
import sys
from pathlib import Path

import pytest

from inference import NgramDrafter, NgramTable
from tests.conftest import make_tiny_llama

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import replay_lookup  # noqa: E402  (scripts/ is not a package)


def test_replay_counts_matching_draft_tokens_plus_the_bonus():
    answers = [([1, 2, 3], [4, 5, 6, 7])]  # the prefill gave 4; 5, 6, 7 remain to gain
    corpus = NgramTable([[3, 4, 5, 6, 9]], min_count=1)
    # (3, 4) -> 5 -> 6 are right, one step gains them plus the bonus 7.
    assert replay_lookup.replay_tau(answers, NgramDrafter(num_tokens=2, corpus=corpus)) == 3.0
    # Drafting 3: 5, 6 right, 9 wrong: the same step, the bonus is 7.
    assert replay_lookup.replay_tau(answers, NgramDrafter(num_tokens=3, corpus=corpus)) == 3.0
    # Prompt lookup alone finds nothing here: one token per step.
    assert replay_lookup.replay_tau(answers, NgramDrafter(num_tokens=2)) == 1.0
    # A wrong first guess: nothing accepted, 3 steps of one token.
    wrong = NgramTable([[4, 8, 8], [5, 8, 8], [6, 8, 8]], min_count=1)
    assert replay_lookup.replay_tau(answers, NgramDrafter(num_tokens=2, corpus=wrong)) == 1.0
    # A draft right to the answer's end: its 2 tokens, no bonus past the end (the generator
    # keeps none there)
    short = [([1, 2, 3], [4, 5, 6])]
    assert replay_lookup.replay_tau(short, NgramDrafter(num_tokens=3, corpus=corpus)) == 2.0


def test_bad_input_stops_with_its_message_before_the_base_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(replay_lookup, "load_base", lambda *a, **k: pytest.fail("loaded"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for source in (str(tmp_path / "missing.jsonl"), str(empty)):
        assert replay_lookup.main(["--prompts", source, "--out", str(tmp_path / "o")]) == 2
        assert "replay_lookup failed: prompt source" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        replay_lookup.main(["--prompts", str(empty), "--limit", "0"])
    assert stop.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_main_writes_replay_rows(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    base = make_tiny_llama(0, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **ids)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"category": c, "turns": [f"Tell me about {c}."]} for c in ("math", "coding")]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = tmp_path / "answers.jsonl"
    answer = {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "Yes."}]}
    corpus.write_text(json.dumps(answer) + "\n")
    argv = ["--base", str(tmp_path / "base"), "--prompts", str(prompts), "--corpus", str(corpus)]
    argv += ["--min-count", "1", "--num-tokens", "2,3", "--max-new-tokens", "6"]
    assert replay_lookup.main([*argv, "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert result["count"] == 2 and result["corpus"]["contexts"] >= 1
    assert [(r["lookup"], r["num_tokens"]) for r in result["rows"]] == [
        ("prompt", 2),
        ("prompt+corpus", 2),
        ("prompt", 3),
        ("prompt+corpus", 3),
    ]
    for row in result["rows"]:
        assert set(row["by_category"]) == {"math", "coding"}
        assert row["tau"] >= 1.0 and all(v >= 1.0 for v in row["by_category"].values())


@pytest.mark.parametrize("bad", ["0", "x"])
def test_bad_chain_length_is_an_error(bad, tmp_path):
    with pytest.raises(SystemExit):
        replay_lookup.parse_chain_lengths(bad)
