"""The core invariant on the real embedded model: greedy speculative output equals
`base.generate(do_sample=False)` token for token in fp32, for every kind of drafter."""

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import SpeculativeGenerator
from tests.conftest import user_prompt_ids

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is, step by step."]


@pytest.mark.slow
def test_greedy_identical_on_smollm2(smollm2):
    base, tokenizer = smollm2
    torch.manual_seed(0)
    eagle3 = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=4096))
    eagle3.set_vocab_map(torch.arange(4096))
    drafters = {
        "ngram": (None, {"num_tokens": 4}),
        "medusa-fresh": (
            MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base),
            {"choices": "chain-2"},
        ),
        "eagle3-random": (eagle3, {"top_k": 2, "depth": 3, "total_tokens": 6}),
        "medusa-adaptive": (
            MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base),
            {},
        ),
    }
    for prompt in PROMPTS:
        ids = user_prompt_ids(tokenizer, prompt)
        ref = base.generate(ids, max_new_tokens=64, do_sample=False)
        for name, (heads, options) in drafters.items():
            out = SpeculativeGenerator(base, heads, **options).generate(ids, max_new_tokens=64)
            assert torch.equal(out.sequences, ref), (name, prompt)


@pytest.mark.slow
def test_a_stop_string_ending_in_a_character_of_several_tokens(smollm2):
    """An emoji's UTF-8 bytes come in several byte-level tokens, the text decoding to U+FFFD
    until the last: the token that completes it stops generation, as in HF `generate`."""
    base, tokenizer = smollm2
    ids = user_prompt_ids(
        tokenizer, "Write three emojis about rain and a French sentence with accents."
    )
    n = ids.shape[1]
    answer = base.generate(ids, max_new_tokens=24, do_sample=False)[0, n:].tolist()
    text = tokenizer.decode(answer)
    emoji = next(c for c in text if len(c.encode()) == 4)  # the answer's first emoji
    cut = next(i for i in range(1, 25) if emoji in tokenizer.decode(answer[:i]))
    assert "\ufffd" in tokenizer.decode(answer[: cut - 1])  # its bytes span tokens
    kw = {"max_new_tokens": 24, "stop_strings": [emoji], "tokenizer": tokenizer}
    ref = base.generate(ids, do_sample=False, **kw)[0, n:].tolist()
    assert ref == answer[:cut]
    for options in ({"num_tokens": 4}, {"adaptive": [None]}):  # n-gram runs, plain steps
        out = SpeculativeGenerator(base, None, **options).generate(ids, **kw)
        assert out.sequences[0, n:].tolist() == ref and out.finished, options
