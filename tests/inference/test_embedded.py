"""The core invariant on the real embedded model: greedy speculative output equals
`base.generate(do_sample=False)` token for token in fp32, for every kind of drafter."""

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import SpeculativeGenerator

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
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        ref = base.generate(ids, max_new_tokens=64, do_sample=False)
        for name, (heads, options) in drafters.items():
            out = SpeculativeGenerator(base, heads, **options).generate(ids, max_new_tokens=64)
            assert torch.equal(out.sequences, ref), (name, prompt)
