"""When generation stops: eos (the generation config's, as HF), stop strings (as HF reads them,
one beginning in the prompt too), max_new_tokens, streaming."""

import pytest
import torch

from inference import SpeculativeGenerator
from inference.stopping import Stopping
from tests.conftest import make_tiny_llama, user_prompt_ids


def test_eos_stop_strings_streaming_and_stats():
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 6))
    ref = base.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)[
        0, 6:
    ].tolist()
    gen = SpeculativeGenerator(base, base, num_tokens=3)
    eos = ref[5]
    out = gen.generate(prompt, max_new_tokens=20, eos_token_id=eos)
    assert out.sequences[0, 6:].tolist() == ref[: ref.index(eos) + 1] and out.finished
    steps = list(gen.stream(prompt, max_new_tokens=20, eos_token_id=[]))
    assert sum(steps, []) == ref and steps[0] == ref[:1]
    full = gen.generate(prompt, max_new_tokens=20, eos_token_id=[])
    assert not full.finished and full.sequences.shape[1] == 26
    assert (
        set(full.timings) == {"base", "draft", "other", "total", "prefill_base", "prefill_draft"}
        and full.timings["total"] > 0
    )

    class Tok:  # a tokenizer whose text is the token ids
        def decode(self, ids):
            return " ".join(map(str, ids))

    stop = f"{ref[3]} {ref[4]}"
    out = gen.generate(
        prompt, max_new_tokens=20, eos_token_id=[], stop_strings=[stop], tokenizer=Tok()
    )
    new = out.sequences[0, 6:].tolist()
    assert stop in Tok().decode(new) and out.finished
    assert stop not in Tok().decode(new[:-1])  # cut at the token that completes it, as HF does
    assert new == ref[: len(new)]
    assert out.sequences.shape[1] - 6 < 20


def test_stop_strings_as_hf_reads_them(smollm2_tokenizer):
    """A stop string may begin in the prompt and end in the answer (a chat prompt ends in
    "assistant\n": "\n\n" ends one token in); one wholly in the prompt stops nothing; a single
    string is one stop string, not its characters. HF `generate` is the reference."""
    tok = smollm2_tokenizer
    base = make_tiny_llama(vocab_size=len(tok), max_position_embeddings=512)
    base.generation_config.eos_token_id = None
    prompt = user_prompt_ids(tok, "Write a haiku about rain.")
    n = prompt.shape[1]
    plain = base.generate(prompt, max_new_tokens=12, do_sample=False)[0, n:].tolist()
    prompt_text, answer = tok.decode(prompt[0]), tok.decode(plain)
    gen = SpeculativeGenerator(base, base, num_tokens=3)  # runs of several accepted tokens
    stops = {
        "spans the prompt's end": prompt_text[-3:] + answer[:2],
        "in the prompt only": prompt_text[-12:-4],
        "a single string": answer[5:8],
        "absent, its characters not": "\x00" + answer[:3],
    }
    for what, stop in stops.items():
        for given in (stop, [stop]):
            kw = {"max_new_tokens": 12, "stop_strings": given, "tokenizer": tok}
            ref = base.generate(prompt, do_sample=False, **kw)[0, n:].tolist()
            out = gen.generate(prompt, **kw).sequences[0, n:].tolist()
            assert out == ref, (what, given, out, ref)
    assert len(gen.generate(prompt, **kw).sequences[0, n:]) == 12  # the absent one


def test_eos_comes_from_the_generation_config_as_in_hf():
    """A generation config without eos does not stop at the model config's eos (HF's rule)."""
    base = make_tiny_llama()
    prompt = torch.tensor([[5, 6, 7]])
    ref = base.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)[0, 3:]
    base.config.eos_token_id = int(ref[1])
    base.generation_config.eos_token_id = None
    hf = base.generate(prompt, max_new_tokens=10, do_sample=False)
    out = SpeculativeGenerator(base, None, num_tokens=3).generate(prompt, max_new_tokens=10)
    assert torch.equal(out.sequences, hf) and out.sequences.shape[1] == 13
    base.generation_config.eos_token_id = int(ref[1])
    out = SpeculativeGenerator(base, None, num_tokens=3).generate(prompt, max_new_tokens=10)
    assert out.sequences[0, 3:].tolist() == ref[:2].tolist() and out.finished


class ByteTokenizer:
    """Byte-level tokens: token id = one byte; a character's bytes not all there decode to
    U+FFFD, as a byte-level BPE's do."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_stop_string_ending_in_a_character_split_over_tokens_is_found():
    emoji = list("😀".encode())  # 4 byte tokens, one character
    stopping = Stopping(list(b"hi"), 10, set(), ["😀"], ByteTokenizer())
    new, done = stopping.cut(emoji[:2])  # "hi\ufffd": the character is still coming
    assert new == emoji[:2] and not done
    new, done = stopping.cut(emoji[2:] + list(b"x"))
    assert new == emoji[2:] and done and stopping.finished  # cut at the completing token


@pytest.mark.parametrize("prompt, stop", [("ab X😀", "X😀Y"), ("ab X😀😀", "😀😀Y")])
def test_a_stop_string_beginning_in_a_prompt_tail_of_multibyte_tokens_is_found(prompt, stop):
    # The prompt ends in emoji of 4 byte tokens each: a stop string that begins there needs more
    # prompt tokens than twice its characters ("😀😀Y": 9 tokens, 3 characters).
    stopping = Stopping(list(prompt.encode()), 10, set(), [stop], ByteTokenizer())
    new, done = stopping.cut(list(b"YZ"))
    assert new == list(b"Y") and done and stopping.finished


class CountingTokenizer(ByteTokenizer):
    """Records how many tokens each decode reads."""

    def __init__(self):
        self.read = []

    def decode(self, ids):
        self.read.append(len(ids))
        return super().decode(ids)


def test_stop_strings_are_read_in_a_window_that_does_not_grow_with_the_answer():
    tok = CountingTokenizer()
    stop = "END😀"  # 7 bytes: the window holds 14 tokens
    stopping = Stopping(list(b"a long prompt " * 20), 10_000, set(), [stop], tok)
    text = b"no stop string here, " * 200 + "END😀 and after".encode()
    steps = [list(text[i : i + 3]) for i in range(0, len(text), 3)]
    kept = []
    for new in steps:
        new, done = stopping.cut(new)
        kept += new
        if done:
            break
    assert bytes(kept).decode() == (b"no stop string here, " * 200).decode() + stop
    assert stopping.finished and max(tok.read) == 14 + 3  # the window and one step's tokens


def test_an_empty_stop_string_is_refused():
    base = make_tiny_llama()
    gen = SpeculativeGenerator(base, None, num_tokens=3)
    with pytest.raises(ValueError, match="empty string"):
        gen.generate(
            torch.tensor([[5, 6, 7]]),
            max_new_tokens=4,
            stop_strings=["x", ""],
            tokenizer=ByteTokenizer(),
        )


def test_a_stop_string_ending_where_the_prompt_ends_does_not_stop_the_answer():
    stopping = Stopping(list(b"say END"), 10, set(), ["END"], ByteTokenizer())
    new, done = stopping.cut(list(b"ok"))
    assert new == list(b"ok") and not done and not stopping.finished
    new, done = stopping.cut(list(b" END!"))
    assert new == list(b" END") and done and stopping.finished
    assert stopping.generated == list(b"ok END")


class Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_a_streamer_is_given_the_prompt_then_each_steps_tokens_then_end():
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    hf = Recorder()
    ref = base.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, streamer=hf)
    ours = Recorder()
    gen = SpeculativeGenerator(base, base, num_tokens=3)  # several tokens a step
    out = gen.generate(prompt, max_new_tokens=20, eos_token_id=[], streamer=ours)
    assert torch.equal(out.sequences, ref)
    assert ours.puts[0] == hf.puts[0] == prompt[0].tolist() and ours.ended == hf.ended == 1
    assert sum(ours.puts[1:], []) == sum(hf.puts[1:], []) == ref[0, 6:].tolist()
    # the prefill's token, then one put per verify step
    assert [len(p) for p in ours.puts[1:]] == [1, *out.accepted_lengths]
    with pytest.raises(TypeError, match="streamer=.* has no put.. and end..: give a transformers"):
        gen.generate(prompt, max_new_tokens=2, streamer=print)


def test_transformers_text_streamer_prints_what_it_prints_under_hf_generate(
    smollm2_tokenizer, capsys
):
    from transformers import TextStreamer

    tok = smollm2_tokenizer
    base = make_tiny_llama(vocab_size=len(tok), max_position_embeddings=512)
    prompt = user_prompt_ids(tok, "Write a haiku about rain.")
    kw = {"max_new_tokens": 40, "eos_token_id": None}
    base.generate(prompt, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True), **kw)
    hf = capsys.readouterr().out
    gen = SpeculativeGenerator(base, base, num_tokens=3)
    kw["eos_token_id"] = []
    gen.generate(prompt, streamer=TextStreamer(tok, skip_prompt=True), **kw)
    ours = capsys.readouterr().out
    assert ours == hf and len(hf.strip()) > 0
