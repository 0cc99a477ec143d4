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


def tiny_task(tmp_path: Path, tok) -> list[str]:
    """A tiny random base with SmolLM2's tokenizer, prompts of two categories and a one-answer
    corpus: replay_lookup's --base, --prompts and --corpus."""
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
    return ["--base", str(tmp_path / "base"), "--prompts", str(prompts), "--corpus", str(corpus)]


def test_main_writes_replay_rows(tmp_path, smollm2_tokenizer):
    argv = tiny_task(tmp_path, smollm2_tokenizer)
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


class Scripted:
    """A drafter whose draft after a known sequence of length L is `drafts[L]` (else none)."""

    def __init__(self, drafts):
        self.drafts = drafts

    def lookup(self, sequence):
        return self.drafts.get(len(sequence), [])


def test_replay_accepts_the_drafts_matching_prefix_only():
    answers = [([1, 2], [3, 4, 5, 6, 7, 8])]  # the prefill gave 3; 4..8 remain
    # first token wrong, second right: nothing accepted, 5 steps of one token
    assert replay_lookup.replay_tau(answers, Scripted({3: [9, 5]})) == 1.0


def test_replay_steps_resume_after_the_accepted_tokens_and_the_bonus():
    answers = [([1, 2], [3, 4, 5, 6, 7, 8])]
    # after 3: 4, 5 right (+ bonus 6); after 6: 7 right (+ bonus 8): 5 tokens in 2 steps
    assert replay_lookup.replay_tau(answers, Scripted({3: [4, 5], 6: [7]})) == 2.5


def test_replay_of_answers_without_steps_is_plain_decoding():
    only_prefill = [([1, 2], [3]), ([4], [5])]  # every answer token came from the prefill
    assert replay_lookup.replay_tau(only_prefill, Scripted({})) == 1.0
    assert replay_lookup.replay_tau([], Scripted({})) == 1.0


def test_max_new_tokens_below_one_stops_before_the_base_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(replay_lookup, "load_base", lambda *a, **k: pytest.fail("loaded"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(SystemExit) as stop:
        replay_lookup.main(["--prompts", str(prompts), "--max-new-tokens", "0"])
    assert stop.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_main_replays_the_base_greedy_answers_per_category(
    tmp_path, smollm2_tokenizer, monkeypatch
):

    generated, replays = [], []
    load = replay_lookup.load_base

    def recording_load(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        generate = model.generate

        def recording_generate(ids, **kw):
            out = generate(ids, **kw)
            generated.append((kw["max_new_tokens"], out[0].tolist(), ids.shape[1]))
            return out

        model.generate = recording_generate
        return model, tokenizer

    replay = replay_lookup.replay_tau

    def recording_replay(answers, drafter):
        replays.append((answers, drafter))
        return replay(answers, drafter)

    monkeypatch.setattr(replay_lookup, "load_base", recording_load)
    monkeypatch.setattr(replay_lookup, "replay_tau", recording_replay)
    argv = tiny_task(tmp_path, smollm2_tokenizer)
    argv += ["--min-count", "1", "--min-share", "0.25", "--num-tokens", "3"]
    assert replay_lookup.main([*argv, "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert result["corpus"]["min_share"] == 0.25 and result["corpus"]["min_count"] == 1
    # greedy answers of the default length, split from their prompts where the prompt ends
    assert [n for n, _, _ in generated] == [128, 128]
    wanted = [(seq[:p], seq[p:]) for _, seq, p in generated]
    everything, _, _, corpus_all, _, _ = replays  # per lookup: all answers, then per category
    assert everything[0] == corpus_all[0] == wanted
    assert [r[0] for r in replays[1:3]] == [[wanted[0]], [wanted[1]]]  # math, then coding
    assert [r[1].corpus is None for r in replays] == [True] * 3 + [False] * 3
    for row, calls in zip(result["rows"], (replays[:3], replays[3:])):
        assert row["tau"] == replay(*calls[0])
        assert row["by_category"] == {"math": replay(*calls[1]), "coding": replay(*calls[2])}
