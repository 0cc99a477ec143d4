"""The row-by-row verifiers (used on CPU, where each lm_head row is costly) accept exactly what
the dense verifiers accept, with the same random draws."""

import pytest
import torch

from inference.acceptance import (
    verify_greedy,
    verify_greedy_walk,
    verify_sampling,
    verify_sampling_walk,
    warp_probs,
)
from inference.tree import tree_from_parents


def random_tree(g, n, vocab):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tokens = [0]
    for i in range(1, n):  # distinct tokens among siblings, as every drafter proposes
        used = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens.append(next(t for t in torch.randperm(vocab, generator=g).tolist() if t not in used))
    return tree_from_parents(parents), torch.tensor(tokens)


def test_greedy_walk_equals_dense():
    g = torch.Generator().manual_seed(0)
    deep = 0
    for _ in range(300):
        tree, tokens = random_tree(g, int(torch.randint(1, 12, (1,), generator=g)), 12)
        logits = torch.randn(tree.num_nodes, 12, generator=g)
        for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
            if torch.rand(1, generator=g) < 0.5:  # make many drafts right
                logits[parent, tokens[i]] += 4
        visited = []

        def row(i, visited=visited, logits=logits):
            visited.append(i)
            return logits[i]

        dense, walk = verify_greedy(tokens, logits, tree), verify_greedy_walk(tokens, tree, row)
        assert torch.equal(dense.nodes, walk.nodes) and dense.bonus_token == walk.bonus_token
        assert visited == walk.nodes.tolist()  # only the accepted nodes' rows were read
        deep += len(walk.nodes) > 2
    assert deep > 30  # the comparison covered long accepted paths, not only the root


@pytest.mark.parametrize("sampled_share", [0.0, 0.5, 1.0])
def test_sampling_walk_equals_dense_with_same_draws(sampled_share):
    g = torch.Generator().manual_seed(1)
    for trial in range(300):
        tree, tokens = random_tree(g, int(torch.randint(1, 10, (1,), generator=g)), 10)
        n = tree.num_nodes
        probs = warp_probs(torch.randn(n, 10, generator=g) * 2, 1.0)
        q = warp_probs(torch.randn(n, 10, generator=g) * 2, 1.0)
        sampled = torch.rand(n, generator=g) < sampled_share
        sampled[0] = False
        # a sampled token must have q > 0 under its parent (it always does for softmax q)
        a = verify_sampling(tokens, probs, tree, q, sampled, torch.Generator().manual_seed(trial))
        b = verify_sampling_walk(
            tokens, tree, probs.__getitem__, q, sampled, torch.Generator().manual_seed(trial)
        )
        assert torch.equal(a.nodes, b.nodes) and a.bonus_token == b.bonus_token
