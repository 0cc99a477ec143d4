"""The Medusa drafter: the default tree's size, each node's token of its own head and rank in base
ids, the arms deduplicated after cutting to the vocabulary, and ranks checked against the draft
vocabulary."""

import pytest
import torch

from heads import MedusaConfig, MedusaHeads
from inference import MedusaDrafter, Sampling
from inference.tree import DEFAULT_ACCURACIES, build_static_tree, rank_paths
from tests.conftest import make_tiny_llama


def test_the_default_medusa_tree_is_the_8_node_one():
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=3)).init_from_base(base)
    drafter = MedusaDrafter(heads)
    assert drafter.max_nodes == drafter.tree.num_nodes == 8
    expected = build_static_tree(DEFAULT_ACCURACIES[:3], 8)
    assert sorted(rank_paths(drafter.tree)[1:]) == sorted(tuple(c) for c in expected)


@torch.no_grad()
def test_each_node_holds_its_heads_token_of_its_rank_as_a_base_id():
    # A reduced vocabulary in reversed order, so that draft indices are not base ids; heads whose
    # blocks and lm_heads differ, so that heads and ranks name different tokens.
    base = make_tiny_llama()
    keep = torch.arange(0, 256, 4).flip(0)
    config = MedusaConfig.from_base(base.config, num_heads=2, truncated_vocab_size=64)
    heads = MedusaHeads(config).init_from_base(base, token_map=keep)
    torch.manual_seed(3)
    for block, lm in zip(heads.blocks, heads.lm_heads):
        torch.nn.init.normal_(block.layers[0].weight, std=0.5)
        torch.nn.init.normal_(lm.weight, std=0.5)
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 3)]
    drafter = MedusaDrafter(heads, choices)
    sequence = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(0))
    hidden = base.model(input_ids=sequence[None]).last_hidden_state[0]
    drafter.reset()
    drafter.observe(sequence, hidden, None, int(sequence[-1]))
    draft = drafter.propose(sequence, Sampling())
    state = hidden[-1]  # the state whose lm_head gave the root
    assert int(draft.tokens[0]) == int(sequence[-1])
    paths = rank_paths(draft.tree)
    for node in range(1, draft.tree.num_nodes):
        path = paths[node]
        k, rank = len(path) - 1, path[-1]  # head k drafts depth k + 1
        ranked = heads.head_logits(k, state[None])[0].topk(rank + 1).indices
        assert int(draft.tokens[node]) == int(keep[ranked[rank]]), (path, draft.tokens)
    # siblings hold distinct tokens
    for parent in range(draft.tree.num_nodes):
        kids = draft.tree.children(parent)
        assert len({int(draft.tokens[c]) for c in kids}) == len(kids)
    assert not draft.sampled.any()


def test_arms_that_the_vocabulary_cuts_to_one_tree_are_one_arm():
    """Over a one-token draft vocabulary the chain and the 32- and 64-node trees all keep only
    the rank-0 paths: one arm, not three copies of it."""
    base = make_tiny_llama()
    config = MedusaConfig.from_base(base.config, num_heads=2, truncated_vocab_size=1)
    heads = MedusaHeads(config).init_from_base(base, token_map=torch.tensor([7]))
    arms = MedusaDrafter(heads).default_arms(torch.device("cuda"))
    assert arms == [None, {"choices": [(0,), (0, 0)]}]


def test_a_tree_is_checked_against_the_draft_vocabulary_not_the_bases():
    base = make_tiny_llama()
    config = MedusaConfig.from_base(base.config, num_heads=2, truncated_vocab_size=3)
    heads = MedusaHeads(config).init_from_base(base, token_map=torch.tensor([5, 9, 200]))
    with pytest.raises(
        ValueError, match="rank-5 token, but the vocabulary of these Medusa heads has 3 tokens"
    ):
        MedusaDrafter(heads, [(0,), (5,)])
