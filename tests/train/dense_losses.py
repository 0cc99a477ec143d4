"""Dense references for the trainees' losses (tests only): each head's loss written as the paper
states it, over the whole vocabulary and every row, which train/medusa.py's and train/eagle.py's
chunked losses on the valid rows must equal."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from train.losses import shift_left, top_ids


def soft_cross_entropy(
    logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor, divisor=None
) -> torch.Tensor:
    """sum_t mask_t * CE(target_probs_t, softmax(logits_t)) / divisor (sum mask by default).
    logits, targets (B,T,V)."""
    logp = logits.float().log_softmax(-1)
    ce = -(target_probs.float() * logp).sum(-1)  # (B,T)
    return (ce * mask).sum() / (mask.sum().clamp(min=1) if divisor is None else divisor)


def hard_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, divisor=None
) -> torch.Tensor:
    """Masked token CE summed over the mask / divisor (sum mask by default). logits (B,T,V),
    labels (B,T)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(
        labels
    )
    return (ce * mask).sum() / (mask.sum().clamp(min=1) if divisor is None else divisor)


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, k: int, to_ids=None) -> torch.Tensor:
    """(...) bool: label in the top-k of logits (every label when k >= V). `to_ids` maps the
    logits' indices to the labels' ids first (a reduced draft vocabulary's `to_base_ids`)."""
    return (top_ids(logits, k, to_ids) == labels[..., None]).any(-1)


def medusa_loss(head_logits, labels, mask, decay: float = 0.8, target_probs=None):
    """Medusa-1 loss (Cai et al. 2024): sum_k decay^k * CE(head_k(h_t), y_{t+k+2}), each head's
    sum over its targets divided by the answer tokens (rows whose next token is one), as the
    trainee divides it.

    head_logits (K,B,T,V) from h_t; labels (B,T) the token ids; mask (B,T) 1 on assistant
    tokens; target_probs optional (B,T,V): the base's distribution at each position (it predicts
    token t+1), used as soft labels. Returns (loss, per-head (top1, top5) on valid positions).
    """
    K = head_logits.shape[0]
    total = head_logits.new_zeros(())
    answer_tokens = shift_left(mask, 1).sum().clamp(min=1)
    stats = []
    for k in range(K):
        tgt = shift_left(labels, k + 2)
        valid = shift_left(mask, k + 2).float()
        if target_probs is None:
            loss_k = hard_cross_entropy(head_logits[k], tgt, valid, answer_tokens)
        else:
            probs = shift_left(target_probs, k + 1)
            loss_k = soft_cross_entropy(head_logits[k], probs, valid, answer_tokens)
        total = total + decay**k * loss_k
        v = valid.bool()
        stats.append(
            (topk_correct(head_logits[k], tgt, 1)[v], topk_correct(head_logits[k], tgt, 5)[v])
        )
    return total, stats
