"""The decode loop's contract beyond its output: the base states a drafter observes on a
branching tree, the accepted lengths of a step cut short, greedy decoding at temperature 0
taking the argmax verifier, and top_k=1 on both sampling verifiers."""

import sys
from pathlib import Path

import pytest
import torch

import inference.generate as generate_module
from inference import SpeculativeGenerator
from inference.draft import Sampling
from tests.conftest import make_tiny_llama

sys.path.insert(0, str(Path(generate_module.__file__).resolve().parents[1] / "scripts"))
from bench_verify import OracleDrafter  # noqa: E402  (scripts/ is not a package)


class Recording(OracleDrafter):
    def reset(self):
        self.seen = []

    def observe(self, tokens, hidden, aux, next_token):
        self.seen.append((tokens.clone(), hidden.clone()))


def test_the_drafter_observes_the_base_states_at_the_accepted_nodes_of_a_branching_tree():
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    truth = base.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None)
    # a wrong sibling before the right token at every level: accepted nodes are 0, 2, 4, ...
    drafter = Recording(truth[0].tolist(), depth=3, width=2, vocab_size=256, device="cpu")
    out = SpeculativeGenerator(base, drafter, adaptive=False).generate(
        prompt, max_new_tokens=20, eos_token_id=[]
    )
    assert torch.equal(out.sequences, truth[:, :28])
    assert max(out.accepted_lengths) == 4  # whole branches were accepted
    tokens = torch.cat([t for t, _ in drafter.seen])
    hidden = torch.cat([h for _, h in drafter.seen])
    n = tokens.numel()
    assert torch.equal(tokens, out.sequences[0, :n])
    plain = base.model(input_ids=out.sequences[:, :n]).last_hidden_state[0]
    torch.testing.assert_close(hidden, plain, atol=1e-4, rtol=1e-4)


def test_temperature_zero_is_greedy_and_verified_by_argmax(monkeypatch):
    assert Sampling(0.0).greedy and not Sampling(0.5).greedy

    def refuse(*args, **kwargs):
        raise AssertionError("greedy decoding must not take the sampling verifier")

    monkeypatch.setattr(generate_module, "verify_sampling", refuse)
    monkeypatch.setattr(generate_module, "verify_sampling_walk", refuse)
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = base.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    out = SpeculativeGenerator(base, base, num_tokens=3).generate(
        prompt, max_new_tokens=10, temperature=0.0, eos_token_id=[]
    )
    assert torch.equal(out.sequences, ref)


def test_accepted_lengths_count_the_tokens_kept_when_max_new_tokens_cuts_a_step():
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    gen = SpeculativeGenerator(base, base, num_tokens=4)  # a perfect draft: 5 tokens a step
    out = gen.generate(prompt, max_new_tokens=7, eos_token_id=[])
    assert out.sequences.shape[1] == 6 + 7
    assert out.accepted_lengths == [5, 1]  # the prefill's token, 5, then 1 of the next 5
    assert sum(out.accepted_lengths) + 1 == 7


@pytest.mark.parametrize("lazy_logits", [False, True])
def test_top_k_of_one_samples_the_greedy_output_on_both_verifiers(lazy_logits):
    """top_k=1 leaves one token of mass at every step, so sampling must give the base's greedy
    output, whether the verifier warps every row at once or row by row (lazy_logits)."""
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    ref = base.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    gen = SpeculativeGenerator(base, base, num_tokens=3, lazy_logits=lazy_logits)
    out = gen.generate(prompt, max_new_tokens=12, temperature=1.0, top_k=1, seed=0, eos_token_id=[])
    assert torch.equal(out.sequences, ref)
