"""The union of several drafters' trees: the trie merge, its bookkeeping, and the generator."""

import sys
from pathlib import Path

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import (
    Draft,
    Drafter,
    MedusaDrafter,
    ModelDrafter,
    NgramDrafter,
    Sampling,
    SpeculativeGenerator,
    UnionDrafter,
    tree_from_parents,
)
from inference.drafters.union import merge_drafts
from tests.conftest import make_tiny_llama

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from bench_verify import OracleDrafter  # noqa: E402  (scripts/ is not a package)


def _draft(parents, tokens, sampled=None, probs=None):
    n = len(tokens)
    sampled = torch.zeros(n, dtype=torch.bool) if sampled is None else torch.tensor(sampled)
    return Draft(tree_from_parents(parents), torch.tensor(tokens), sampled, probs)


def _paths(draft):
    """Every root-to-node token path of a draft, as tuples."""
    parents, tokens = draft.tree.parents.tolist(), draft.tokens.tolist()
    out = set()
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


def test_point_mass_trees_merge_into_one_trie():
    a = _draft([-1, 0, 0, 1], [9, 1, 2, 3])  # 9 -> 1 -> 3, 9 -> 2
    b = _draft([-1, 0, 1, 2], [9, 1, 3, 4])  # 9 -> 1 -> 3 -> 4 (shares 9 -> 1 -> 3)
    merged = merge_drafts([a, b])
    assert merged.tree.num_nodes == 5  # root, 1, 2, 3, 4: the shared prefix is stored once
    assert _paths(merged) == _paths(a) | _paths(b)
    assert not bool(merged.sampled.any()) and merged.draft_probs is None
    # Parents come before children (the verifier's topological order).
    assert all(p < i for i, p in enumerate(merged.tree.parents.tolist()) if i)


def test_sampled_nodes_keep_their_node_and_row():
    V = 5
    probs = torch.rand(3, V)
    sampled = _draft([-1, 0, 1], [9, 1, 2], [False, True, True], probs)  # a sampled chain
    point = _draft([-1, 0, 1], [9, 1, 4])  # the same first token, as a point mass
    merged = merge_drafts([point, sampled])  # the sampling draft is put first whatever the order
    assert merged.tree.num_nodes == 5  # the point-mass 1 is not merged into the sampled 1
    assert _paths(merged) == _paths(point) | _paths(sampled)
    toks, smp = merged.tokens.tolist(), merged.sampled.tolist()
    assert sum(smp) == 2 and smp[:3] == [False, True, True]
    assert torch.equal(merged.draft_probs, probs)  # the sampling draft's table
    assert merged.q_rows.tolist()[1:3] == [0, 1]  # each drawn from q after its parent
    assert toks[3:] == [1, 4]


def test_two_sampling_drafts_keep_each_nodes_own_q():
    """Two draft models' chains under one root: their first tokens were drawn from two qs, so
    each sampled node names its row in the stacked tables, and equal tokens are not merged."""
    V = 5
    p1, p2 = torch.rand(3, V), torch.rand(2, V)
    a = _draft([-1, 0, 1], [9, 1, 2], [False, True, True], p1)
    b = _draft([-1, 0], [9, 1], [False, True], p2)  # the same first token, drawn from p2[0]
    point = _draft([-1, 0], [9, 3])
    merged = merge_drafts([point, a, b])
    assert merged.tokens.tolist() == [9, 1, 2, 1, 3]  # sampling drafts first, in their order
    assert merged.tree.parents.tolist() == [-1, 0, 1, 0, 0]
    assert merged.sampled.tolist() == [False, True, True, True, False]
    assert torch.equal(merged.draft_probs, torch.cat([p1, p2]))
    assert merged.q_rows.tolist()[1:4] == [0, 1, 3]  # a's root row, a's node-1 row, b's root
    # a union inside a union: the inner merge's rows are kept, shifted, not its nodes' parents
    b2 = _draft([-1, 0, 1], [9, 4, 5], [False, True, True], torch.rand(3, V))
    inner = merge_drafts([a, b2])
    assert inner.q_rows.tolist()[1:] == [0, 1, 3, 4]
    outer = merge_drafts([point, inner, b])
    assert outer.tokens.tolist() == [9, 1, 2, 4, 5, 1, 3]
    assert torch.equal(outer.draft_probs, torch.cat([p1, b2.draft_probs, p2]))
    assert outer.q_rows.tolist()[1:6] == [0, 1, 3, 4, 6]
    with pytest.raises(ValueError, match="share the root"):
        merge_drafts([_draft([-1, 0], [9, 1]), _draft([-1, 0], [8, 1])])
    with pytest.raises(ValueError, match="needs draft_probs"):
        merge_drafts([point, _draft([-1, 0], [9, 1], [False, True])])


def test_union_settings_arms_and_refusals():
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    union = UnionDrafter([MedusaDrafter(heads, "chain-2"), NgramDrafter(num_tokens=4)])
    assert union.max_nodes == 1 + 2 + 4
    union.configure(parts=[None, {"num_tokens": 3}])
    assert union.max_nodes == 1 + 3 and union.enabled == [False, True]
    with pytest.raises(ValueError, match="at least one"):
        union.configure(parts=[None, None])
    with pytest.raises(ValueError, match="2 drafters"):
        union.configure(parts=[{}])
    arms = union.default_arms(torch.device("cpu"))
    assert arms[0] is None and arms[-1] == {"parts": [None, {}]}
    assert all(a["parts"][1] == {} for a in arms[1:])  # the n-gram kept as configured
    assert len(arms) == len(MedusaDrafter(heads).default_arms(torch.device("cpu"))) + 1
    with pytest.raises(ValueError, match="at least two"):
        UnionDrafter([NgramDrafter()])
    eagle3 = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=64))
    eagle3.set_vocab_map(torch.arange(0, 256, 4))
    # Two EAGLE-3 drafts reading the same aux layers share the base's one set of them (the
    # same draft twice: two drafters, each with its own cache); other layers are refused.
    twin = SpeculativeGenerator(base, [eagle3, eagle3, None])
    assert twin.drafter.aux_layer_ids == tuple(eagle3.config.aux_layer_ids)
    prompt = torch.tensor([[5, 6, 7, 8]])
    for arms in (None, [{"parts": [{}, {}, {}]}]):  # adaptive, and all three drafting each step
        if arms:
            twin.arms = arms
        out = twin.generate(prompt, max_new_tokens=12, eos_token_id=[])
        ref = base.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert torch.equal(out.sequences, ref)
    other = EagleDraft(
        EagleConfig.from_base(base.config, version=3, draft_vocab_size=64, aux_layer_ids=[0, 1, 1])
    )
    other.set_vocab_map(torch.arange(0, 256, 4))
    with pytest.raises(ValueError, match="different aux layers"):
        SpeculativeGenerator(base, [eagle3, other])
    with pytest.raises(ValueError, match="ambiguous"):
        SpeculativeGenerator(base, [heads, None], choices="cpu-8")
    # heads of another base are refused in a UnionDrafter object as in a list
    wider = make_tiny_llama(hidden_size=128)
    for given in ([heads, None], UnionDrafter([MedusaDrafter(heads), NgramDrafter()])):
        with pytest.raises(
            ValueError, match=r"hidden_size=64, but the given base .* hidden_size=128"
        ):
            SpeculativeGenerator(wider, given)
    gen = SpeculativeGenerator(base, [eagle3, None])
    assert gen.drafter.aux_layer_ids == tuple(eagle3.config.aux_layer_ids)
    assert gen.arms == gen.drafter.default_arms(torch.device("cpu"))  # adaptive by default


class Junk(Drafter):
    """Always proposes tokens the base will not choose (a 3-chain of token 0)."""

    max_nodes = 4

    def propose(self, sequence, sampling):
        return Draft.chain(int(sequence[-1]), [0, 0, 0], sequence.device)


def test_the_right_branch_is_accepted_whichever_drafter_proposed_it():
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    ref = base.generate(prompt, max_new_tokens=24, do_sample=False)
    gen = SpeculativeGenerator(base, [Junk(), ModelDrafter(base, num_tokens=4)])
    out = gen.generate(prompt, max_new_tokens=24)
    assert torch.equal(out.sequences, ref)
    assert out.mean_accepted_length > 4.0  # the perfect draft model's chain, past the junk


def test_a_union_with_one_drafter_on_passes_its_draft_without_ranks():
    """Paths of ranks name tokens of one drafter: a union's arms may enable different ones, so
    its drafts carry no ranks for the adaptive policy to share rates by."""
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    union = UnionDrafter([MedusaDrafter(heads, [[0], [1], [0, 0]]), NgramDrafter()])
    union.configure(parts=[{}, None])
    sequence = torch.randint(3, 256, (12,))
    union.reset()
    hidden = base.model(input_ids=sequence[None]).last_hidden_state[0]
    union.observe(sequence, hidden, None, int(sequence[-1]))
    draft = union.propose(sequence, Sampling())
    alone = union.drafters[0].propose(sequence, Sampling())
    assert alone.tree.ranks is not None and draft.tree.ranks is None
    assert torch.equal(draft.tokens, alone.tokens)
    assert torch.equal(draft.tree.parents, alone.tree.parents)
    # nor a dynamic tree's root ranking (EAGLE's top k at the root, scored as paths (j,))
    from inference.drafters.eagle import EagleDrafter

    eagle = EagleDraft(EagleConfig.from_base(base.config, version=1))
    union = UnionDrafter(
        [EagleDrafter(eagle, base, top_k=3, depth=2, total_tokens=5), NgramDrafter()]
    )
    union.configure(parts=[{}, None])
    union.reset()
    union.observe(sequence, hidden, None, int(sequence[-1]))
    alone = union.drafters[0].propose(sequence, Sampling())
    draft = union.propose(sequence, Sampling())
    assert alone.root_ranking is not None and draft.root_ranking is None
    assert torch.equal(draft.tokens, alone.tokens)


def test_a_member_switched_back_on_catches_up_outside_the_step():
    """After steps of the lookup alone, the arm that adds the draft model back first brings its
    cache up to the sequence (the generator does it outside the step's timing); a member that
    drafted all along is left to its step."""

    small = ModelDrafter(make_tiny_llama(seed=1), num_tokens=2)
    union = UnionDrafter([small, NgramDrafter(num_tokens=2)])
    sequence = torch.tensor([1, 5, 9, 22, 7, 30, 31, 32])
    union.propose(sequence[:4], Sampling(0.0, 0, 1.0, None))
    assert small._fed[:4] == sequence[:4].tolist()
    union.configure([None, {}])  # the lookup alone for a while
    assert union.switched_on == [False, False]
    union.configure([{"num_tokens": 3}, {}])
    assert union.switched_on == [True, False]
    union.catch_up_switched_on(sequence)
    assert small._fed == sequence[:-1].tolist()  # all but the root, whose logits propose needs
    assert union.switched_on == [False, False]
    union.configure([{"num_tokens": 2}, {}])  # on before and on now: nothing to catch up
    assert union.switched_on == [False, False]


class Member(Drafter):
    """A union member that drafts a 2-chain of `token` and logs its catch-ups."""

    max_nodes = 3

    def __init__(self, max_positions=None, token=0):
        self.max_positions, self.token = max_positions, token
        self.caught_up = []

    def catch_up(self, sequence):
        self.caught_up.append(sequence.numel())

    def configure(self, **options):
        pass

    def propose(self, sequence, sampling):
        return Draft.chain(int(sequence[-1]), [self.token] * 2, sequence.device)


def test_the_unions_context_is_the_longest_of_its_enabled_members():
    union = UnionDrafter([Member(100), Member(60), NgramDrafter()])
    assert union.max_positions is None  # the lookup drafts at any length
    union.configure([{}, {}, None])
    assert union.max_positions == 100  # the shorter one sits out past 60, the other drafts on
    union.configure([None, {}, None])
    assert union.max_positions == 60


def test_a_member_past_its_context_sits_out_and_is_not_fed():
    long, short = Member(100), Member(60, token=1)
    union = UnionDrafter([long, short])
    sampling = Sampling()
    # the sequence (root included) and a member's 3-node tree: 57 + 3 fits 60, 58 + 3 does not
    assert union.propose(torch.arange(57), sampling).tree.num_nodes == 5  # both chains merged
    assert union.propose(torch.arange(58), sampling).tree.num_nodes == 3
    union.catch_up(torch.arange(58))
    assert long.caught_up == [58] and short.caught_up == []
    union.configure([{}, None])
    union.configure([{}, {}])  # `short` switched on, past its context: still no catch-up
    assert union.switched_on == [False, True]
    union.catch_up_switched_on(torch.arange(58))
    assert short.caught_up == [] and long.caught_up == [58]
    assert union.switched_on == [False, False]
    with pytest.raises(ValueError, match="no drafter of the union fits its context"):
        UnionDrafter([Member(60), Member(60, token=1)]).propose(torch.arange(58), sampling)


def test_past_a_draft_models_context_the_other_drafters_of_a_union_draft_on():
    from transformers import GPT2Config, GPT2LMHeadModel

    base = make_tiny_llama()
    draft = GPT2LMHeadModel(
        GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    )
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    want = base.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=None)
    truth = base.generate(prompt, max_new_tokens=68, do_sample=False, eos_token_id=None)
    oracle = OracleDrafter(truth[0].tolist(), depth=4, width=2, vocab_size=256, device="cpu")
    small = ModelDrafter(draft.eval().requires_grad_(False), num_tokens=3)
    got = SpeculativeGenerator(base, [small, oracle], adaptive=False).generate(
        prompt, 60, eos_token_id=[]
    )
    assert torch.equal(got.sequences, want)
    assert min(got.accepted_lengths[:-1]) == 5  # the oracle's 4 and the bonus, every step
    assert 54 <= len(small._fed) <= 64  # it drafted up to its context, never past it


def test_a_member_switched_on_owes_its_catch_up_until_it_is_done():
    union = UnionDrafter([NgramDrafter(num_tokens=2), NgramDrafter(num_tokens=3)])
    union.configure([{}, None])
    union.configure([{}, {}])  # switched on
    assert union.switched_on == [False, True]
    union.configure([{}, {"num_tokens": 4}])  # another arm with it on, before any catch-up
    assert union.switched_on == [False, True]


def test_catch_ups_reach_only_the_members_they_are_for():
    on, off = Member(), Member()
    union = UnionDrafter([on, off])
    union.configure([{}, None])
    sequence = torch.arange(3, 12)
    union.catch_up(sequence)  # after plain steps: the enabled members only
    assert on.caught_up == [9] and off.caught_up == []
    union.configure([{}, {}])  # `off` switched on
    union.catch_up_switched_on(sequence)  # outside the step: the switched-on member only
    assert on.caught_up == [9] and off.caught_up == [9]
    assert union.switched_on == [False, False]


def test_a_sampled_node_is_not_merged_into_a_point_mass_of_a_nested_union():
    """A union inside a union holds a sampled chain and a point-mass token 3; another draft
    model samples 3 at the root: it keeps its own node and the row of q it was drawn from."""
    V = 5
    p1, p2 = torch.rand(3, V), torch.rand(2, V)
    inner = merge_drafts(
        [_draft([-1, 0, 1], [9, 1, 2], [False, True, True], p1), _draft([-1, 0], [9, 3])]
    )
    assert inner.tokens.tolist() == [9, 1, 2, 3] and inner.sampled.tolist()[3] is False
    sampled3 = _draft([-1, 0], [9, 3], [False, True], p2)
    merged = merge_drafts([inner, sampled3])
    assert merged.tokens.tolist() == [9, 1, 2, 3, 3]
    assert merged.tree.parents.tolist() == [-1, 0, 1, 0, 0]
    assert merged.sampled.tolist() == [False, True, True, False, True]
    assert merged.q_rows.tolist()[4] == 3  # p2's first row, after p1's three
    assert torch.equal(merged.draft_probs, torch.cat([p1, p2]))
