"""Losses and accuracy metrics of the draft heads. Pure tensor functions, no model calls.

Shapes: B batch, T tokens, H hidden, V vocab, K heads / steps. `soft_target_ce` sums over the
rows it is given; the trainees divide every head's sum by the answer tokens. Dense references of
the trainees' losses, as the papers state them, are in tests/train/dense_losses.py.
"""

from __future__ import annotations

import torch


def _row_chunks(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None):
    """(rows slice, its logits, their targets) chunk by chunk, in fp32 (fp64 for fp64 logits):
    ~1 MB of temporaries on a CPU (they stay in its caches), ~64 MB on an accelerator (few
    kernel launches)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    elements = 2**18 if logits.device.type == "cpu" else 2**24
    step = max(1, elements // max(logits.shape[-1], 1))
    for start in range(0, logits.shape[0], step):
        part = slice(start, start + step)
        t = targets[part] if rows is None else targets[rows[part]]
        yield part, logits[part].to(dtype), t.to(dtype)


class _SoftTargetCE(torch.autograd.Function):
    """sum_i CE(targets[rows_i], softmax(logits_i)), a chunk of rows at a time."""

    @staticmethod
    def forward(ctx, logits, targets, rows):
        total = logits.new_zeros((), dtype=torch.promote_types(logits.dtype, torch.float32))
        with torch.autocast(logits.device.type, enabled=False):
            for _, z, t in _row_chunks(logits, targets, rows):
                # -sum_v t_v log softmax(z)_v = logsumexp(z) * sum_v t_v - sum_v t_v z_v
                total += (z.logsumexp(-1) * t.sum(-1)).sum() - (t * z).sum()
        ctx.save_for_backward(logits, targets, rows)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        logits, targets, rows = ctx.saved_tensors
        grad = torch.empty_like(logits)  # the only (n, V) tensor: in the logits' dtype
        with torch.autocast(logits.device.type, enabled=False):
            for part, z, t in _row_chunks(logits, targets, rows):
                grad[part] = (z.softmax(-1) * t.sum(-1, keepdim=True) - t) * grad_total
        return grad, None, None


def soft_target_ce(
    logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_i CE(targets[rows[i]], softmax(logits[i])): a soft-label cross entropy summed over the
    rows, in fp32 whatever the logits' dtype (fp64 for fp64). logits (n, V); targets (m, V)
    probabilities, a constant (no gradient flows to them; a row may sum to other than 1); rows
    (n,) the target row of each logit row (None: row i, m == n).

    The same value and gradient as `-(targets[rows] * logits.float().log_softmax(-1)).sum()`,
    a chunk of rows at a time. For the backward it keeps the logits themselves (that formula
    kept fp32 log-probabilities and gathered targets: 8 bytes an element against 2 for bf16
    logits) and makes no other (n, V) tensor than the gradient, in the logits' dtype (for a
    128k vocabulary and 16k rows, each fp32 (n, V) tensor is 8.6 GB)."""
    n = logits.shape[0] if logits.dim() == 2 else -1
    if n < 0 or targets.dim() != 2 or targets.shape[-1] != logits.shape[-1]:
        raise ValueError(
            f"soft_target_ce takes logits (n, V) and targets (m, V); got {tuple(logits.shape)} "
            f"and {tuple(targets.shape)}"
        )
    if rows is None and targets.shape[0] != n:
        raise ValueError(
            f"soft_target_ce without rows needs one target row per logit row: got "
            f"{n} and {targets.shape[0]}"
        )
    if rows is not None and tuple(rows.shape) != (n,):
        raise ValueError(f"soft_target_ce needs rows (n,) = ({n},); got {tuple(rows.shape)}")
    if targets.requires_grad:
        raise ValueError("soft_target_ce takes the targets as constants: pass targets.detach()")
    return _SoftTargetCE.apply(logits, targets, rows)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t+n] along dim 1; the last n positions get `fill`. (B,T,...) -> same."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - n] = x[:, n:]
    return out


def top_ids(logits: torch.Tensor, k: int, to_ids=None) -> torch.Tensor:
    """(..., min(k, V)) the ids of the k largest logits, best first; `to_ids` maps the logits'
    indices to other ids (a reduced draft vocabulary's `to_base_ids`). Column 0 is an argmax
    (of tied logits, any one, as the drafters' topk picks at inference): one topk serves both
    accuracy metrics, where on a CPU an argmax over a vocabulary costs more than the topk."""
    top = logits.detach().topk(min(k, logits.shape[-1]), dim=-1).indices
    return top if to_ids is None else to_ids(top)


def count(values: torch.Tensor) -> tuple[int, int]:
    """(sum, number) of a tensor of hits or accept lengths: a metric given as a ratio, which
    held-out evaluation sums over its batches and divides once (every position weighs the same),
    and a training log divides per batch (`ratio_means`)."""
    return int(values.long().sum()), values.numel()


def ratio_means(metrics: dict) -> dict[str, float]:
    """Metrics with each (numerator, denominator) pair divided out (an empty one left out)."""
    return {
        k: (v[0] / v[1] if isinstance(v, tuple) else v)
        for k, v in metrics.items()
        if not isinstance(v, tuple) or v[1]
    }


def chain_accept_length(correct: torch.Tensor) -> torch.Tensor:
    """Simulated tokens per verify step of a greedy chain from per-step correctness.

    correct: (K, N) bool, step k right at position n. Returns (N,) = 1 + number of leading
    correct steps (the bonus token included, as Spec-Bench counts tau).
    """
    return 1 + correct.long().cumprod(dim=0).sum(dim=0)


def sim_tau(correct: list[torch.Tensor], rows: torch.Tensor) -> tuple[int, int]:
    """`count` of the simulated chain's accept lengths at `rows` (B,T), the rows whose next token
    is a target: 1 + the leading right steps of `correct` (K tensors (B,T); 1 where none)."""
    if not correct:
        return (int(rows.sum()),) * 2
    return count(chain_accept_length(torch.stack(correct)[:, rows]))


def walk_accept_length(correct: torch.Tensor, start: torch.Tensor) -> tuple[int, int]:
    """Tokens and verify steps of a greedy chain decoding the answers: (tokens, steps).

    correct: (K, B, T) bool, step k at row t right (it predicts the token k + 2 positions after
    row t); start: (B, T) bool, rows a decode step can start from: the root token (row t + 1) and
    the next one are answer tokens. Each run of start rows (an answer) is walked from its first
    row, as decoding does after the prefill gave the answer's first token: a step at row t
    accepts a = 1 + leading correct steps (the bonus token included), at most the answer's
    tokens left, and the next step starts at row t + a. Unlike the mean of `chain_accept_length`
    over every row, which counts an easy stretch once per row, a stretch crossed in one step
    counts once: tokens / steps is the tau a fixed chain of K steps reaches on these answers.
    """
    accept = (1 + correct.long().cumprod(dim=0).sum(dim=0)).tolist()  # (B,T)
    rows = start.tolist()
    tokens = steps = 0
    for b, t in start.nonzero().tolist():  # in order, the answers' rows only
        row = rows[b]
        if t > 0 and row[t - 1]:
            continue  # inside an answer: its walk started at its first row
        end = t  # the answer's last start row: it predicts the answer's last token
        while end + 1 < len(row) and row[end + 1]:
            end += 1
        while t <= end:
            a = min(accept[b][t], end - t + 1)
            tokens, steps, t = tokens + a, steps + 1, t + a
    return tokens, steps
