"""The decode loop's contract beyond its output: the base states a drafter observes on a
branching tree, the accepted lengths of a step cut short, greedy decoding at temperature 0
taking the argmax verifier, top_k=1 on both sampling verifiers, typical acceptance, the
drafter's first pass counted as the prompt's, and a drafter that gives no tree size."""

import sys
import time
from pathlib import Path

import pytest
import torch

import inference.generate as generate_module
from heads import EagleConfig, EagleDraft
from inference import SpeculativeGenerator
from inference.draft import Draft, Drafter, Sampling
from inference.drafters.model import ModelDrafter
from inference.tree import tree_from_parents
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


def test_the_drafters_first_pass_is_prefill_also_after_plain_steps():
    # The adaptive policy tries plain decoding first: the drafter's first pass over the prompt
    # comes at its first speculative step, and is still the prompt's cost, not that step's.
    base = make_tiny_llama()
    eagle = EagleDraft(EagleConfig.from_base(base.config, version=3))
    prompt = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    tree = {"top_k": 2, "depth": 2, "total_tokens": 4}
    gen = SpeculativeGenerator(base, eagle, adaptive=[None, tree])
    catch_up = gen.drafter.catch_up

    def slow_catch_up(sequence):  # the draft layer's pass over the prompt, made to show
        time.sleep(0.05)
        catch_up(sequence)

    gen.drafter.catch_up = slow_catch_up
    out = gen.generate(prompt, 16, eos_token_id=[])
    assert out.accepted_lengths[:4] == [1, 1, 1, 1]  # the plain arm's turn
    assert 0.05 <= out.timings["prefill_draft"] < out.timings["draft"]


class GreedyChain(ModelDrafter):
    """Proposes the base's own greedy chain whatever the sampling: point masses."""

    def propose(self, sequence, sampling):
        return super().propose(sequence, Sampling())


def test_typical_acceptance_keeps_the_plausible_chain_lossless_sampling_rejects():
    # A random tiny base is near uniform (p(argmax) ~ 0.006 at temperature 1): lossless sampling
    # accepts a point-mass draft with probability p(x), typical acceptance whenever
    # p(x) > 0.3 * exp(-H(p)) ~ 0.0012, which the greedy token always passes.
    base = make_tiny_llama()
    gen = SpeculativeGenerator(base, GreedyChain(base, num_tokens=3))
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    typical = gen.generate(
        prompt, max_new_tokens=20, temperature=1.0, acceptance="typical", eos_token_id=[]
    )
    assert typical.accepted_lengths[:-1] == [4, 4, 4, 4]  # 3 drafted + the bonus, every step
    lossless = gen.generate(prompt, max_new_tokens=20, temperature=1.0, eos_token_id=[])
    assert lossless.num_steps == 19 and max(lossless.accepted_lengths) == 1


def test_a_drafter_that_gives_no_size_is_taken_as_root_only_up_to_the_contexts_end():
    base = make_tiny_llama()
    limit = base.config.max_position_embeddings

    class RootOnly(Drafter):  # no max_nodes of its own: the default, the root alone
        def __init__(self):
            self.proposed = 0

        def propose(self, sequence, sampling):
            self.proposed += 1
            return Draft(tree_from_parents([-1]), sequence[-1:], torch.zeros(1, dtype=torch.bool))

    drafter = RootOnly()
    prompt = torch.randint(3, 256, (1, limit - 4), generator=torch.Generator().manual_seed(0))
    out = SpeculativeGenerator(base, drafter, adaptive=False).generate(
        prompt, max_new_tokens=4, eos_token_id=[]
    )
    assert out.sequences.shape[1] == limit and out.accepted_lengths == [1, 1, 1]
    assert drafter.proposed == 3  # every step, the last one included
