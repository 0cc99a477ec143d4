"""n-gram lookup: the sequence's own n-grams and a corpus table (`NgramTable`)."""

import json

import pytest
import torch

from inference import NgramDrafter, NgramTable, SpeculativeGenerator
from tests.conftest import make_tiny_llama


def test_table_keeps_the_most_frequent_follower_per_context():
    corpus = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [5, 2, 4]]
    table = NgramTable(corpus, max_ngram=2, min_count=1, min_share=0.0)
    assert table.next_token[2][(1, 2)] == 3  # 2 of 3 times
    assert table.next_token[2][(5, 2)] == 4
    assert table.next_token[1][(2,)] == 3  # 3 is seen twice, 4 twice: the first seen wins ties
    assert table.next_token[1][(1,)] == 2
    assert table.num_tokens == 12
    # The defaults keep confident contexts only: seen >= 2 times, best follower >= half.
    table = NgramTable(corpus, max_ngram=2)
    assert table.next_token[2] == {(1, 2): 3}  # (5, 2) -> 4 was seen once
    assert table.next_token[1] == {(1,): 2, (2,): 3}  # (2,) -> 3 is 2 of 4: kept at 0.5
    assert NgramTable(corpus, max_ngram=2, min_share=0.6).next_token[1] == {(1,): 2}
    # Tensor rows count by value, as lists do.
    assert NgramTable(torch.tensor(corpus), max_ngram=2).next_token == table.next_token
    assert table.num_contexts == 3
    assert table.info() == {
        "tokens": 12,
        "contexts": 3,
        "max_ngram": 2,
        "min_count": 2,
        "min_share": 0.5,
    }


def test_continuation_backs_off_to_shorter_contexts():
    table = NgramTable([[1, 2, 3, 4], [9, 3, 7]], max_ngram=3, min_count=1)
    assert table.match([8, 1, 2]) == 2  # (1, 2) is held, (8, 1, 2) is not
    assert table.match([8, 8]) == 0
    # (1, 2) -> 3, then (1, 2, 3) -> 4, then (2, 3, 4): nothing follows 4 anywhere, stop.
    assert table.continuation([8, 1, 2], num_tokens=5) == [3, 4]
    assert table.continuation([6, 9, 3], num_tokens=1) == [7]
    assert table.continuation([6, 6], num_tokens=3) == []


def test_corpus_is_used_where_its_match_is_longer():
    corpus = NgramTable([[10, 11, 12, 13, 14]], max_ngram=4, min_count=1)
    drafter = NgramDrafter(num_tokens=3, corpus=corpus)
    # The sequence holds no earlier 12: the corpus continues 10 11 12.
    assert drafter.lookup(torch.tensor([5, 10, 11, 12])) == [13, 14]
    # The sequence holds "11 12 -> 20" earlier: a 2-gram match against the corpus' 3-gram.
    assert drafter.lookup(torch.tensor([11, 12, 20, 10, 11, 12])) == [13, 14]
    # A tie (2-gram each): the sequence's own continuation wins.
    assert drafter.lookup(torch.tensor([11, 12, 20, 21, 11, 12])) == [20, 21, 11]
    assert NgramDrafter(num_tokens=3).lookup(torch.tensor([5, 10, 11, 12])) == []
    # min_ngram holds for the corpus too: a 1-token context is not enough at min_ngram=2.
    strict = NgramDrafter(num_tokens=3, min_ngram=2, corpus=corpus)
    assert strict.lookup(torch.tensor([5, 13])) == []
    assert drafter.lookup(torch.tensor([5, 13])) == [14]


def test_corpus_of_the_base_own_answers_raises_acceptance_losslessly():
    base = make_tiny_llama()
    torch.manual_seed(3)
    prompts = torch.randint(3, 256, (6, 5))
    answers = base.generate(prompts, max_new_tokens=40, do_sample=False, eos_token_id=None)
    corpus = NgramTable(answers[:, 5:].tolist(), min_count=1)
    taus = {}
    for name, table in (("plain lookup", None), ("corpus", corpus)):
        gen = SpeculativeGenerator(base, NgramDrafter(num_tokens=4, corpus=table))
        out = gen.generate(prompts[:1], max_new_tokens=40, eos_token_id=[])
        assert torch.equal(out.sequences, answers[:1])  # the first answer, regenerated
        taus[name] = out.mean_accepted_length
    assert taus["corpus"] > 2.0 > taus["plain lookup"], taus


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_from_jsonl_reads_assistant_turns_of_sharegpt_and_openai(tmp_path, smollm2_tokenizer):
    _write(
        tmp_path / "a.jsonl",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo yo"}]}],
    )
    _write(
        tmp_path / "b.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "Assistant", "content": "ok"},
                ]
            },
            # distill's mark for an answer cut at max_new_tokens: no end token after it
            {"conversations": [{"from": "gpt", "value": "cut"}], "finished": False},
        ],
    )
    table = NgramTable.from_jsonl(tmp_path, smollm2_tokenizer, eos_token_id=0, min_count=1)
    ids = smollm2_tokenizer(["yo yo", "ok", "cut"], add_special_tokens=False)["input_ids"]
    assert table.num_tokens == sum(map(len, ids)) + 2  # the two finished answers end with 0
    assert table.continuation(ids[0][:1], 1) == ids[0][1:2]  # user turns are not in the table
    assert table.continuation(ids[1], 1) == [0]  # the answer's end
    assert table.continuation(ids[2], 1) == []


def test_from_jsonl_errors_say_what_is_wrong(tmp_path, smollm2_tokenizer):
    with pytest.raises(FileNotFoundError, match="no JSONL answers"):
        NgramTable.from_jsonl(tmp_path / "missing.jsonl", smollm2_tokenizer)
    _write(tmp_path / "u.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}])
    with pytest.raises(ValueError, match="no assistant turns"):
        NgramTable.from_jsonl(tmp_path / "u.jsonl", smollm2_tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"conversations": []}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        NgramTable.from_jsonl(tmp_path / "bad.jsonl", smollm2_tokenizer)
    (tmp_path / "list.jsonl").write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"list.jsonl:1: a record must be a JSON object"):
        NgramTable.from_jsonl(tmp_path / "list.jsonl", smollm2_tokenizer)
    with pytest.raises(ValueError, match="min_count=0"):
        NgramTable([[1, 2]], min_count=0)


def test_the_sequence_match_continues_its_latest_occurrence():
    # (1, 2) occurs at 0 (then 3) and at 3 (then 4): the latest earlier occurrence is proposed,
    # the most recent phrasing being the better guess (prompt lookup's rule)
    drafter = NgramDrafter(num_tokens=3, max_ngram=2)
    assert drafter.lookup(torch.tensor([1, 2, 3, 1, 2, 4, 1, 2])) == [4, 1, 2]


def test_an_unfinished_conversation_leaves_only_its_last_answer_without_the_end(
    tmp_path, smollm2_tokenizer
):
    # distill marks a conversation whose LAST answer was cut (finished: false): the earlier
    # answers of the same record ended by themselves and are followed by the end token
    record = {
        "conversations": [
            {"from": "human", "value": "a"},
            {"from": "gpt", "value": "first answer"},
            {"from": "human", "value": "b"},
            {"from": "gpt", "value": "second cut"},
        ],
        "finished": False,
    }
    (tmp_path / "a.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    table = NgramTable.from_jsonl(tmp_path, smollm2_tokenizer, eos_token_id=0, min_count=1)
    first, cut = smollm2_tokenizer(["first answer", "second cut"], add_special_tokens=False)[
        "input_ids"
    ]
    assert table.num_tokens == len(first) + len(cut) + 1
    assert table.continuation(first, 1) == [0]  # the first answer's end is learnt
    assert table.continuation(cut, 1) == []  # the cut one has none


def test_the_longest_default_arm_is_shorter_on_a_cpu():
    # on a CPU every drafted token costs the verifier; on a GPU a longer chain is nearly free
    drafter = NgramDrafter()
    assert drafter.default_arms(torch.device("cpu")) == [None, {"num_tokens": 3}, {"num_tokens": 6}]
    assert drafter.default_arms(torch.device("cuda"))[-1] == {"num_tokens": 10}


def _latest_longest_match(seq, num_tokens, max_ngram, min_ngram):
    """The rule written out: the longest suffix n-gram with an earlier occurrence, the latest
    such occurrence's followers."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(seq) - n) if seq[s : s + n] == seq[len(seq) - n :]]
        if starts:
            return seq[starts[-1] + n : starts[-1] + n + num_tokens]
    return []


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_the_sequence_lookup_follows_its_rule_on_random_sequences(max_ngram, min_ngram):
    generator = torch.Generator().manual_seed(0)
    drafter = NgramDrafter(num_tokens=4, max_ngram=max_ngram, min_ngram=min_ngram)
    for length in [1, 2, 3, 5, 8, 13, 40, 200]:
        for _ in range(20):  # 6 token values: matches of every length, some near the end
            seq = torch.randint(0, 6, (length,), generator=generator)
            expected = _latest_longest_match(seq.tolist(), 4, max_ngram, min_ngram)
            assert drafter.lookup(seq) == expected, seq.tolist()


def test_the_corpus_continues_a_long_sequence_from_its_suffix():
    # (7, 2, 3) -> 10 once, (2, 3) -> 20 twice: the 3-token context decides, and only a suffix
    # of max_ngram tokens holds it
    corpus = NgramTable(
        [[7, 2, 3, 10], [8, 2, 3, 20], [9, 2, 3, 20]], max_ngram=3, min_count=1, min_share=0.0
    )
    drafter = NgramDrafter(num_tokens=3, corpus=corpus)
    sequence = torch.cat([torch.arange(100, 1100), torch.tensor([7, 2, 3])])
    assert drafter.lookup(sequence) == [10]
    assert drafter.lookup(torch.cat([torch.arange(100, 1100), torch.tensor([2, 3])])) == [20]


def test_a_corpus_context_longer_than_the_drafters_ngrams_decides():
    # (1, 2, 3, 4) -> 10 once; (2, 3, 4) and (3, 4) -> 20 twice: only the 4-token context,
    # which the drafter's 2-gram lookup of the sequence would not reach, gives 10
    corpus = NgramTable(
        [[1, 2, 3, 4, 10], [8, 2, 3, 4, 20], [9, 2, 3, 4, 20]],
        max_ngram=4,
        min_count=1,
        min_share=0.0,
    )
    drafter = NgramDrafter(num_tokens=2, max_ngram=2, corpus=corpus)
    assert drafter.lookup(torch.cat([torch.arange(100, 200), torch.tensor([1, 2, 3, 4])])) == [10]
    assert drafter.lookup(torch.cat([torch.arange(100, 200), torch.tensor([7, 2, 3, 4])])) == [20]
