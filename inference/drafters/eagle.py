"""EAGLE drafter: a dynamic draft tree grown by the EAGLE draft layer (EAGLE-2, Li et al. 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", arXiv:2406.16858).

Expansion: from the root, take the draft's top_k tokens; then `depth - 1` times run the draft
layer on the current frontier (top_k nodes by cumulative log-probability) in one forward with a
tree mask and give each frontier node its top_k children. Reranking: keep the `total_tokens - 1`
candidates with the highest cumulative log-probability (a child never scores above its parent,
so the kept set contains its ancestors). Every node is a point mass (top-k), which the lossless
verifier handles with the point-mass rule. A static tree (`choices`, Medusa-style paths of ranks,
as EAGLE-1 drafted) instead gives node `c` the rank-`c[-1]` token of the draft's forward at its
parent: one draft forward per level over the nodes that have children.

The draft layer keeps its own KV cache over the accepted sequence: after each verify step the
tree entries are cropped and the accepted tokens are fed with the base's true features (EAGLE-1:
the last hidden state; EAGLE-3: the fused aux layers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from heads.base import output_logits
from heads.eagle import EagleDraft
from inference.draft import Draft, Drafter, Sampling
from inference.mask import frontier_attention_mask, grouped_kv_attention
from inference.tree import StaticTree, check_ranks, tree_from_parents


class EagleDrafter(Drafter):
    """EAGLE-1 / EAGLE-3 drafter with an EAGLE-2 dynamic tree.

    Args:
        draft: the draft layer.
        base: the base model (its input embeddings; EAGLE-1 also uses its lm_head).
        top_k: children per expanded node and frontier width (default 4, or the draft
            vocabulary when it has fewer tokens).
        depth: draft steps (tree depth below the root).
        total_tokens: tree size including the root. top_k=1 gives a chain of `depth` tokens.
        choices: a static tree instead (paths of ranks such as `[(0,), (1,), (0, 0)]`, or a
            preset name of `inference.tree.PRESETS`); top_k, depth and total_tokens then unused.
    """

    def __init__(
        self,
        draft: EagleDraft,
        base: nn.Module,
        top_k: int | None = None,
        depth: int | None = None,
        total_tokens: int | None = None,
        choices=None,
    ) -> None:
        self.draft = draft
        self.embed = base.get_input_embeddings()
        # EAGLE-1 ranks on the base's logits of its output, as its forward computes them (scaled
        # for Granite, Cohere, Gemma-2) and as training reads them
        self.logits_base = base if draft.config.version == 1 else None
        self.aux_layer_ids = tuple(draft.config.aux_layer_ids) if draft.config.version == 3 else ()
        if choices is None:  # the dynamic tree's defaults
            top_k = min(4, self._vocab()) if top_k is None else top_k
            depth = 4 if depth is None else depth
            total_tokens = 12 if total_tokens is None else total_tokens
        self.configure(top_k, depth, total_tokens, choices)
        self.reset()

    def configure(
        self,
        top_k: int | None = None,
        depth: int | None = None,
        total_tokens: int | None = None,
        choices: str | Sequence[Sequence[int]] | None = None,
    ) -> None:
        """A dynamic tree (all of top_k, depth, total_tokens) or a static one (choices alone)."""
        given = [x is not None for x in (top_k, depth, total_tokens)]
        if any(given) if choices is not None else not all(given):
            raise ValueError(
                "give EAGLE either top_k, depth and total_tokens (a dynamic tree) or choices "
                f"alone (a static tree); got top_k={top_k}, depth={depth}, "
                f"total_tokens={total_tokens}, choices={choices!r}"
            )
        self.static = None
        if choices is not None:  # a static tree
            self.static = StaticTree.build(choices, device=self.draft.fc.weight.device)
            check_ranks(self.static.tree, self._vocab(), "this EAGLE draft")
            self.top_k, self.depth = None, self.static.tree.depth
            self.max_nodes = self.total_tokens = self.static.tree.num_nodes
            return
        if top_k < 1 or depth < 0 or total_tokens < 1:
            raise ValueError(
                f"need top_k >= 1, depth >= 0, total_tokens >= 1; got top_k={top_k}, "
                f"depth={depth}, total_tokens={total_tokens}"
            )
        if top_k > self._vocab():
            raise ValueError(
                f"top_k={top_k}, but the vocabulary of this EAGLE draft has {self._vocab()} tokens"
            )
        self.top_k, self.depth = top_k, depth
        most = 1 + (top_k + top_k * top_k * (depth - 1) if depth else 0)  # root + every candidate
        self.total_tokens = min(total_tokens, most)
        self.max_nodes = self.total_tokens

    def _vocab(self) -> int:
        """The tokens the draft ranks: EAGLE-3's draft vocabulary, EAGLE-1's the base's."""
        config = self.draft.config
        return config.draft_vocab_size if config.version == 3 else config.vocab_size

    def default_arms(self, device: torch.device) -> list[dict | None]:
        vocab = self._vocab()
        if device.type == "cpu":
            # On 2 CPU cores a base forward over 3-6 tokens cost 1.1-1.2x a 1-token one, and
            # each level of depth is one more forward of the draft layer (~3-4 ms beside a ~60 ms
            # base step for SmolLM2-135M): the draft's top 4 at one or two levels. Deeper trees
            # were never the best here and cost the policy its re-tries of them (docs/bench.md,
            # "CPU arms without the settings that never paid"); a draft whose deeper steps are
            # right can be given them with `adaptive=[...]`. The one-level tree is static (the
            # same four nodes as top_k 4 at depth 1): the policy then measures it on every step
            # of the two-level one, from that tree's root ranking.
            # (A draft vocabulary under 4 tokens ranks fewer.)
            return [
                None,
                {"choices": [[i] for i in range(min(4, vocab))]},
                {"top_k": min(4, vocab), "depth": 2, "total_tokens": 6},
            ]
        return [
            None,
            {"top_k": min(4, vocab), "depth": 5, "total_tokens": 24},
            {"top_k": min(8, vocab), "depth": 6, "total_tokens": 60},
        ]

    def reset(self) -> None:
        self.cache = self.draft.new_cache()
        self._root_hidden: torch.Tensor | None = None  # (H,) draft output at the root's pair
        self._pending: list[tuple] = []  # accepted (tokens, features, next token) not yet fed

    def observe(self, tokens, hidden, aux, next_token) -> None:
        # Fed lazily at the next propose: steps of plain decoding (the adaptive policy) then
        # cost no draft forward, and their tokens go in one batched forward later.
        self._pending.append(
            (tokens, aux if self.draft.config.version == 3 else hidden, next_token)
        )

    def catch_up(self, sequence: torch.Tensor) -> None:
        if self._pending:
            self._feed_pending()

    @torch.no_grad()
    def _feed_pending(self) -> None:
        """Pair at position t: (embed(x_{t+1}), feature_t). The accepted tokens' successors are
        tokens[1:] and then the next root."""
        tokens = torch.cat([p[0] for p in self._pending])
        feats = torch.cat([p[1] for p in self._pending])  # (A,H) or (A,3H)
        successors = []
        for tok, _, nxt in self._pending:
            successors += tok[1:].tolist() + [nxt]
        self._pending.clear()
        dev = tokens.device
        start = self.cache.get_seq_length()
        feat = self.draft.fuse(feats) if self.draft.config.version == 3 else feats
        pos = torch.arange(start, start + tokens.numel(), device=dev)[None]
        nxt = torch.tensor(successors, device=dev)
        out = self.draft(self.embed(nxt)[None], feat[None], pos, cache=self.cache)
        self._root_hidden = out[0, -1]

    @property
    def _dtype(self) -> torch.dtype:
        return self.draft.fc.weight.dtype

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_base is None:
            logits = self.draft.compute_logits(hidden)
        else:  # on the draft's device, where a dispatched base keeps its lm_head on another one
            logits = output_logits(self.logits_base, hidden).to(hidden.device)
        return logits.float().log_softmax(-1)

    @torch.no_grad()
    def propose(self, sequence: torch.Tensor, sampling: Sampling) -> Draft:
        dev = sequence.device
        root = sequence[-1:]
        if self._pending:
            self._feed_pending()
        if self.depth == 0 or self.total_tokens == 1:
            return Draft(
                tree_from_parents([-1], device=dev),
                root,
                torch.zeros(1, dtype=torch.bool, device=dev),
            )
        if self.static is not None:
            return self._propose_static(root)
        k = self.top_k
        # Candidate nodes, in creation order (parents before children): token, parent, score.
        lp, ids = self._log_probs(self._root_hidden[None]).topk(k, dim=-1)  # (1,k)
        tokens = [self.draft.to_base_ids(ids[0])]
        parents = [torch.zeros(k, dtype=torch.long, device=dev)]  # candidate index + 1 (0 = root)
        scores = [lp[0]]
        frontier = torch.arange(k, device=dev)  # candidate indices to expand next
        frontier_hidden = self._root_hidden.expand(k, -1)  # draft output of each one's parent
        cached = []  # candidate index of every tree entry appended to the draft cache
        for d in range(1, self.depth):
            all_tokens = torch.cat(tokens)
            all_parents = torch.cat(parents)
            out = self._forward_frontier(
                d, frontier, all_tokens, all_parents, frontier_hidden, cached
            )  # (F,H)
            lp, ids = self._log_probs(out).topk(k, dim=-1)  # (F,k)
            child_scores = (torch.cat(scores)[frontier][:, None] + lp).flatten()  # (F*k,)
            first = all_tokens.numel()
            tokens.append(self.draft.to_base_ids(ids.flatten()))
            parents.append((frontier + 1).repeat_interleave(k))
            scores.append(child_scores)
            if d + 1 < self.depth:
                best = child_scores.topk(min(k, child_scores.numel())).indices
                frontier = first + best
                frontier_hidden = out[best // k]
        if cached:
            self.cache.crop(-len(cached))
        draft = self._rerank(root, torch.cat(tokens), torch.cat(parents), torch.cat(scores))
        return dataclasses.replace(draft, root_ranking=tokens[0])  # the root's top k, best first

    def _forward_frontier(
        self, d, frontier, all_tokens, all_parents, frontier_hidden, cached
    ) -> torch.Tensor:
        """The draft's forward over the frontier (candidate indices at depth `d`), each paired
        with its parent's draft output, attending to the accepted sequence and its ancestors
        already in the draft cache; appends the frontier to `cached`. Returns (F,H).

        `all_parents` holds each candidate's parent as candidate index + 1 (0 = the root)."""
        prefix = self.cache.get_seq_length() - len(cached)  # pairs of the accepted sequence
        F, dev = frontier.numel(), frontier.device
        column_of = {c: i for i, c in enumerate(cached)}
        parents = all_parents.tolist()  # one read from the device, not one per ancestor
        allowed = torch.zeros(F, len(cached) + F, dtype=torch.bool, device="cpu")  # (F, C)
        for row, c in enumerate(frontier.tolist()):
            allowed[row, len(cached) + row] = True
            p = parents[c] - 1
            while p >= 0:
                allowed[row, column_of[p]] = True
                p = parents[p] - 1
        mask = frontier_attention_mask(allowed.to(dev), prefix, self._dtype)
        pos = torch.full((1, F), prefix - 1 + d, device=dev)
        with grouped_kv_attention(dev):
            out = self.draft(
                self.embed(all_tokens[frontier])[None],
                frontier_hidden[None],
                pos,
                attention_mask=mask,
                cache=self.cache,
            )[0]
        cached.extend(frontier.tolist())
        return out

    def _propose_static(self, root: torch.Tensor) -> Draft:
        """Fill the static tree level by level: node c takes the rank-c[-1] token of the draft's
        forward at its parent (the root's is the last fed pair). Candidate i is tree node i + 1."""
        tree, levels, top = self.static.tree, self.static.levels, self.static.top
        parents, ranks = tree.parents[1:], tree.ranks[1:]
        tokens = torch.empty_like(parents)
        level = levels[0][0] - 1
        ids = self._log_probs(self._root_hidden[None]).topk(top, dim=-1).indices  # (1,top)
        tokens[level] = self.draft.to_base_ids(ids[0, ranks[level]])
        frontier_hidden = self._root_hidden[None]
        row_of = torch.zeros(parents.numel() + 1, dtype=torch.long, device=parents.device)
        cached: list[int] = []
        for d in range(1, self.depth):
            frontier = levels[d - 1][1] - 1
            out = self._forward_frontier(
                d, frontier, tokens, parents, frontier_hidden[row_of[parents[frontier]]], cached
            )  # (F,H)
            row_of[frontier + 1] = torch.arange(frontier.numel(), device=frontier.device)
            ids = self._log_probs(out).topk(top, dim=-1).indices  # (F,top)
            level = levels[d][0] - 1
            tokens[level] = self.draft.to_base_ids(ids[row_of[parents[level]], ranks[level]])
            frontier_hidden = out
        if cached:
            self.cache.crop(-len(cached))
        all_tokens = torch.cat([root, tokens])
        return Draft(tree, all_tokens, torch.zeros_like(all_tokens, dtype=torch.bool))

    def _rerank(self, root, tokens, parents, scores) -> Draft:
        """Keep the best `total_tokens - 1` candidates, in creation order (parents first)."""
        keep = min(self.total_tokens - 1, scores.numel())
        # Stable sort: on equal scores a parent (created first) wins over its child.
        order = torch.sort(-scores, stable=True).indices[:keep]
        chosen = torch.sort(order).values  # creation order keeps parents before children
        new_index = torch.full((scores.numel() + 1,), -1, dtype=torch.long, device=scores.device)
        new_index[0] = 0
        new_index[chosen + 1] = torch.arange(1, keep + 1, device=scores.device)
        tree_parents = new_index[parents[chosen]]
        if bool((tree_parents < 0).any()):  # ties broke ancestor closure; cannot happen otherwise
            raise RuntimeError("draft tree lost an ancestor while reranking")
        tree = tree_from_parents(
            torch.cat([tree_parents.new_tensor([-1]), tree_parents]), device=root.device
        )
        all_tokens = torch.cat([root, tokens[chosen]])
        return Draft(tree, all_tokens, torch.zeros_like(all_tokens, dtype=torch.bool))
