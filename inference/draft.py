"""The drafter interface: every drafter proposes a token tree for one verify step.

A `Draft` is a tree (node 0 = the root, the token the base chose last step) with a token per
node and, per child, how it was chosen: deterministically (top-k, a static tree, n-gram; a
point mass) or sampled from the drafter's distribution q at its parent (`draft_probs`; a union's
merged draft names each sampled node's row, `q_rows`). One verifier serves every drafter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from inference.tree import Tree


@dataclass
class Draft:
    """A proposed token tree.

    tokens: (N,) base token ids, tokens[0] = the root.
    sampled: (N,) bool, True where the node's token was drawn from q = draft_probs[parent]
        (or the row `q_rows` names).
    draft_probs: (N, V) the drafter's distribution after each node (with `q_rows`: (R, V), the
        tables of a union's sampling drafters stacked), or None when every node is a point
        mass.
    q_rows: (N,) long, for each sampled node the row of draft_probs (R, V) its token was drawn
        from, where that is not its parent's row: a union of drafters that each sample (two
        draft models' chains), whose first tokens hang under one root but come from two qs.
        None (every single drafter's draft): the parent's row.
    root_ranking: (k,) a dynamic tree's drafter's top tokens at the root, best first, whether or
        not the tree holds them (None for other drafts). Under greedy verification the base's
        token at the root says which of them would have been accepted: the adaptive policy's
        rates of the paths `(0,)` ... `(k-1,)`, which a one-level static tree of them is made of.
    """

    tree: Tree
    tokens: torch.Tensor
    sampled: torch.Tensor
    draft_probs: torch.Tensor | None = None
    root_ranking: torch.Tensor | None = None
    q_rows: torch.Tensor | None = None

    @classmethod
    def chain(cls, root: int, continuation: list[int], device) -> Draft:
        """A point-mass chain root -> continuation[0] -> ... (the n-gram drafter)."""
        from inference.tree import tree_from_parents

        n = 1 + len(continuation)
        tree = tree_from_parents([-1, *range(n - 1)], device=device)
        tokens = torch.tensor([root, *continuation], dtype=torch.long, device=device)
        return cls(tree, tokens, torch.zeros(n, dtype=torch.bool, device=device))


@dataclass
class Sampling:
    """How the target distribution is warped; drafters that sample use the same warping."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Drafter:
    """Base class of drafters. The generator calls, per sequence:

    1. `reset()`, then `observe(...)` with the prompt after the prefill forward;
    2. per step: `propose(sequence, sampling)` -> Draft, the base verifies it, then `observe(...)`
       with the accepted tokens (root first) and the base's states at them.

    `aux_layer_ids` names the base layers whose *entering* hidden states the drafter needs
    (EAGLE-3); the generator asks the base for them only then.
    """

    aux_layer_ids: tuple[int, ...] = ()
    max_nodes: int = 1  # the largest tree this drafter proposes (sizing the verify forward)
    # The longest sequence it drafts for (a draft model's own context); None: any. Past it the
    # generator takes plain steps, as near the base's context (a union drafts on without it).
    max_positions: int | None = None

    def fits(self, length: int) -> bool:
        """Whether its largest tree after `length` tokens (the sequence, root included) stays
        within its own context: past it the generator takes plain steps, a union goes on
        without it."""
        return self.max_positions is None or length + self.max_nodes <= self.max_positions

    def reset(self) -> None:
        """Forget the previous sequence."""

    def observe(
        self, tokens: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor | None, next_token: int
    ) -> None:
        """The base accepted `tokens` (A,) at the next A positions; `hidden` (A,H) is its last
        hidden state there, `aux` (A, 3H) the concatenated aux layers (or None); `next_token`
        is the root of the next tree (its bonus token)."""

    def propose(self, sequence: torch.Tensor, sampling: Sampling) -> Draft:
        """Propose a tree rooted at `sequence[-1]` (sequence: (T,), prompt + generated)."""
        raise NotImplementedError

    def catch_up(self, sequence: torch.Tensor) -> None:
        """Bring a drafter that keeps its own cache up to `sequence` before `propose` (which
        would do it too). The generator calls it, outside the adaptive policy's timing, for the
        first speculative step after plain ones, whose catch-up grows with the plain steps."""

    def catch_up_switched_on(self, sequence: torch.Tensor) -> None:
        """After `configure` switched on a part that sat out the steps before (a union's
        member), bring that part up to `sequence`, outside the adaptive policy's timing, as
        `catch_up` does after plain steps. Nothing for a drafter without parts."""

    def configure(self, **options) -> None:
        """Change the tree shape between steps (the adaptive policy's arms)."""
        raise NotImplementedError(f"{type(self).__name__} has no tree settings to adapt")

    def check_options(self, **options) -> None:
        """Raise as `configure(**options)` would, leaving this drafter's settings as they are
        (on a shallow copy: `configure` only sets attributes)."""
        copy.copy(self).configure(**options)

    def default_arms(self, device: torch.device) -> list[dict | None]:
        """Settings worth trying on `device`; None is plain decoding. Small trees on a CPU,
        where a forward's cost grows with its tokens; larger ones on a GPU, where it hardly does.
        `{}` is the drafter as it is configured."""
        return [None, {}]
