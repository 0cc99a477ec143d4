"""A draft model's drafting costs: one draft forward per chain token, a cache that follows the
sequence (a padded vocabulary's too), proposing again on the same sequence."""

import pytest
import torch

from inference import ModelDrafter, SpeculativeGenerator
from inference.draft import Sampling
from tests.conftest import make_tiny_llama


def _widths(model):
    widths = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return widths, hook


def test_a_chain_costs_one_draft_forward_per_token_and_its_cache_follows_the_sequence():
    # a chain of 3 tokens: one forward over the new tokens (root included), then one per drafted
    # token but the last, whose logits no one needs; the cache holds the sequence and the
    # chain's first two tokens
    small = make_tiny_llama(seed=1)
    drafter = ModelDrafter(small, num_tokens=3)
    widths, hook = _widths(small)
    sequence = torch.tensor([1, 5, 9, 22, 7])
    draft = drafter.propose(sequence, Sampling())
    hook.remove()
    chain = draft.tokens[1:].tolist()
    assert widths == [5, 1, 1]
    assert drafter._fed == sequence.tolist() + chain[:-1]
    assert drafter.cache.get_seq_length() == len(drafter._fed)


def test_a_padded_draft_cache_follows_the_base_tokens_it_read_as_zero():
    # a draft of 200 rows for a base of 256: token 230 is read as 0, but the cache still
    # stands for the sequence, so the next step feeds only the new tokens
    small = make_tiny_llama(seed=1, vocab_size=200)
    drafter = ModelDrafter(small, num_tokens=1, vocab_size=256)
    sequence = torch.tensor([1, 5, 230, 22, 7])
    drafter.propose(sequence, Sampling())
    assert drafter._fed == sequence.tolist()
    widths, hook = _widths(small)
    drafter.propose(torch.cat([sequence, torch.tensor([9])]), Sampling())
    hook.remove()
    assert widths == [1]  # the new token alone, not the sequence again from token 230


def test_proposing_again_on_the_same_sequence_drafts_the_same():
    # a 1-token chain feeds the whole sequence, root included: proposing again on it (a caller
    # that retries a step) recomputes the root's logits instead of feeding nothing
    small = make_tiny_llama(seed=1)
    drafter = ModelDrafter(small, num_tokens=1)
    sequence = torch.tensor([1, 5, 9, 22, 7])
    first = drafter.propose(sequence, Sampling())
    again = drafter.propose(sequence, Sampling())
    assert torch.equal(first.tokens, again.tokens)
    assert drafter._fed == sequence.tolist()


def test_a_temperature_alone_leaves_the_drafts_law_untruncated():
    draft = make_tiny_llama(seed=1)
    drafter = ModelDrafter(draft, num_tokens=2)
    sequence = torch.randint(3, 256, (6,), generator=torch.Generator().manual_seed(0))
    drafter.reset()
    proposal = drafter.propose(sequence, Sampling(1.0, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        law = draft(sequence[None]).logits[0, -1].float().softmax(-1)
    assert proposal.sampled[1:].all()
    torch.testing.assert_close(proposal.draft_probs[0], law, atol=1e-6, rtol=1e-5)


def test_a_draft_model_on_another_device_than_the_bases_inputs_is_refused():
    """Its ids, and the generator a sampled chain draws with, are the base's device's (the meta
    device stands in for another GPU)."""
    base, draft = make_tiny_llama(), make_tiny_llama(seed=1).to("meta")
    for given in (draft, ModelDrafter(draft), [draft, None]):
        with pytest.raises(
            ValueError, match="draft model takes its inputs on meta, the base on cpu"
        ):
            SpeculativeGenerator(base, given)
