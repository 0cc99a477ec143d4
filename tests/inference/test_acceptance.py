"""Verification rules: greedy and typical on hand-written logits; lossless sampling checked
statistically against the exact joint distribution of the first two emitted tokens."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from inference.acceptance import (
    Acceptance,
    verify_greedy,
    verify_sampling,
    verify_sampling_batch,
    verify_sampling_walk,
    verify_typical,
    warp_probs,
)
from inference.tree import tree_from_parents

# ---------------------------------------------------------------------------------------------
# greedy

# root -> {1, 2}, 1 -> {3}, 2 -> {4}
FORK = tree_from_parents([-1, 0, 0, 1, 2])


def one_hot_logits(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)  # (N, V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_accepts_longest_correct_chain():
    tokens = torch.tensor([5, 1, 2, 3, 4])
    # after root the base wants 2 (node 2), after node 2 it wants 4 (node 4), then 0
    logits = one_hot_logits([2, 3, 4, 1, 0])
    acc = verify_greedy(tokens, logits, FORK)
    assert acc.nodes.tolist() == [0, 2, 4] and acc.bonus_token == 0
    assert acc.new_tokens(tokens) == [2, 4, 0]


def test_greedy_all_wrong_accepts_root_only():
    tokens = torch.tensor([5, 1, 2, 3, 4])
    acc = verify_greedy(tokens, one_hot_logits([5, 3, 4, 1, 0]), FORK)
    assert acc.nodes.tolist() == [0] and acc.bonus_token == 5
    assert acc.new_tokens(tokens) == [5]


def test_greedy_ties():
    # duplicate sibling tokens: both depth-1 nodes are correct
    tokens = torch.tensor([5, 2, 2, 3, 4])
    assert verify_greedy(tokens, one_hot_logits([2, 1, 4, 0, 0]), FORK).nodes.tolist() == [0, 2, 4]
    acc = verify_greedy(tokens, one_hot_logits([2, 1, 1, 0, 0]), FORK)
    assert acc.nodes.tolist() == [0, 1] and acc.bonus_token == 1  # equal depth: first index
    # tied logits: argmax takes the first maximal token
    logits = torch.tensor([[0.0, 3.0, 3.0, 0.0, 0.0, 0.0]]).repeat(5, 1)
    acc = verify_greedy(torch.tensor([5, 2, 1, 1, 1]), logits, FORK)
    assert acc.nodes.tolist() == [0, 2, 4] and acc.bonus_token == 1


# ---------------------------------------------------------------------------------------------
# warping


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 0.8), (0.7, 5, 1.0), (1.3, 8, 0.6), (0.5, 0, 0.95)]
)
def test_warp_probs_matches_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 2
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    got = warp_probs(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)
    assert torch.equal(got > 0, expected > 0)


def test_warp_probs_greedy_and_bad_args():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert warp_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0]]
    assert warp_probs(logits, 1.0, top_p=1e-6).tolist() == [[0.0, 1.0, 0.0]]  # keeps one
    with pytest.raises(ValueError):
        warp_probs(logits, -1.0)
    with pytest.raises(ValueError):
        warp_probs(logits, 1.0, top_p=0.0)


def test_a_tiny_temperature_samples_the_argmax_and_ties_evenly():
    """logits / 1e-39 overflows float32 (the largest to inf, NaN after softmax): the largest
    goes first, so the others go to -inf instead."""
    logits = torch.tensor([[10.0, 30.0, 20.0], [5.0, 5.0, -3.0]])
    got = warp_probs(logits, 1e-39)
    assert got.tolist() == [[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]
    assert warp_probs(logits, 1e-39, top_k=2, top_p=0.9).tolist() == got.tolist()
    acc = verify_typical(torch.tensor([1, 1]), logits, tree_from_parents([-1, 0]), 1e-39)
    assert acc.nodes.tolist() == [0, 1] and acc.bonus_token in (0, 1)


# ---------------------------------------------------------------------------------------------
# lossless sampling: simple cases


def test_sampling_point_mass_target_always_accepts_and_zero_mass_never():
    tokens = torch.tensor([0, 1, 2, 3, 4])
    p = torch.full((5, 6), 1 / 6)
    p[0] = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # the base surely wants node 1's token
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        acc = verify_sampling(tokens, p, FORK, None, torch.zeros(5, dtype=torch.bool), gen)
        assert acc.nodes.tolist()[:2] == [0, 1]
    p[0] = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 0.5])  # neither child has mass
    for _ in range(20):
        acc = verify_sampling(tokens, p, FORK, None, torch.zeros(5, dtype=torch.bool), gen)
        assert acc.nodes.tolist() == [0] and acc.bonus_token in (0, 5)


def test_sampling_is_reproducible_and_checks_inputs():
    tokens = torch.tensor([0, 1, 2, 3, 4])
    p = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(2)), -1)
    sampled = torch.ones(5, dtype=torch.bool)
    runs = [
        verify_sampling(tokens, p, FORK, q, sampled, torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].nodes, runs[1].nodes) and runs[0].bonus_token == runs[1].bonus_token
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampling(tokens, p, FORK, None, sampled)
    q[0, 1] = 0.0  # node 1 claims to be sampled from q, but q could not produce it
    with pytest.raises(ValueError, match="q\\(token\\) == 0"):
        verify_sampling(tokens, p, FORK, q, sampled)


# ---------------------------------------------------------------------------------------------
# lossless sampling: statistics
#
# The target is a Markov chain over V = 5 tokens: the base's distribution after a path depends
# only on its last token, P[token]. So the exact law of the first two tokens emitted after a root
# token t is J[a, b] = P[t, a] * P[a, b], whatever the tree. When a step emits only one token
# (the bonus), the second comes from the next step, rooted at that bonus, as in generation.

V, ROOT, TRIALS = 5, 0, 40_000


@pytest.fixture(autouse=True)
def one_thread():
    # Tensors of 40k x 5 are just past torch's parallel grain; on a busy 2-core machine the
    # thread hand-offs cost 10x the arithmetic.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


P = torch.tensor(
    [
        [0.10, 0.40, 0.25, 0.15, 0.10],
        [0.30, 0.05, 0.20, 0.25, 0.20],
        [0.20, 0.20, 0.10, 0.35, 0.15],
        [0.25, 0.15, 0.30, 0.10, 0.20],
        [0.15, 0.25, 0.20, 0.30, 0.10],
    ]
)
Q = torch.tensor(  # the drafter's view, deliberately unlike P; no ties within a row
    [
        [0.05, 0.15, 0.50, 0.10, 0.20],
        [0.40, 0.10, 0.05, 0.30, 0.15],
        [0.10, 0.25, 0.05, 0.45, 0.15],
        [0.35, 0.05, 0.20, 0.15, 0.25],
        [0.20, 0.30, 0.15, 0.25, 0.10],
    ]
)
LOGITS = torch.tensor(
    [
        [0.3, 1.9, 1.1, -0.4, 0.8],
        [1.5, -1.0, 0.2, 1.2, 0.6],
        [-0.5, 0.9, 0.1, 2.0, 1.4],
        [1.0, 0.4, 1.7, -0.2, 0.7],
        [0.6, 1.3, -0.8, 1.8, 0.0],
    ]
)
Q2 = Q.roll(2, dims=-1)  # a second drafter's (a union's): each node says its row (q_rows)
# root -> {1, 2, 3}, 1 -> {4, 5}, 2 -> {6}
TREE = tree_from_parents([-1, 0, 0, 0, 1, 1, 2])
PARENTS = TREE.parents.tolist()
RANKS = [0] + [TREE.children(p).index(c) for c, p in enumerate(PARENTS) if p >= 0]


def draft(roots: torch.Tensor, mode: str, gen: torch.Generator):
    """Tokens (B, N) and `sampled` (N,) for a drafter with distribution Q after each token.

    topk: children are Q's top-k; sampled: i.i.d. draws from Q (duplicates happen); mixed: the
    first child is Q's top-1 and the rest are draws; two_q: draws, from Q for a node's first
    child, from Q2 for its others; topk_as_sampled: top-k tokens passed as if drawn from Q, and
    two_q_as_one: two_q's draws passed as if all drawn from Q (neither lossless).
    """
    tokens = torch.empty(roots.shape[0], TREE.num_nodes, dtype=torch.long)
    tokens[:, 0] = roots
    sampled = torch.zeros(TREE.num_nodes, dtype=torch.bool)
    for c in range(1, TREE.num_nodes):
        second = mode in ("two_q", "two_q_as_one") and RANKS[c] > 0
        q = (Q2 if second else Q)[tokens[:, PARENTS[c]]]  # (B, V)
        if mode in ("topk", "topk_as_sampled") or (mode == "mixed" and RANKS[c] == 0):
            tokens[:, c] = q.argsort(dim=-1, descending=True)[:, RANKS[c]]
        else:
            tokens[:, c] = torch.multinomial(q, 1, generator=gen).squeeze(1)
            sampled[c] = True
    if mode == "topk_as_sampled":
        sampled[1:] = True
    return tokens, sampled


def step(roots, p_table, mode, gen):
    """One draft + verify step; returns the emitted tokens (B, 2), -1 where not emitted."""
    tokens, sampled = draft(roots, mode, gen)
    q, q_rows = Q[tokens], None
    if mode == "two_q":  # rows 0..N-1: Q after each node; N..2N-1: Q2 after each node
        q = torch.cat([Q[tokens], Q2[tokens]], dim=1)
        q_rows = torch.tensor([p + TREE.num_nodes * (r > 0) for p, r in zip(PARENTS, RANKS)])
    last, bonus = verify_sampling_batch(tokens, p_table[tokens], TREE, q, sampled, gen, q_rows)
    on_path = TREE.ancestors[last]  # (B, N)
    depth = TREE.depths[last]

    def token_at(d: int) -> torch.Tensor:  # token of the path node at depth d (B,)
        node = (on_path & (TREE.depths == d)).long().argmax(dim=1, keepdim=True)
        return tokens.gather(1, node).squeeze(1)

    first = torch.where(depth >= 1, token_at(1), bonus)
    second = torch.where(depth >= 2, token_at(2), torch.where(depth == 1, bonus, -1))
    return torch.stack([first, second], dim=1)


def chi_square(mode: str, p_table: torch.Tensor, seed: int = 0) -> tuple[float, float]:
    """Chi-square statistic of the first two emitted tokens against the exact law, and the
    critical value at significance 1e-3 (Wilson-Hilferty approximation, within ~1%)."""
    gen = torch.Generator().manual_seed(seed)
    out = step(torch.full((TRIALS,), ROOT), p_table, mode, gen)
    short = out[:, 1] < 0
    out[short, 1] = step(out[short, 0], p_table, mode, gen)[:, 0]
    counts = torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V).double()
    expected = TRIALS * (p_table[ROOT][:, None] * p_table).flatten().double()  # (V*V,)
    support = expected > 0
    assert counts[~support].sum() == 0, "emitted a pair the target cannot produce"
    stat = float(((counts - expected)[support] ** 2 / expected[support]).sum())
    df = int(support.sum()) - 1
    z = 3.0902  # standard normal quantile at 0.999
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


@pytest.mark.parametrize("mode", ["topk", "sampled", "mixed", "two_q"])
def test_sampling_is_lossless(mode):
    stat, critical = chi_square(mode, P)
    assert stat < critical, (stat, critical)


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_sampling_is_lossless_under_top_p(mode):
    p_table = warp_probs(LOGITS, temperature=1.0, top_p=0.7)
    assert (p_table == 0).any()  # the truncation bites, so drafts hit zero-mass tokens
    stat, critical = chi_square(mode, p_table)
    assert stat < critical, (stat, critical)


@pytest.mark.parametrize("mode", ["topk_as_sampled", "two_q_as_one"])
def test_q_rule_on_drafts_of_another_law_is_biased(mode):
    # negative controls: the same statistic must catch a drafter that is not lossless (top-k
    # tokens said to be draws; draws from Q2 judged by Q, as without q_rows)
    stat, critical = chi_square(mode, P)
    assert stat > 3 * critical, (stat, critical)


# ---------------------------------------------------------------------------------------------
# typical acceptance (lossy)

# root -> {1, 2}, 1 -> {3}
SMALL = tree_from_parents([-1, 0, 0, 1])


def test_typical_accepts_typical_and_rejects_unlikely():
    tokens = torch.tensor([3, 1, 2, 0])
    p = torch.tensor(
        [
            [0.70, 0.20, 0.06, 0.04],  # threshold min(0.09, 0.3 e^-H ~ 0.126) = 0.09
            [0.25, 0.25, 0.25, 0.25],  # high entropy: threshold 0.075, anything goes
            [0.25, 0.25, 0.25, 0.25],
            [1e-6, 1e-6, 1.0, 1e-6],
        ]
    )
    gen = torch.Generator().manual_seed(0)
    acc = verify_typical(tokens, p.log(), SMALL, temperature=1.0, generator=gen)
    assert acc.nodes.tolist() == [0, 1, 3] and acc.bonus_token == 2
    p[1] = torch.tensor([0.001, 0.001, 0.997, 0.001])  # node 3's token is now far too unlikely
    acc = verify_typical(tokens, p.log(), SMALL, temperature=1.0, generator=gen)
    assert acc.nodes.tolist() == [0, 1] and acc.bonus_token == 2


def test_typical_prefers_likelier_path_and_greedy_at_zero_temperature():
    tokens = torch.tensor([3, 1, 0, 1])
    logits = torch.tensor([[0.5, 0.4, 0.05, 0.05]]).log().repeat(4, 1)
    acc = verify_typical(tokens, logits, SMALL, temperature=1.0)
    assert acc.nodes.tolist() == [0, 1, 3]  # depth 2 beats depth 1
    tokens[3] = 3  # now only depth-1 nodes pass; node 2 (p = 0.5) beats node 1 (p = 0.4)
    assert verify_typical(tokens, logits, SMALL, temperature=1.0).nodes.tolist() == [0, 2]
    greedy = verify_typical(tokens, logits, SMALL, temperature=0.0)
    assert isinstance(greedy, Acceptance) and greedy.nodes.tolist() == [0, 2]


def test_top_p_drops_a_tail_whose_mass_equals_one_minus_top_p_exactly_as_hf():
    # four equal tokens: tail masses 0.25, 0.5, 0.75, 1.0 are exact in float32. With top_p=0.5
    # HF drops every token whose tail mass is <= 0.5: two tokens stay, not three.
    logits = torch.zeros(1, 4)
    for top_p, kept in ((0.5, 2), (0.75, 3)):
        got = warp_probs(logits, 1.0, top_p=top_p)
        want = TopPLogitsWarper(top_p)(None, logits.clone()).softmax(-1)
        assert int((got > 0).sum()) == kept and torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want)
    # a skewed row: masses 0.25, 0.25, 0.5; top_p=0.75 drops exactly the 0.25 tail
    skewed = torch.tensor([[0.0, 0.0, math.log(2.0)]])
    got = warp_probs(skewed, 1.0, top_p=0.75)
    want = TopPLogitsWarper(0.75)(None, skewed.clone()).softmax(-1)
    assert int((got > 0).sum()) == 2
    torch.testing.assert_close(got, want)


def test_top_k_of_one_is_the_argmax_one_hot_as_hf():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    got = warp_probs(logits, 0.8, top_k=1)
    want = TopKLogitsWarper(1)(None, logits.clone() / 0.8).softmax(-1)
    torch.testing.assert_close(got, want)
    assert torch.equal(got, torch.nn.functional.one_hot(logits.argmax(-1), 20).float())


def test_a_residual_that_empties_falls_back_to_the_parents_distribution(monkeypatch):
    """The documented fallback: a rejection of a child whose acceptance probability was 1
    (only possible through rounding) leaves r = p at that node, not p at the child. Forcing
    every uniform draw to 1.0 makes that rejection happen deterministically."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones_like(real_rand(*a, **k)))
    tree = tree_from_parents([-1, 0])  # root -> 1
    tokens = torch.tensor([0, 1])
    cases = [
        # sampled from q == p at the root: the residual max(0, p - q) is empty after a rejection
        (torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]), True),
        # point mass: p at the root puts everything on node 1's token
        (torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]), False),
    ]
    for p, is_sampled in cases:
        sampled = torch.tensor([False, is_sampled])
        q = p.clone() if is_sampled else None
        for seed in range(20):
            dense = verify_sampling(
                tokens, p, tree, q, sampled, torch.Generator().manual_seed(seed)
            )
            assert dense.nodes.tolist() == [0]
            assert p[0, dense.bonus_token] > 0  # drawn from p at the root, never from p[1]
            walk = verify_sampling_walk(
                tokens, tree, p.__getitem__, q, sampled, torch.Generator().manual_seed(seed)
            )
            assert walk.nodes.tolist() == [0] and walk.bonus_token == dense.bonus_token


def test_typical_threshold_is_the_parents_not_the_nodes_own():
    # node 1's token has p = 0.05 under the root's flat distribution over 20 tokens (threshold
    # 0.3 * exp(-H) ~ 0.015): typical. Node 1's own row is peaked (threshold 0.09), which must
    # not matter: the threshold belongs to the distribution the token is judged under.
    tree = tree_from_parents([-1, 0])
    tokens = torch.tensor([0, 7])
    p = torch.full((2, 20), 0.95 / 19)
    p[0, 7] = 0.05
    p[0] /= p[0].sum()
    p[1] = 1e-4
    p[1, 3] = 1.0
    acc = verify_typical(
        tokens, p.log(), tree, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert acc.nodes.tolist() == [0, 1]


def test_typical_divides_the_logits_by_the_temperature():
    # root p = (0.6, 0.3, 0.1). At temperature 1 the 0.1 token passes (threshold 0.09); at
    # temperature 0.5, p = softmax(log p / 0.5) gives it 0.022: rejected.
    tree = tree_from_parents([-1, 0])
    tokens = torch.tensor([0, 2])
    logits = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]).log()
    assert verify_typical(tokens, logits, tree, 1.0).nodes.tolist() == [0, 1]
    assert verify_typical(tokens, logits, tree, 0.5).nodes.tolist() == [0]
    # and the bonus comes from the temperature-0.5 distribution, where token 2 is rare
    gen = torch.Generator().manual_seed(0)
    bonuses = [
        verify_typical(tokens, logits, tree, 0.5, generator=gen).bonus_token for _ in range(100)
    ]
    assert bonuses.count(2) < 12  # p = 0.022 (expected 2), against 0.19 (19) were logits * T


def test_a_tiny_top_p_keeps_the_top_token_even_when_the_mass_sums_below_one():
    # float32 cumsums of a softmax often end a few ulps under 1.0; with top_p = 1e-7 the
    # threshold 1 - top_p is 0.99999988, at or above some rows' total mass: the most likely
    # token must still stay (HF's min_tokens_to_keep), or the row is all -inf and NaN.
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(0)) * 3
    got = warp_probs(logits, 1.0, top_p=1e-7)
    assert not got.isnan().any()
    assert torch.equal(got, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_typical_threshold_is_capped_at_posterior_threshold():
    # root p = (0.9, 0.1): 0.3 * exp(-H) = 0.217, capped at 0.09, so the 0.1 token passes
    tree = tree_from_parents([-1, 0])
    tokens = torch.tensor([0, 1])
    logits = torch.tensor([[0.9, 0.1], [0.5, 0.5]]).log()
    assert verify_typical(tokens, logits, tree, 1.0).nodes.tolist() == [0, 1]
    # a cap of 0.2 (below 0.217) rejects it
    assert verify_typical(tokens, logits, tree, 1.0, posterior_threshold=0.2).nodes.tolist() == [0]
