"""Medusa drafter: the heads' top-k tokens placed on a static tree (Cai et al. 2024).

Head k (0-based) reads the base's last hidden state at the last accepted position and predicts
the token k+2 places ahead, i.e. the token at depth k+1 below the root. A node of the static
tree at depth d with rank r takes head d-1's rank-r token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from heads.medusa import MedusaHeads
from inference.draft import Draft, Drafter, Sampling
from inference.tree import (
    DEFAULT_ACCURACIES,
    build_static_tree,
    chain_choices,
    check_ranks,
    checked_choices,
    get_preset,
    static_tree_capacity,
    tree_from_choices,
)


class MedusaDrafter(Drafter):
    """Static-tree drafter over Medusa heads; every node is a point mass (top-k)."""

    def __init__(
        self, heads: MedusaHeads, choices: str | Sequence[Sequence[int]] | None = None
    ) -> None:
        self.heads = heads
        # Default: an 8-node tree for these heads (Medusa's greedy construction, assumed accuracies).
        K = heads.config.num_heads
        self.set_tree(
            choices
            if choices is not None
            else self._fitting(build_static_tree(DEFAULT_ACCURACIES[:K], 8))
        )
        self._hidden: torch.Tensor | None = None

    def set_tree(self, choices: str | Sequence[Sequence[int]]) -> None:
        """Use a preset name (see `inference.tree.PRESETS`) or explicit Medusa choices."""
        K = self.heads.config.num_heads
        choices = get_preset(choices, K) if isinstance(choices, str) else checked_choices(choices)
        too_deep = max((len(c) for c in choices), default=0)
        if too_deep > K:
            raise ValueError(f"tree depth {too_deep} needs {too_deep} heads, these have {K}")
        device = next(self.heads.parameters()).device
        self.tree = tree_from_choices(choices, device=device)
        check_ranks(self.tree, self.heads.config.draft_vocab_size, "these Medusa heads")
        self.max_nodes = self.tree.num_nodes
        depths, ranks = self.tree.depths[1:], self.tree.ranks[1:]
        self._heads_used = int(depths.max()) if depths.numel() else 0
        self._top = int(ranks.max()) + 1 if ranks.numel() else 0
        self._head_of, self._rank_of = depths - 1, ranks

    def configure(self, choices: str | Sequence[Sequence[int]]) -> None:
        self.set_tree(choices)

    def _fitting(self, choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The default trees' paths whose ranks the heads' vocabulary has (a truncated
        vocabulary under the trees' top ranks keeps fewer; a path's descendants go with it)."""
        vocab = self.heads.config.draft_vocab_size
        return [tuple(c) for c in choices if max(c) < vocab]

    def default_arms(self, device: torch.device) -> list[dict | None]:
        K = self.heads.config.num_heads
        if device.type == "cpu":
            # On 2 CPU cores a base forward over 6 nodes cost ~1.1-1.2x a 1-token one, over 8
            # ~1.2-1.4x: head 0's top 4 and head 1's top 1, alone. The chain and the 8-node tree
            # were never the best here, and re-trying them cost the policy (docs/bench.md, "...
            # the settings that never paid" and "A third level for the full recipe's draft").
            tree = [(rank,) for rank in range(4)] + [(0, 0)][: K - 1]
            return [None, {"choices": self._fitting(tree)}]
        accuracies = DEFAULT_ACCURACIES[:K]
        # one head holds at most 11 nodes (its top 10 and the root)
        sizes = sorted({min(n, static_tree_capacity(accuracies)) for n in (32, 64)})
        trees = [chain_choices(K)] + [build_static_tree(accuracies, n) for n in sizes]
        fitting = [self._fitting(t) for t in trees]
        return [None] + [{"choices": t} for i, t in enumerate(fitting) if t not in fitting[:i]]

    def reset(self) -> None:
        self._hidden = None

    def observe(self, tokens, hidden, aux, next_token) -> None:
        self._hidden = hidden[-1]  # (H,) state whose lm_head gave next_token

    @torch.no_grad()
    def propose(self, sequence: torch.Tensor, sampling: Sampling) -> Draft:
        root = sequence[-1:]
        if self._heads_used == 0:
            return Draft(self.tree, root, torch.zeros(1, dtype=torch.bool, device=root.device))
        h = self._hidden[None, None]  # (1,1,H)
        logits = torch.stack(
            [self.heads.head_logits(k, h)[0, 0].float() for k in range(self._heads_used)]
        )
        top = logits.topk(self._top, dim=-1).indices  # (K_used, top)
        drafted = self.heads.to_base_ids(top[self._head_of, self._rank_of])  # (N-1,)
        tokens = torch.cat([root, drafted])
        return Draft(self.tree, tokens, torch.zeros_like(tokens, dtype=torch.bool))
