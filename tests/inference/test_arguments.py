"""generate's arguments and prompt checked on their own: valid ones normalised, each invalid
one refused with its message, EOS ids, pad tokens, prompt ids; then through a generator:
generate's defaults (stream's), the default seed, trees and a prompt at the context's end."""

from __future__ import annotations

import inspect
import warnings
from collections import UserDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inference import Drafter, SpeculativeGenerator
from inference.arguments import check_generation_arguments, eos_ids, warn_pad_in_prompt
from inference.drafters import build
from inference.prompt import prompt_ids
from tests.conftest import make_tiny_llama


def check(**kw):
    args = dict(
        max_new_tokens=4,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        acceptance="lossless",
        stop_strings=None,
        tokenizer=None,
    )
    return check_generation_arguments(**{**args, **kw})


def test_valid_arguments_are_normalised():
    assert check(max_new_tokens=np.int64(3)) == (3, None)
    assert check(stop_strings="###", tokenizer=SimpleNamespace(decode=str)) == (4, ["###"])
    for given in ({"###"}, ("###",), (s for s in ["###"]), np.array(["###"])):  # as a list
        assert check(stop_strings=given, tokenizer=SimpleNamespace(decode=str)) == (4, ["###"])
    assert check(temperature=0.7, top_k=5, top_p=1.0) == (4, None)
    assert check(temperature=0.7, top_p=1.0, acceptance="typical") == (4, None)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
        (dict(top_p=0.0), ValueError, "0 < top_p <= 1"),
        (dict(top_p=1.5), ValueError, "0 < top_p <= 1"),
        (dict(temperature=-0.1), ValueError, "temperature >= 0"),
        (dict(temperature=float("nan")), ValueError, "temperature >= 0"),
        (dict(top_k=-1), ValueError, "top_k >= 0"),
        (dict(top_k=True), TypeError, "top_k an int"),
        (dict(acceptance="exact"), ValueError, "acceptance must be"),
        (dict(stop_strings=["\n\n"]), ValueError, "need the tokenizer"),
        (dict(stop_strings="\n\n"), ValueError, "need the tokenizer"),
        (dict(stop_strings=5), TypeError, "stop_strings must be a string or a list of them"),
        (dict(stop_strings=["a", 5]), TypeError, "stop_strings must be a string or a list"),
        (dict(stop_strings="x", tokenizer="gpt2"), TypeError, "tokenizer='gpt2' has no decode"),
        (dict(seed="a"), TypeError, "seed must be an int, or None"),
        (dict(seed=True), TypeError, "seed must be an int, or None"),
        (dict(seed=2**64), ValueError, r"seed must be in \[-2\*\*63, 2\*\*64\), got 1844"),
        (dict(seed=-(2**63) - 1), ValueError, r"seed must be in \[-2\*\*63"),
        (
            dict(acceptance="typical", temperature=0.7, top_p=0.9),
            ValueError,
            "without top_k / top_p",
        ),
        (dict(acceptance="typical", temperature=0.7, top_k=5), ValueError, "without top_k / top_p"),
    ],
)
def test_invalid_arguments_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        check(**kw)


@pytest.mark.parametrize("kw", [dict(top_p=None), dict(temperature=None)])
def test_typical_acceptance_says_which_argument_is_no_number(kw):
    # its own rule reads temperature and top_p: they are checked to be numbers first
    with pytest.raises(TypeError, match="temperature and top_p must be numbers"):
        check(acceptance="typical", **{"temperature": 0.7, **kw})


def test_eos_ids_prefer_the_generation_config_as_hf_does():
    base = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=[5, 7]),
        config=SimpleNamespace(eos_token_id=2),
    )
    assert eos_ids(base, None) == {5, 7}
    assert eos_ids(base, torch.tensor([3])) == {3}
    assert eos_ids(base, {9, 8}) == {8, 9}
    assert eos_ids(SimpleNamespace(generation_config=None, config=base.config), None) == {2}
    assert eos_ids(base, []) == set()  # no EOS: generate to max_new_tokens
    for wrong in ("2", 2.0, [2, "3"], True):
        with pytest.raises(TypeError, match="eos_token_id must be a token id"):
            eos_ids(base, wrong)


def test_a_pad_token_that_is_an_eos_token_is_not_warned_of():
    """HF masks the pad token unless it is an EOS token; such a prompt is read as HF reads it."""
    base = SimpleNamespace(generation_config=SimpleNamespace(pad_token_id=0), config=None)
    ids = torch.tensor([4, 0, 5])
    with pytest.warns(UserWarning, match=r"holds the pad token \(0\) at positions \[1\]"):
        warn_pad_in_prompt(base, ids, None, eos={2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_pad_in_prompt(base, ids, None, eos={0})
        warn_pad_in_prompt(base, ids, torch.ones(3), eos={2})  # a mask given: nothing to say


def test_prompt_ids_take_one_sequence_and_refuse_the_rest():
    ids = torch.tensor([[3, 4, 5]])
    assert prompt_ids(ids, torch.ones(1, 3, dtype=torch.long)).tolist() == [3, 4, 5]
    assert prompt_ids([3, 4], [1, 1]).tolist() == [3, 4]
    with pytest.raises(ValueError, match="input_ids is empty"):
        prompt_ids(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids is empty"):
        prompt_ids([])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2,\) for 3 prompt tokens"):
        prompt_ids(ids, torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="masks some prompt tokens"):
        prompt_ids(ids, torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="masks some prompt tokens"):
        prompt_ids(ids, torch.tensor([0, 0, 0]))
    with pytest.raises(TypeError, match="input_ids is text"):
        prompt_ids([3, "four"])
    for wrong in (ids.float(), ids.bool()):  # a tensor of another dtype than the tokenizer's
        with pytest.raises(TypeError, match=f"input_ids are {wrong.dtype}: token ids are integers"):
            prompt_ids(wrong)
    assert prompt_ids(ids.int()).tolist() == [3, 4, 5]


def test_a_numpy_seed_and_small_integer_ids_are_taken_as_python_ints_and_long_ids():
    gen = SpeculativeGenerator(make_tiny_llama(), None, num_tokens=3)
    prompt = torch.tensor([[5, 6, 7]])
    kw = dict(max_new_tokens=6, temperature=1.0)
    sampled = gen.generate(prompt, seed=3, **kw).sequences
    for seed in (np.int64(3), torch.tensor(3)):
        assert torch.equal(gen.generate(prompt, seed=seed, **kw).sequences, sampled)
    greedy = gen.generate(prompt, max_new_tokens=4).sequences
    for dtype in (torch.uint8, torch.int16, torch.int32):
        assert torch.equal(gen.generate(prompt.to(dtype), max_new_tokens=4).sequences, greedy)


def test_token_ids_past_the_bases_embeddings_are_refused():
    """Another model's tokenizer: ids past the base's embeddings, said before any forward."""
    gen = SpeculativeGenerator(make_tiny_llama(), None, num_tokens=3)  # 256 embeddings
    for outside in (256, -1):
        with pytest.raises(ValueError, match=f"token id {outside}, outside the base's 256 emb"):
            gen.generate(torch.tensor([[5, outside, 7]]), max_new_tokens=2)
    assert gen.generate(torch.tensor([[1, 255]]), max_new_tokens=2).sequences.shape == (1, 4)


class Plain(Drafter):
    """A drafter that takes no options."""

    def __init__(self) -> None:
        pass


def test_an_option_given_to_a_drafter_that_takes_none_says_so():
    with pytest.raises(TypeError, match=r"^Plain takes no option 'depth' \(its options: none\)$"):
        build(Plain, depth=2)


def test_a_tree_verifies_while_its_bonus_token_still_has_a_position():
    base = make_tiny_llama()  # 512 positions
    limit = base.config.max_position_embeddings
    prompt = torch.randint(3, 256, (1, limit - 9), generator=torch.Generator().manual_seed(0))
    ref = base.generate(prompt, max_new_tokens=9, do_sample=False, eos_token_id=None)
    gen = SpeculativeGenerator(base, base, num_tokens=3)  # a perfect chain: 4 tokens a step
    with pytest.warns(UserWarning, match="context length .512 positions. after 9 of"):
        out = gen.generate(prompt, max_new_tokens=50, eos_token_id=[])
    assert torch.equal(out.sequences, ref)
    # The prefill's token sits at limit - 9; the second tree's 4 nodes fill positions
    # limit - 5 .. limit - 2 and its bonus token the last one, limit - 1.
    assert out.accepted_lengths == [4, 4]


def test_a_prompt_that_fills_the_context_still_gets_the_prefills_token():
    base = make_tiny_llama()
    limit = base.config.max_position_embeddings
    prompt = torch.randint(3, 256, (1, limit), generator=torch.Generator().manual_seed(1))
    ref = base.generate(prompt, max_new_tokens=1, do_sample=False, eos_token_id=None)
    gen = SpeculativeGenerator(base, None, num_tokens=3)
    with pytest.warns(UserWarning, match="context length .512 positions. after 1 of"):
        out = gen.generate(prompt, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(out.sequences, ref) and out.num_steps == 0


def test_generate_takes_the_arguments_and_defaults_of_stream():
    # stream's docstring sends its readers to generate's: the two must not drift apart
    # (stream yields what generate hands a streamer; generate's output holds stream's stats)
    generate = inspect.signature(SpeculativeGenerator.generate).parameters
    stream = inspect.signature(SpeculativeGenerator.stream).parameters
    assert {name: p.default for name, p in generate.items() if name != "streamer"} == {
        name: p.default for name, p in stream.items() if name != "stats"
    }


def test_sampling_without_a_seed_given_repeats_its_text():
    base = make_tiny_llama()
    gen = SpeculativeGenerator(base, base, num_tokens=3)
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    first = gen.generate(prompt, max_new_tokens=12, temperature=1.0, eos_token_id=[])
    again = gen.generate(prompt, max_new_tokens=12, temperature=1.0, eos_token_id=[])
    other = gen.generate(prompt, max_new_tokens=12, temperature=1.0, seed=1, eos_token_id=[])
    assert torch.equal(first.sequences, again.sequences)  # the default seed, 0
    assert not torch.equal(first.sequences, other.sequences)


def test_a_tokenizers_batch_encoding_is_named_not_read_as_ids():
    """transformers' BatchEncoding is a UserDict, not a dict."""
    encoding = UserDict(input_ids=[[3, 4, 5]], attention_mask=[[1, 1, 1]])
    with pytest.raises(TypeError, match=r"tokenizer's output dict: pass its \['input_ids'\]"):
        prompt_ids(encoding)


def test_a_single_token_id_is_not_a_prompt():
    with pytest.raises(ValueError, match=r"must be \(1, T\) or \(T,\), got shape \(\)"):
        prompt_ids(torch.tensor(5))
    assert prompt_ids([5]).tolist() == [5]


def test_a_mask_of_another_shape_than_the_prompt_is_refused():
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\) for 3 prompt tokens"):
        prompt_ids(ids, torch.ones(2, 3, dtype=torch.long))  # a batch's mask
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 4\) for 3 prompt tokens"):
        prompt_ids(ids, torch.ones(1, 4, dtype=torch.long))


def test_an_empty_stop_string_is_refused():
    tokenizer = SimpleNamespace(decode=str)
    kw = dict(max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0, acceptance="lossless")
    assert check_generation_arguments(stop_strings=["###"], tokenizer=tokenizer, **kw) == (
        4,
        ["###"],
    )
    for given in (["", "###"], ""):
        with pytest.raises(ValueError, match="holds an empty string, which matches anywhere"):
            check_generation_arguments(stop_strings=given, tokenizer=tokenizer, **kw)


def test_hf_generate_arguments_are_refused_with_what_to_give_instead():
    gen = SpeculativeGenerator(make_tiny_llama(), None)
    prompt = torch.tensor([[5, 6, 7]])
    expected = {
        "do_sample": "sampling is temperature > 0",
        "max_length": "give max_new_tokens",
        "pad_token_id": "one sequence needs no padding",
        "repetition_penalty": "not applied: the verifier keeps the base's own distribution",
        "output_scores": "the output is a GenerationOutput",
        "assistant_model": r"the drafter is the generator.s: SpeculativeGenerator\(base, draft_model\)",
    }
    for name, says in expected.items():
        with pytest.raises(
            TypeError, match=rf"^generate\(\) takes no '{name}' .HF generate's.: {says}"
        ):
            gen.generate(prompt, max_new_tokens=2, **{name: 1})
        with pytest.raises(TypeError, match=rf"^stream\(\) takes no '{name}'"):
            next(gen.stream(prompt, max_new_tokens=2, **{name: 1}))
    with pytest.raises(
        TypeError, match=r"^generate\(\) got an unexpected keyword argument 'max_new_token'$"
    ):
        gen.generate(prompt, max_new_token=2)
