"""Verification: which drafted tree nodes the base accepts, and the bonus token it adds.

All functions are pure: they take the tree's tokens and the base's distributions from one tree
forward and return the accepted root-to-node path. Row i of `target_logits` / `target_probs` is
the base's next-token distribution *after* node i, i.e. the distribution for node i's children.

- `verify_greedy`: exact, the output equals the base's greedy output token for token.
- `verify_sampling`: lossless speculative sampling over a tree (Leviathan et al. 2023; Chen et
  al. 2023; multi-candidate form of SpecInfer, Miao et al. 2024); the emitted tokens follow the
  (warped) base distribution exactly.
- `verify_typical`: Medusa's typical acceptance (Cai et al. 2024). LOSSY, opt-in only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference.tree import Tree


@dataclass
class Acceptance:
    """Outcome of verifying one tree (one sequence).

    `nodes` are the accepted node indices, root first (the root is always accepted: the base
    chose it last step). The step gains `len(nodes)` tokens: the accepted drafted nodes, then
    `bonus_token`, drawn from the base's distribution at the last accepted node.
    """

    nodes: torch.Tensor  # (A,) long
    bonus_token: int

    def new_tokens(self, tokens: torch.Tensor) -> list[int]:
        """Tokens this step emits: the accepted drafted tokens, then the bonus token."""
        return tokens[self.nodes[1:]].tolist() + [self.bonus_token]


def _path_to(tree: Tree, last: int) -> torch.Tensor:
    return tree.ancestors[last].nonzero().flatten()  # ancestors have smaller indices


def _longest_chain(ok: torch.Tensor, tree: Tree, score: torch.Tensor | None = None) -> int:
    """Deepest node whose whole root path passed `ok`; ties go to the highest `score`, then to
    the first in index order."""
    ok = ok.clone()
    ok[0] = True
    chain_ok = ~(tree.ancestors & ~ok).any(dim=1)  # (N,)
    deepest = torch.where(chain_ok, tree.depths, -1)
    best = chain_ok & (deepest == deepest.max())
    if score is None:
        return int(best.to(torch.long).argmax())  # argmax returns the first maximum
    return int(torch.where(best, score, -torch.inf).argmax())


def verify_greedy(tokens: torch.Tensor, target_logits: torch.Tensor, tree: Tree) -> Acceptance:
    """Greedy tree verification (Medusa, Cai et al. 2024; SpecInfer, Miao et al. 2024).

    Node i > 0 is correct iff `tokens[i] == argmax(target_logits[parents[i]])`; the longest
    root-to-node chain of correct nodes is accepted (the first in index order on ties, though
    with a greedy target two correct chains cannot share a depth unless the tree repeats a token
    under one parent). The bonus is the argmax after the last accepted node.
    tokens: (N,) long; target_logits: (N, V).
    """
    best = target_logits.argmax(dim=-1)  # (N,)
    ok = tokens == best[tree.parents.clamp(min=0)]
    last = _longest_chain(ok, tree)
    return Acceptance(_path_to(tree, last), int(best[last]))


def warp_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Sampling distribution (..., V) float32, warped the way HF `generate` samples.

    Temperature, then top-k (keep tokens whose logit reaches the k-th largest), then top-p
    (keep the smallest most-likely set whose mass reaches `top_p`; at least one token).
    `temperature == 0` gives the one-hot argmax (greedy). Lossless verification (Leviathan et
    al. 2023) preserves exactly this distribution.
    """
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(
            f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0: "
            f"got {temperature}, {top_p}, {top_k}"
        )
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # less the largest first: the same distribution, and a tiny temperature (1e-39) sends the
    # others to -inf rather than the largest to inf (NaN)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1:
        ascending, order = logits.sort(dim=-1)
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)  # mass of this token and all below
        drop = tail_mass <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return logits.softmax(dim=-1)


# A drafter that marks a token sampled must have drawn it from a q that gives it mass.
ZERO_Q = "a child marked sampled has q(token) == 0 in the draft_probs row it was drawn from"


def verify_sampling_batch(
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    tree: Tree,
    draft_probs: torch.Tensor | None,
    sampled: torch.Tensor,
    generator: torch.Generator | None = None,
    q_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless tree verification for B sequences sharing one tree shape; see `verify_sampling`.

    tokens: (B, N); target_probs: (B, N, V); draft_probs: (B, N, V), or (B, R, V) with `q_rows`
    (N,) naming each sampled node's row; sampled: (B, N) or (N,) bool.
    Returns the last accepted node (B,) and the bonus token (B,). No host sync except reading
    the tree's parents (and `q_rows`) and the final check that every sampled token had q > 0.
    `generator` must live on the inputs' device.
    """
    b, n = tokens.shape
    sampled = sampled.to(tokens.device).expand(b, n)
    if draft_probs is None and bool(sampled.any()):
        raise ValueError("sampled children need draft_probs (the q they were drawn from)")
    u = torch.rand(b, n, generator=generator, device=tokens.device)  # one draw per tried child
    cur = torch.zeros(b, dtype=torch.long, device=tokens.device)
    r = target_probs[:, 0].float()  # (B, V) residual at cur, unnormalised
    bad_q = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    parents = tree.parents.tolist()
    q_row = parents if q_rows is None else q_rows.tolist()
    # Children of a node are tried in index order, and a node's children come after it, so one
    # pass over c = 1..N-1 lets every sequence sitting at parents[c] try c, in the right order.
    for c, parent in enumerate(parents[1:], start=1):
        active = cur == parent  # (B,)
        x = tokens[:, c : c + 1]  # (B, 1)
        r = r / r.sum(dim=-1, keepdim=True)
        rx = r.gather(1, x).squeeze(1)
        # Point mass (top-k, static tree, n-gram): accept w.p. r(x), else drop x from r.
        accept_p = rx
        rejected = r.scatter(1, x, 0.0)
        if draft_probs is not None:
            # Sampled from q: accept w.p. min(1, r(x) / q(x)), else r <- max(0, r - q).
            q = draft_probs[:, q_row[c]].float()  # (B, V): the q that c was drawn from
            qx = q.gather(1, x).squeeze(1)
            s = sampled[:, c]
            bad_q |= active & s & (qx <= 0)
            accept_p = torch.where(s, (rx / qx).clamp(max=1.0), rx)
            rejected = torch.where(s[:, None], (r - q).clamp(min=0.0), rejected)
        # The residual only empties when the rejected child had acceptance probability 1 (r was a
        # point mass on x, or r == q), so this is rounding; any fallback is then harmless.
        empty = rejected.sum(dim=-1, keepdim=True) <= 0
        rejected = torch.where(empty, target_probs[:, parent].float(), rejected)
        accept = active & (u[:, c] < accept_p)
        r = torch.where(
            accept[:, None], target_probs[:, c].float(), torch.where(active[:, None], rejected, r)
        )
        cur = torch.where(accept, c, cur)
    if bool(bad_q.any()):
        raise ValueError(ZERO_Q)
    bonus = torch.multinomial(r, 1, generator=generator).squeeze(1)
    return cur, bonus


def verify_sampling(
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    tree: Tree,
    draft_probs: torch.Tensor | None,
    sampled: torch.Tensor,
    generator: torch.Generator | None = None,
    q_rows: torch.Tensor | None = None,
) -> Acceptance:
    """Lossless speculative sampling over a token tree (SpecInfer, Miao et al. 2024; Leviathan
    et al. 2023; Chen et al. 2023).

    Start at the root with residual r = p[root] (`target_probs`, already warped, see
    `warp_probs`). Try the current node's children in index order:

    - `sampled[c]` False: c's token x was chosen deterministically (top-k, static tree, n-gram).
      Accept with probability r(x) (r normalised); else r(x) <- 0 and renormalise.
    - `sampled[c]` True: x was drawn from q = `draft_probs[parent of c]` (or the row
      `q_rows[c]`). Accept with probability min(1, r(x) / q(x)); else r <- normalise(max(0,
      r - q)). Siblings drawn independently from different qs (a union of two sampling
      drafters) are exact too: after a rejection r is the law of the base's token given that
      rejection, whatever q the next sibling came from.

    On acceptance move to c with r = p[c]; when every child fails, or the node is a leaf, the
    bonus token is drawn from r. The point-mass rule is the q rule with q = one-hot(x); applying
    the q rule to tokens that were not sampled from q is NOT lossless. A residual that empties
    (only through rounding: it needs a rejection of probability 0) falls back to p at that node.
    tokens, sampled: (N,); target_probs: (N, V); draft_probs: (N, V), or (R, V) with `q_rows`.
    """
    last, bonus = verify_sampling_batch(
        tokens[None],
        target_probs[None],
        tree,
        None if draft_probs is None else draft_probs[None],
        sampled,
        generator,
        q_rows,
    )
    return Acceptance(_path_to(tree, int(last[0])), int(bonus[0]))


def _children(tree: Tree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for c, parent in enumerate(tree.parents.tolist()[1:], start=1):
        kids[parent].append(c)
    return kids


def verify_greedy_walk(
    tokens: torch.Tensor, tree: Tree, row: Callable[[int], torch.Tensor]
) -> Acceptance:
    """`verify_greedy` reading only the rows it visits: `row(i)` -> the (V,) logits after node i.

    Walks from the root to the child holding the target's argmax, so it evaluates
    (accepted nodes) rows instead of N, one call each. That pays where tau one-row calls cost
    less than one N-row call: on a CPU, trees over `DENSE_LOGITS_MAX_NODES` nodes
    (inference/generate.py). With distinct sibling tokens (every drafter here) it accepts
    exactly what `verify_greedy` accepts.
    """
    kids, toks = _children(tree), tokens.tolist()
    path, cur = [0], 0
    while True:
        best = int(row(cur).argmax())
        nxt = next((c for c in kids[cur] if toks[c] == best), None)
        if nxt is None:
            return Acceptance(torch.tensor(path, device=tokens.device), best)
        path.append(nxt)
        cur = nxt


def verify_sampling_walk(
    tokens: torch.Tensor,
    tree: Tree,
    row: Callable[[int], torch.Tensor],
    draft_probs: torch.Tensor | None,
    sampled: torch.Tensor,
    generator: torch.Generator | None = None,
    q_rows: torch.Tensor | None = None,
) -> Acceptance:
    """`verify_sampling` reading only the visited rows: `row(i)` -> the (V,) warped target
    probabilities after node i. Same rule, same random draws (so the same outcome for the same
    generator state) as `verify_sampling`; evaluates (accepted nodes) rows instead of N."""
    n = tokens.numel()
    if draft_probs is None and bool(sampled.any()):
        raise ValueError("sampled children need draft_probs (the q they were drawn from)")
    u = torch.rand(1, n, generator=generator, device=tokens.device)[0]
    kids, toks, is_sampled = _children(tree), tokens.tolist(), sampled.tolist()
    q_row = tree.parents.tolist() if q_rows is None else q_rows.tolist()
    path, cur = [0], 0
    r = row(0).float()
    while True:
        for c in kids[cur]:
            r = r / r.sum()
            x = toks[c]
            if is_sampled[c]:
                q = draft_probs[q_row[c]].float()
                if float(q[x]) <= 0:
                    raise ValueError(ZERO_Q)
                accept_p, rejected = (r[x] / q[x]).clamp(max=1.0), (r - q).clamp(min=0.0)
            else:
                accept_p, rejected = r[x], r.clone()
                rejected[x] = 0.0
            if float(u[c]) < float(accept_p):
                path.append(c)
                cur = c
                r = row(c).float()
                break
            # Empty only through rounding (the rejected child had acceptance probability 1).
            r = rejected if float(rejected.sum()) > 0 else row(cur).float()
        else:
            bonus = torch.multinomial(r[None], 1, generator=generator)
            return Acceptance(torch.tensor(path, device=tokens.device), int(bonus))


def verify_typical(
    tokens: torch.Tensor,
    target_logits: torch.Tensor,
    tree: Tree,
    temperature: float,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance (Cai et al. 2024, sec. 2.3.1). LOSSY: opt-in only.

    This does NOT preserve the base's sampling distribution: it accepts any candidate the base
    finds "typical enough", p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))) with
    p = softmax(logits / temperature). The longest chain of such nodes is accepted (among equal
    lengths the most likely path, as Medusa does); the bonus is sampled from p at the last node.
    `temperature == 0` is plain greedy verification.
    """
    if temperature == 0:
        return verify_greedy(tokens, target_logits, tree)
    p = warp_probs(target_logits, temperature)  # (N, V)
    entropy = torch.special.entr(p).sum(dim=-1)  # (N,)
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    parents = tree.parents.clamp(min=0)
    px = p[parents, tokens]  # (N,) prob of each node's token under its parent's p
    ok = px > threshold[parents]
    log_px = torch.where(tree.parents >= 0, px.clamp(min=1e-30).log(), 0.0)
    path_logp = tree.ancestors.float() @ log_px  # (N,)
    last = _longest_chain(ok, tree, score=path_logp)
    bonus = torch.multinomial(p[last], 1, generator=generator)
    return Acceptance(_path_to(tree, last), int(bonus))
