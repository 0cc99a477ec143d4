"""train/losses.py's pure tensor functions, and the dense reference losses the trainees are
checked against (tests/train/dense_losses.py), on hand-written tensors."""

from __future__ import annotations

import math

import pytest
import torch

from tests.train.dense_losses import (
    hard_cross_entropy,
    medusa_loss,
    soft_cross_entropy,
    topk_correct,
)
from train.losses import (
    chain_accept_length,
    shift_left,
    soft_target_ce,
    top_ids,
    walk_accept_length,
)


def test_shift_left_moves_along_time_and_fills_the_end():
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert shift_left(x, 1).tolist() == [[2, 3, 4, 0], [6, 7, 8, 0]]
    assert shift_left(x, 2, -1).tolist() == [[3, 4, -1, -1], [7, 8, -1, -1]]
    assert shift_left(x, 0) is x
    assert shift_left(x, 4, 9).tolist() == [[9] * 4, [9] * 4]
    mask = torch.tensor([[False, True, True]])
    assert shift_left(mask, 1, False).tolist() == [[True, True, False]]
    h = torch.arange(12.0).view(1, 3, 4)  # (B,T,H): whole feature vectors move
    assert shift_left(h, 1).tolist() == [[[4, 5, 6, 7], [8, 9, 10, 11], [0, 0, 0, 0]]]


def test_chain_accept_length_counts_leading_correct_steps_plus_the_bonus_token():
    correct = torch.tensor(
        [  # (K=3 steps, N=4 positions)
            [1, 1, 0, 1],
            [1, 0, 1, 1],
            [0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    # Position 1: step 1 is wrong, so step 2's hit does not count; position 2: nothing accepted.
    assert chain_accept_length(correct).tolist() == [3, 2, 1, 4]
    assert chain_accept_length(torch.zeros(0, 2, dtype=torch.bool)).tolist() == [1, 1]


def test_walk_accept_length_decodes_in_steps_not_per_position():
    # One answer of 9 start rows: an easy stretch (both steps right on rows 0-5), then hard rows.
    easy = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    correct = torch.stack([easy, easy])  # (K=2, B=1, T=9)
    start = torch.ones(1, 9, dtype=torch.bool)
    # The per-position mean counts the easy stretch six times: (6 * 3 + 3 * 1) / 9.
    assert chain_accept_length(correct.flatten(1)).float().mean() == pytest.approx(21 / 9)
    # Decoding crosses it in two steps (rows 0 and 3), then one token per step: 9 in 5 steps.
    assert walk_accept_length(correct, start) == (9, 5)


def test_walk_accept_length_walks_each_answer_and_stops_at_its_end():
    correct = torch.zeros(2, 2, 7, dtype=torch.bool)  # (K=2, B=2, T=7)
    correct[:, 0, 0] = True  # sequence 0, row 0: both steps right, 3 tokens
    correct[1, 0, 1] = True  # row 1: step 1 right after a wrong step 0, never reached
    correct[:, 0, 3] = True  # row 3: 3 tokens, but only 2 of the answer are left (rows 3-4)
    correct[:, 1, 5] = True  # sequence 1, its second answer's first row: 3, but 2 left
    start = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1, 1]], dtype=torch.bool)
    # Sequence 1: row 2 is a one-token answer; rows 3-4 are the user's next turn.
    assert walk_accept_length(correct, start) == (3 + 2 + 1 + 2, 4)
    assert walk_accept_length(correct, torch.zeros(2, 7, dtype=torch.bool)) == (0, 0)


def test_soft_cross_entropy_averages_over_masked_positions_only():
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [50.0, -50.0]]])  # (B=1,T=3,V=2)
    target = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last position (a huge loss) is masked out
    lse = math.log(math.exp(2) + 1)
    expected = (math.log(2) + 0.5 * (lse - 2) + 0.5 * lse) / 2
    assert float(soft_cross_entropy(logits, target, mask)) == pytest.approx(expected, rel=1e-6)
    assert float(soft_cross_entropy(logits, target, torch.zeros(1, 3))) == 0.0  # no 0/0
    assert float(soft_cross_entropy(logits, target, mask, 8)) == pytest.approx(expected / 4)


def test_hard_cross_entropy_averages_over_masked_positions_only():
    logits = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[0.0, 3.0, 0.0], [9.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, 2], [1, -100]])  # an ignored label under the mask is fine
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    ce = [
        -math.log(math.e / (math.e + 2)),
        math.log(3),
        -math.log(math.exp(3) / (math.exp(3) + 2)),
    ]
    loss = hard_cross_entropy(logits, labels, mask)
    assert float(loss) == pytest.approx(sum(ce) / 3, rel=1e-6)
    assert float(hard_cross_entropy(logits, labels, mask, 6)) == pytest.approx(sum(ce) / 6)
    assert float(hard_cross_entropy(logits, labels.clamp(min=0), torch.zeros(2, 2))) == 0.0


def test_topk_correct():
    logits = torch.tensor([[[0.1, 0.5, 0.4], [0.9, 0.05, 0.05]]])
    labels = torch.tensor([[2, 0]])
    assert topk_correct(logits, labels, 1).tolist() == [[False, True]]
    assert topk_correct(logits, labels, 2).tolist() == [[True, True]]
    assert topk_correct(logits, labels, 5).all()  # k past the vocabulary: everything is in
    # a reduced draft vocabulary: index i of the logits is base id to_base[i]
    to_base = torch.tensor([7, 3, 9])
    base_labels = torch.tensor([[9, 7]])
    hits = topk_correct(logits, base_labels, 1, to_ids=lambda i: to_base[i])
    assert hits.tolist() == [[False, True]]
    assert topk_correct(logits, base_labels, 2, to_ids=lambda i: to_base[i]).all()
    assert not topk_correct(logits, labels, 3, to_ids=lambda i: to_base[i]).any()  # draft ids


def one_hot_logits(tokens: torch.Tensor, V: int, scale: float = 30.0) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, V).float() * scale


def test_medusa_loss_targets_token_t_plus_k_plus_2_with_decay():
    # labels (B=1,T=6); head k at position t must predict labels[t + k + 2].
    labels = torch.tensor([[5, 1, 2, 3, 4, 0]])
    V, K = 6, 2
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # assistant tokens from t=2
    right = torch.stack([one_hot_logits(shift_left(labels, k + 2), V) for k in range(K)])
    loss, stats = medusa_loss(right, labels, mask)
    assert float(loss) < 1e-6
    # head 0 is checked at t=0..3 (targets 2..5), head 1 at t=0..2 (targets 3..5)
    assert [s[0].tolist() for s in stats] == [[True] * 4, [True] * 3]

    uniform = torch.zeros(K, 1, 6, V)  # CE log(V) at every valid position of every head
    loss, stats = medusa_loss(uniform, labels, mask, decay=0.5)
    # Each head's sum over its targets (4 and 3) per answer token (rows 1-4 predict one: 4)
    assert float(loss) == pytest.approx((4 / 4 + 0.5 * 3 / 4) * math.log(V), rel=1e-6)
    # Wrong only where the target is outside the mask: no effect on the loss.
    wrong_outside = right.clone()
    wrong_outside[0, 0, 4:] = 0.0  # head 0 at t=4,5: targets t+2 = 6, 7 do not exist
    assert float(medusa_loss(wrong_outside, labels, mask)[0]) < 1e-6


def test_medusa_loss_soft_labels_use_the_base_distribution_one_step_later():
    labels = torch.tensor([[0, 1, 2, 3]])
    mask = torch.ones(1, 4)
    V = 4
    # The base's distribution at t predicts token t+1: head 0 at t learns it at t+1.
    base_probs = torch.nn.functional.one_hot(shift_left(labels, 1), V).float()
    head = one_hot_logits(shift_left(labels, 2), V)[None]
    loss, _ = medusa_loss(head, labels, mask, target_probs=base_probs)
    assert float(loss) < 1e-6


def test_metric_pairs_are_divided_once_and_an_empty_one_is_left_out():
    from train.losses import count, ratio_means

    assert count(torch.tensor([True, False, True])) == (2, 3)
    assert count(torch.tensor([1, 3, 2])) == (6, 3)  # accept lengths
    assert ratio_means({"a": (3, 4), "b": (0, 0), "lr": 0.5}) == {"a": 0.75, "lr": 0.5}


def _naive_soft_ce(logits, targets, rows=None):
    picked = targets if rows is None else targets[rows]
    compute = torch.promote_types(logits.dtype, torch.float32)  # fp32, fp64 for fp64
    return -(picked * logits.to(compute).log_softmax(-1)).sum()


@pytest.mark.parametrize("vocab", [7, 2**16])  # 2**16: 4 rows per chunk, so 3 chunks of 10 rows
def test_soft_target_ce_matches_the_log_softmax_formula_in_value_and_gradient(vocab):
    torch.manual_seed(0)
    logits = (torch.randn(10, vocab) * 4).requires_grad_()
    targets = (torch.randn(12, vocab) * 3).softmax(-1)
    rows = torch.tensor([11, 0, 3, 3, 7, 1, 2, 9, 10, 5])  # out of order, one row twice
    for r in (rows, None):
        # a weight on the loss, as decay**j / n is in training: the upstream gradient is not 1
        expected = _naive_soft_ce(logits, targets if r is not None else targets[:10], r)
        (want,) = torch.autograd.grad(0.37 * expected, logits)
        got = soft_target_ce(logits, targets if r is not None else targets[:10], r)
        (grad,) = torch.autograd.grad(0.37 * got, logits)
        assert got.dtype == torch.float32
        assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7)


def test_soft_target_ce_gradient_is_exact_in_fp64_for_unnormalised_targets():
    torch.manual_seed(1)
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.rand(4, 5, dtype=torch.float64)  # rows summing to anything: the general form
    rows = torch.tensor([0, 3, 3, 1, 2, 0])
    assert torch.autograd.gradcheck(lambda z: 2.5 * soft_target_ce(z, targets, rows), (logits,))
    got = soft_target_ce(logits, targets, rows)
    assert float(got.detach()) == pytest.approx(
        float(_naive_soft_ce(logits, targets, rows).detach()), rel=1e-12
    )


def test_soft_target_ce_reads_bf16_logits_in_fp32_and_returns_a_bf16_gradient():
    torch.manual_seed(2)
    logits = (torch.randn(9, 300) * 5).bfloat16().requires_grad_()
    targets = torch.randn(9, 300).softmax(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as under mixed precision
        got = soft_target_ce(logits, targets)
    (got / 7).backward()
    exact = logits.detach().float().requires_grad_()
    expected = _naive_soft_ce(exact, targets)
    (expected / 7).backward()
    assert got.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    # the fp32 gradient rounded once to bf16, as autograd's cast back would
    torch.testing.assert_close(logits.grad, exact.grad.bfloat16(), rtol=0.0, atol=1e-3)


def test_soft_target_ce_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \(n, V\) and targets \(m, V\)"):
        soft_target_ce(torch.zeros(3, 4), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="logits"):
        soft_target_ce(torch.zeros(2, 3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one target row per logit row: got 3 and 4"):
        soft_target_ce(torch.zeros(3, 4), torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"rows \(n,\) = \(3,\); got \(2,\)"):
        soft_target_ce(torch.zeros(3, 4), torch.zeros(5, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="targets.detach"):
        soft_target_ce(torch.zeros(3, 4), torch.zeros(3, 4, requires_grad=True))


def test_top_ids_ranks_best_first_with_column_zero_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 4.0, 6.0, 0.0]]).bfloat16()
    assert top_ids(logits, 3).tolist() == [[1, 3, 0], [2, 0, 1]]
    assert top_ids(logits, 9).shape == (2, 4)  # k past the vocabulary: all of it
    to_base = torch.tensor([10, 11, 12, 13])  # a reduced vocabulary's ids in the base's
    assert top_ids(logits, 1, lambda i: to_base[i]).tolist() == [[11], [12]]
    assert torch.equal(top_ids(logits, 2)[:, 0], logits.argmax(-1))
