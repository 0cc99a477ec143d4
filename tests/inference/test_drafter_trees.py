"""How the EAGLE and draft-model drafters fill their trees: a static tree's node holds its
parent's ranked token, a dynamic tree ranks its root's top k as the one-level static tree holds
them, and the options and arms that choose between chains, static and dynamic trees (within the
drafter's vocabulary); and that EAGLE's and Medusa's trees hold what the draft predicts from the
whole sequence, against references that read no drafter state."""

import pytest
import torch

from heads import EagleConfig, EagleDraft
from inference import ModelDrafter, SpeculativeGenerator
from inference.tree import DEFAULT_ACCURACIES, build_static_tree
from tests.conftest import make_tiny_llama


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_same_first_draft(drafter_cls, prompt, first, second) -> None:
    """The two generators' drafters (of `drafter_cls`) propose the same first tree for `prompt`."""
    propose, drafts = drafter_cls.propose, []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            drafter_cls, "propose", lambda s, q, m: drafts.append(propose(s, q, m)) or drafts[-1]
        )
        for gen in (first, second):
            gen.generate(prompt, max_new_tokens=2)  # the prefill's token, then one step
    assert len(drafts) == 2
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    assert torch.equal(drafts[0].tree.parents, drafts[1].tree.parents)


DRAFT_TREES = {
    # (2,) and (0, 1) are leaves beside branches, so level 2's frontier is partial
    "three-levels": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0)],
    # frontiers of 2, 1 and 1 nodes: level 3 attends past cached non-ancestors of two depths
    "four-levels": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)],
    "one-level": [(0,), (1,), (2,)],
}


@pytest.mark.parametrize("shape", DRAFT_TREES)
def test_eagle_static_tree_nodes_hold_their_parents_ranked_tokens(shape):
    import copy

    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=64))
    draft.set_vocab_map(torch.arange(0, 256, 4))
    torch.manual_seed(3)
    for p in draft.parameters():  # a draft with opinions, so that ranks differ
        p.data.normal_(0, 0.5)
    choices = DRAFT_TREES[shape]
    seen = []  # (draft cache and root output before the proposal, the draft, cache length after)
    propose = EagleDrafter.propose

    def spy(self, sequence, sampling):
        self.catch_up(sequence)
        before = (copy.deepcopy(self.cache), self._root_hidden.clone())
        out = propose(self, sequence, sampling)
        seen.append((before, out, self.cache.get_seq_length()))
        return out

    prompt = torch.randint(3, 256, (1, 12), generator=_seeded(1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleDrafter, "propose", spy)
        gen = SpeculativeGenerator(base, draft, choices=choices)
        gen.generate(prompt, max_new_tokens=12)
    drafter = gen.drafter
    assert len(seen) >= 3
    ordered = sorted(choices, key=lambda c: (len(c), c))  # the tree's node order
    for (cache, root_hidden), proposal, length_after in seen[:3]:
        prefix = cache.get_seq_length()
        assert length_after == prefix  # the tree's entries were cropped from the draft cache
        # Reference: each node's path fed causally, one token at a time, on a copy of the cache.
        token = {(): proposal.tokens[0]}
        for c in ordered:
            h, path_cache = root_hidden, copy.deepcopy(cache)
            for i in range(1, len(c)):
                pos = torch.tensor([[prefix - 1 + i]])
                h = draft(
                    drafter.embed(token[c[:i]])[None, None], h[None, None], pos, cache=path_cache
                )[0, -1]
            ranked = drafter._log_probs(h[None]).topk(c[-1] + 1, dim=-1).indices[0]
            token[c] = draft.to_base_ids(ranked[c[-1]])
        assert proposal.tokens.tolist() == [int(token[c]) for c in [(), *ordered]]
    if shape != "one-level":  # ranks at different parents name different tokens
        assert len({int(t) for t in seen[0][1].tokens[1:]}) > 3
    # a static chain drafts what EAGLE-2's top_k=1 chain does
    _assert_same_first_draft(
        EagleDrafter,
        prompt,
        SpeculativeGenerator(base, draft, choices="chain-3"),
        SpeculativeGenerator(base, draft, top_k=1, depth=3, total_tokens=4),
    )


def test_an_eagle_dynamic_tree_ranks_the_tokens_of_the_one_level_static_tree():
    """A dynamic tree's `root_ranking` is the draft's top k at the root, best first: the tokens
    of the static tree [(0,), ..., (k-1,)] at the same step (what the adaptive policy scores it
    as), whichever of them the reranked tree kept."""
    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=64))
    draft.set_vocab_map(torch.arange(0, 256, 4))
    torch.manual_seed(3)
    for p in draft.parameters():  # a draft with opinions, so that some of the top 4 are dropped
        p.data.normal_(0, 0.5)
    one_level = [(0,), (1,), (2,), (3,)]
    dropped = []  # per step, how many of the root's top 4 the reranked tree left out
    propose = EagleDrafter.propose

    def both(self, sequence, sampling):
        dynamic = propose(self, sequence, sampling)
        self.configure(choices=one_level)
        static = propose(self, sequence, sampling)
        self.configure(top_k=4, depth=2, total_tokens=6)
        assert (
            static.root_ranking is None
            and dynamic.root_ranking.tolist() == static.tokens[1:].tolist()
        )
        level_one = dynamic.tokens[1:][dynamic.tree.depths[1:] == 1]
        assert set(level_one.tolist()) <= set(dynamic.root_ranking.tolist())
        dropped.append(4 - level_one.numel())
        return dynamic

    prompt = torch.randint(3, 256, (1, 12), generator=_seeded(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleDrafter, "propose", both)
        gen = SpeculativeGenerator(base, draft, top_k=4, depth=2, total_tokens=6)
        out = gen.generate(prompt, max_new_tokens=16)
    assert torch.equal(out.sequences, base.generate(prompt, max_new_tokens=16, do_sample=False))
    assert len(dropped) >= 4 and any(dropped)


def test_eagle_options_are_a_dynamic_or_a_static_tree():
    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    drafter = EagleDrafter(EagleDraft(EagleConfig.from_base(base.config, version=1)), base)
    assert (drafter.top_k, drafter.depth, drafter.total_tokens) == (4, 4, 12)  # the defaults
    drafter.configure(choices=[(0,), (0, 0)])
    assert (drafter.top_k, drafter.depth, drafter.max_nodes) == (None, 2, 3)
    for mixed in ({"choices": "chain-2", "top_k": 2}, {"depth": 2}, {}):
        with pytest.raises(ValueError, match="either top_k, depth and total_tokens .* or choices"):
            drafter.configure(**mixed)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("shape", DRAFT_TREES)
def test_draft_model_static_tree_nodes_hold_their_parents_ranked_tokens(attn, shape):
    base = make_tiny_llama()
    small = make_tiny_llama(seed=1, attn=attn)
    torch.manual_seed(3)
    for p in small.parameters():  # sharp attention, so that positions and masks matter
        if p.dim() == 2:
            p.data.normal_(0, 0.3)
    choices = DRAFT_TREES[shape]
    seen = []  # (the sequence, the draft, the draft cache's length after it, the tokens fed)
    widths = []  # tokens per forward of the draft model
    per_proposal = []  # the widths of each proposal's forwards
    propose = ModelDrafter.propose

    def spy(self, sequence, sampling):
        start = len(widths)
        out = propose(self, sequence, sampling)
        seen.append((sequence.clone(), out, self.cache.get_seq_length(), list(self._fed)))
        per_proposal.append(widths[start:])
        return out

    hook = small.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    prompt = torch.randint(3, 256, (1, 12), generator=_seeded(1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelDrafter, "propose", spy)
        gen = SpeculativeGenerator(base, small, choices=choices)
        gen.generate(prompt, max_new_tokens=12)
    hook.remove()
    # the new tokens fed, then one forward per level over the nodes that have children
    levels = {"three-levels": [2, 2], "four-levels": [2, 1, 1], "one-level": []}[shape]
    assert all(w[1:] == levels for w in per_proposal), per_proposal
    assert len(seen) >= 3
    ordered = sorted(choices, key=lambda c: (len(c), c))  # the tree's node order
    for sequence, proposal, length_after, fed in seen[:3]:
        # the tree's entries were cropped: the cache holds the sequence, root included
        assert length_after == sequence.numel() and fed == sequence.tolist()
        # Reference: each node's parent path fed causally from scratch, no cache.
        token = {(): int(sequence[-1])}
        for c in ordered:
            path = [token[c[:i]] for i in range(1, len(c))]
            ids = torch.tensor([sequence.tolist() + path])
            token[c] = int(small(ids).logits[0, -1].topk(c[-1] + 1).indices[c[-1]])
        assert proposal.tokens.tolist() == [token[c] for c in [(), *ordered]]
        assert not proposal.sampled.any()  # point masses, at any temperature
    if shape != "one-level":  # ranks at different parents name different tokens
        assert len({int(t) for t in seen[0][1].tokens[1:]}) > 3
    # a static chain drafts what the greedy chain does
    _assert_same_first_draft(
        ModelDrafter,
        prompt,
        SpeculativeGenerator(base, small, choices="chain-3"),
        SpeculativeGenerator(base, small, num_tokens=3),
    )


def test_draft_model_options_are_a_chain_or_a_static_tree():
    drafter = ModelDrafter(make_tiny_llama(seed=1))
    assert (drafter.num_tokens, drafter.max_nodes) == (4, 5)  # the default chain
    drafter.configure(choices="cpu-8")
    assert (drafter.num_tokens, drafter.max_nodes) == (None, 8)
    drafter.configure(num_tokens=2)
    assert (drafter.static, drafter.max_nodes) == (None, 3)
    for mixed in ({"choices": "chain-2", "num_tokens": 2}, {}):
        with pytest.raises(ValueError, match="either num_tokens .* or choices"):
            drafter.configure(**mixed)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        drafter.configure(num_tokens=0)
    with pytest.raises(ValueError, match="needs its prefix"):
        drafter.configure(choices=[(0, 0)])
    flex = make_tiny_llama(seed=1)
    flex.config._attn_implementation = "flex_attention"  # takes no additive 4D float mask
    assert ModelDrafter(flex, num_tokens=3).max_nodes == 4  # a chain needs no mask
    with pytest.raises(ValueError, match="needs sdpa or eager attention"):
        ModelDrafter(flex, choices="chain-2")
    # nor does the GPU arms' tree come up for it
    gpu_arms = ModelDrafter(flex).default_arms(torch.device("cuda"))
    assert gpu_arms == [None, {"num_tokens": 2}, {"num_tokens": 4}, {"num_tokens": 6}]


def test_draft_model_arms_switch_between_chains_and_a_tree():
    """The GPU arms (chains of 2, 4, 6 tokens, a 16-node tree), run on the CPU with the base as
    its own perfect draft: after every switch each arm drafts from a clean cache, so each step
    gains exactly its depth + 1 tokens, and the output is the base's."""
    base = make_tiny_llama()
    arms = ModelDrafter(base).default_arms(torch.device("cuda"))
    assert arms[-1]["choices"] == build_static_tree(DEFAULT_ACCURACIES, 16)
    gen = SpeculativeGenerator(base, base, adaptive=arms)
    for seed in range(4):
        prompt = torch.randint(3, 256, (1, 8), generator=_seeded(seed))
        ref = base.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert torch.equal(gen.generate(prompt, max_new_tokens=40, eos_token_id=[]).sequences, ref)
    summary = gen.policy.summary()
    assert all(a["steps"] >= gen.policy.warmup for a in summary)
    assert [a["tokens_per_step"] for a in summary] == pytest.approx([1, 3, 5, 7, 5])


def test_eagle_default_arms_fit_a_draft_vocabulary_under_four_tokens():
    """The default arms rank the draft's top 4 (8 on a GPU); a draft vocabulary of 3 tokens
    gets arms of 3, so the generator a user builds without options works (it refused, naming a
    top_k=4 the user never passed), and its output is the base's."""
    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=3))
    draft.set_vocab_map(torch.tensor([5, 9, 200]))
    for device in ("cpu", "cuda"):
        for options in EagleDrafter(draft, base).default_arms(torch.device(device))[1:]:
            assert max(options.get("top_k", 0), len(options.get("choices", []))) <= 3, options
    gen = SpeculativeGenerator(base, draft)  # the default arms
    assert gen.arms[1] == {"choices": [[0], [1], [2]]} and gen.arms[2]["top_k"] == 3
    prompt = torch.randint(3, 256, (1, 8), generator=_seeded(0))
    ref = base.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(gen.generate(prompt, max_new_tokens=12, eos_token_id=[]).sequences, ref)


def test_medusa_default_trees_fit_a_truncated_vocabulary_under_their_ranks():
    """Medusa's default tree and arms rank up to head 0's top 4 (CPU) or top 10 (GPU); heads
    over 3 tokens keep the paths they can fill, and decode the base's output."""
    from heads import MedusaConfig, MedusaHeads
    from inference import MedusaDrafter

    base = make_tiny_llama()
    config = MedusaConfig.from_base(base.config, num_heads=2, truncated_vocab_size=3)
    heads = MedusaHeads(config).init_from_base(base, token_map=torch.tensor([5, 9, 200]))
    drafter = MedusaDrafter(heads)  # the default 8-node tree
    assert int(drafter.tree.ranks.max()) <= 2
    gpu = drafter.default_arms(torch.device("cuda"))[1:]
    assert gpu and all(max(map(max, a["choices"])) <= 2 for a in gpu)
    assert len({str(a) for a in gpu}) == len(gpu)  # trees cut to the same one are one arm
    gen = SpeculativeGenerator(base, heads)  # the CPU arms
    assert gen.arms[1] == {"choices": [(0,), (1,), (2,), (0, 0)]}
    prompt = torch.randint(3, 256, (1, 8), generator=_seeded(1))
    ref = base.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(gen.generate(prompt, max_new_tokens=12, eos_token_id=[]).sequences, ref)


def proposals(drafter_cls, gen, prompt=None, max_new_tokens: int = 10) -> tuple[list, list]:
    """(sequence, draft) of each of the generator's greedy steps (at least 3) over `prompt` (a
    random 12-token one by default), its drafter of class `drafter_cls`, and the accepted
    lengths."""
    seen, propose = [], drafter_cls.propose

    def spy(self, sequence, sampling):
        out = propose(self, sequence, sampling)
        seen.append((sequence.clone(), out))
        return out

    if prompt is None:
        prompt = torch.randint(3, 256, (1, 12), generator=_seeded(1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drafter_cls, "propose", spy)
        out = gen.generate(prompt, max_new_tokens=max_new_tokens)
    assert len(seen) >= 3
    return seen, out.accepted_lengths


def _draft_reference(drafter, base, sequence: torch.Tensor):
    """EAGLE's draft run from scratch over the whole sequence (no draft cache): pair t is the
    base's feature at t with token t + 1; the last pair's output drafts the token after the
    root. Returns (the draft's outputs (T-1,H), the features it read)."""
    from heads import read_hidden_states

    draft, ids = drafter.draft, sequence[None]
    version = draft.config.version
    layers = list(draft.config.aux_layer_ids) if version == 3 else []
    _, last, aux = read_hidden_states(base, ids, layers)
    features = draft.fuse(torch.cat(aux, -1)) if version == 3 else last  # (1,T,H)
    T = ids.shape[1]
    out = draft(
        base.get_input_embeddings()(ids[:, 1:]), features[:, :-1], torch.arange(T - 1)[None]
    )
    return out[0], features[0, :-1]


@pytest.mark.parametrize("version", [1, 3])
def test_an_eagle_dynamic_tree_drafts_what_the_draft_predicts_from_the_whole_sequence(version):
    # Against a reference that feeds no cache: a shifted feed, the wrong root output or a node
    # expanded from another parent's output drafts other tokens (the output stays the base's
    # greedy one whatever the drafter proposes, so the invariant tests cannot see them).
    # tests/train/test_trained_drafts.py checks the same with drafts whose paths are accepted.
    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    config = EagleConfig.from_base(base.config, version=version)
    draft = EagleDraft(config)
    torch.manual_seed(3)
    for p in draft.parameters():  # a draft with opinions, so that ranks differ
        p.data.normal_(0, 0.5)
    drafter = EagleDrafter(draft, base, top_k=2, depth=3, total_tokens=11)  # every candidate
    seen, _ = proposals(EagleDrafter, SpeculativeGenerator(base, drafter, adaptive=False))
    check_eagle_drafts(drafter, base, seen, top_k=2, depth=3)


@torch.no_grad()
def check_eagle_drafts(drafter, base, seen: list, top_k: int, depth: int) -> None:
    """Each dynamic tree of `seen` (from `proposals`) expands `depth` levels of the draft's top
    `top_k` tokens after each node, the draft's outputs computed afresh from the sequence."""
    draft = drafter.draft
    for sequence, proposal in seen:
        out, features = _draft_reference(drafter, base, sequence)
        parents, tokens = proposal.tree.parents.tolist(), proposal.tokens
        assert max(proposal.tree.depths.tolist()) == depth  # expanded depth - 1 times
        # each node's path: the draft's outputs after the root, fed back as features
        hidden = {0: out[-1]}
        for node in range(1, len(parents)):
            ranked = drafter._log_probs(hidden[parents[node]][None])[0].topk(top_k).indices
            assert tokens[node] in draft.to_base_ids(ranked), (node, f"not a top-{top_k} token")
            path = [node]
            while parents[path[-1]] > 0:
                path.append(parents[path[-1]])
            path = path[::-1]  # depth 1 .. this node
            if node in parents:  # expanded: its output drafts its children
                ids = torch.cat([sequence[1:], tokens[path]])[None]
                fed = [hidden[0]] + [hidden[p] for p in path[:-1]]
                feats = torch.cat([features, torch.stack(fed)])[None]
                hidden[node] = draft(
                    base.get_input_embeddings()(ids), feats, torch.arange(ids.shape[1])[None]
                )[0, -1]


def test_a_medusa_tree_holds_each_heads_top_tokens_after_the_roots_base_state():
    # Head k drafts depth k + 1 from the base's state that produced the root (the last one),
    # against a reference from a full forward of the sequence, not the drafter's own feed.
    from heads import MedusaConfig, MedusaHeads
    from inference.drafters.medusa import MedusaDrafter

    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    torch.manual_seed(3)
    for block in heads.blocks:  # heads that differ from the base and from each other
        torch.nn.init.normal_(block.layers[0].weight, std=0.5)
    seen, _ = proposals(MedusaDrafter, SpeculativeGenerator(base, heads, adaptive=False))
    check_medusa_drafts(heads, base, seen, ranks=4)  # the default tree's: ranks 0-3


@torch.no_grad()
def check_medusa_drafts(heads, base, seen: list, ranks: int) -> None:
    """At each depth k + 1 of the trees of `seen` (from `proposals`), head k's top `ranks`
    tokens from the base's last state of the sequence (the one that gave the root)."""
    for sequence, proposal in seen:
        state = base.model(input_ids=sequence[None]).last_hidden_state[0, -2]
        depths = proposal.tree.depths
        for k in range(int(depths.max())):  # head k drafts depth k + 1
            top = heads.to_base_ids(heads.head_logits(k, state[None])[0].topk(ranks).indices)
            drafted = proposal.tokens[depths == k + 1]
            assert drafted.numel() and torch.isin(drafted, top).all(), (k, drafted, top)
