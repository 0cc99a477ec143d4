"""Several drafters in one verify step: the union of their trees.

Each drafter proposes its own tree from the same root; the trees are merged into one trie (a
token proposed by two drafters at the same place is one node) and verified in one forward. A
path is accepted wherever any drafter was right, so on a CPU, where a few more tree nodes cost
little, the trained heads and n-gram prompt lookup add up: the heads guess new text, the lookup
copies text the prompt or the answer already holds (extraction, code edits, long lists).

Lossless at every temperature: point-mass nodes (top-k, static trees, n-gram) are merged freely;
sampled nodes (a draft model's chain at temperature > 0) are never merged with another node, and
each keeps the q it was drawn from (`Draft.q_rows`: two draft models' first tokens hang under one
root, drawn from two qs). The verifier's per-child rule (inference/acceptance.py) is exact for
any mix of such children.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from inference.draft import Draft, Drafter, Sampling
from inference.tree import tree_from_parents


class UnionDrafter(Drafter):
    """Proposes the union of its drafters' trees.

    Args:
        drafters: two or more drafters; those that read the base's aux layers (EAGLE-3) must
            read the same ones (the base's forward gives one set of them).
            The first is the primary: `default_arms` adapts its settings and keeps the others
            as configured.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.drafters = list(drafters)
        if len(self.drafters) < 2:
            raise ValueError("a UnionDrafter needs at least two drafters")
        aux = sorted({tuple(d.aux_layer_ids) for d in self.drafters if d.aux_layer_ids})
        if len(aux) > 1:
            raise ValueError(
                f"the drafters of a union read different aux layers of the base ({aux}): "
                "EAGLE-3 drafts in one union must be trained on the same aux_layer_ids"
            )
        self.aux_layer_ids = aux[0] if aux else ()
        self.enabled = [True] * len(self.drafters)
        self.switched_on = [False] * len(self.drafters)  # by configure, since the last catch-up

    @property
    def max_nodes(self) -> int:
        """The root plus every enabled drafter's candidates (before merging shared ones)."""
        return 1 + sum(d.max_nodes - 1 for d, on in zip(self.drafters, self.enabled) if on)

    @property
    def max_positions(self) -> int | None:
        """The longest context of the enabled drafters, None where one has no limit: a member
        past its own context (a draft model's learned positions) sits out the steps there, the
        others draft on."""
        limits = [d.max_positions for d, on in zip(self.drafters, self.enabled) if on]
        return None if None in limits else max(limits, default=None)

    def _drafting(self, sequence: torch.Tensor) -> list[Drafter]:
        """The enabled drafters whose trees after `sequence` fit their own context."""
        return [d for d, on in zip(self.drafters, self.enabled) if on and d.fits(sequence.numel())]

    def _check_parts(self, parts: Sequence[dict | None]) -> None:
        if len(parts) != len(self.drafters):
            raise ValueError(f"parts has {len(parts)} entries for {len(self.drafters)} drafters")
        if all(p is None for p in parts):
            raise ValueError("a union needs at least one drafter enabled (None for all is plain)")

    def configure(self, parts: Sequence[dict | None]) -> None:
        """`parts[i]`: options for drafter i (`{}` keeps its settings), or None to leave it out."""
        self._check_parts(parts)
        for drafter, options in zip(self.drafters, parts):
            if options:
                drafter.configure(**options)
        enabled = [p is not None for p in parts]
        self.switched_on = [
            now and (before or not was)
            for now, was, before in zip(enabled, self.enabled, self.switched_on)
        ]
        self.enabled = enabled

    def check_options(self, parts: Sequence[dict | None]) -> None:
        self._check_parts(parts)
        for drafter, options in zip(self.drafters, parts):  # each its own way (a union nested)
            if options:
                drafter.check_options(**options)

    def default_arms(self, device: torch.device) -> list[dict | None]:
        """Plain decoding; each of the primary's settings with the others added; the others
        without the primary."""
        rest = [{}] * (len(self.drafters) - 1)
        arms: list[dict | None] = [None]
        for options in self.drafters[0].default_arms(device):
            if options is not None:
                arms.append({"parts": [options, *rest]})
        arms.append({"parts": [None, *rest]})
        return arms

    def reset(self) -> None:
        for drafter in self.drafters:
            drafter.reset()

    def observe(self, tokens, hidden, aux, next_token) -> None:
        for drafter in self.drafters:
            drafter.observe(tokens, hidden, aux, next_token)

    def catch_up(self, sequence: torch.Tensor) -> None:
        for drafter in self._drafting(sequence):
            drafter.catch_up(sequence)
        self.switched_on = [False] * len(self.drafters)

    def catch_up_switched_on(self, sequence: torch.Tensor) -> None:
        drafting = self._drafting(sequence)
        for drafter, switched in zip(self.drafters, self.switched_on):
            if switched and drafter in drafting:
                drafter.catch_up(sequence)
        self.switched_on = [False] * len(self.drafters)

    def propose(self, sequence: torch.Tensor, sampling: Sampling) -> Draft:
        drafts = [d.propose(sequence, sampling) for d in self._drafting(sequence)]
        if not drafts:  # the generator takes plain steps before: `max_positions`
            raise ValueError(
                f"no drafter of the union fits its context after {sequence.numel()} tokens"
            )
        if len(drafts) == 1:
            # Without its ranks: another arm of this union may enable another drafter, whose
            # paths of ranks hold other tokens (the adaptive policy shares rates by path).
            return dataclasses.replace(
                drafts[0], tree=dataclasses.replace(drafts[0].tree, ranks=None), root_ranking=None
            )
        return merge_drafts(drafts)


def merge_drafts(drafts: Sequence[Draft]) -> Draft:
    """One trie holding every draft's paths; all drafts share the root.

    Point-mass nodes with the same parent and token become one node. Sampled nodes keep their
    own node and the q they were drawn from: the merged `draft_probs` stacks the sampling
    drafts' tables, and `q_rows` gives each sampled node its row there. Sampling drafts go
    first, so their children are tried before the point masses under a shared parent.
    """
    drafts = sorted(drafts, key=lambda d: not bool(d.sampled.any()))  # stable: sampling first
    root = int(drafts[0].tokens[0])
    if any(int(d.tokens[0]) != root for d in drafts):
        raise ValueError("the drafts of a union must share the root token")
    tokens, parents, sampled, q_rows = [root], [-1], [False], [0]
    tables: list[torch.Tensor] = []  # the sampling drafts' draft_probs, stacked in this order
    offset = 0  # rows of the tables before this draft's
    point_mass_child: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for draft in drafts:
        merged = [0] * draft.tokens.numel()  # the draft's node -> merged node
        draft_parents, draft_tokens = draft.tree.parents.tolist(), draft.tokens.tolist()
        draft_sampled = draft.sampled.tolist()
        # the row each sampled node was drawn from in this draft's table (a union's own merge
        # names it; a drafter's draft: its parent's)
        own_rows = draft_parents if draft.q_rows is None else draft.q_rows.tolist()
        for i in range(1, len(draft_tokens)):
            parent, token = merged[draft_parents[i]], draft_tokens[i]
            key = (parent, token)
            if not draft_sampled[i] and key in point_mass_child:
                merged[i] = point_mass_child[key]
                continue
            merged[i] = len(tokens)
            if not draft_sampled[i]:
                point_mass_child[key] = merged[i]
            tokens.append(token)
            parents.append(parent)
            sampled.append(draft_sampled[i])
            q_rows.append(offset + own_rows[i] if draft_sampled[i] else 0)
        if any(draft_sampled):
            if draft.draft_probs is None:
                raise ValueError("a draft with sampled nodes needs draft_probs (their q)")
            tables.append(draft.draft_probs)
            offset += draft.draft_probs.shape[0]
    device = drafts[0].tokens.device
    return Draft(
        tree_from_parents(parents, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
        torch.tensor(sampled, dtype=torch.bool, device=device),
        torch.cat(tables) if tables else None,
        q_rows=torch.tensor(q_rows, dtype=torch.long, device=device) if tables else None,
    )
