"""Token trees for tree-attention verification, and static Medusa trees.

A tree has N nodes in topological order (`parents[i] < i`). Node 0 is the root: the token the
base chose at the previous step, not yet in the KV cache. Every other node is a drafted
candidate continuing its parent (SpecInfer, Miao et al. 2024; Medusa, Cai et al. 2024).

Static trees are written in the Medusa "choices" format that vLLM and TensorRT-LLM also read:
each choice is a path of top-k ranks, `(0, 1)` being "head 0's top-1 token, then head 1's
top-2 token". `build_static_tree` chooses such a tree greedily from per-head accuracies
(Cai et al. 2024, sec. 2.1.2 / appendix).
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Choice = tuple[int, ...]


@dataclass(frozen=True, eq=False)  # tensors have no single truth value to compare by
class Tree:
    """A token tree in topological order (SpecInfer, Miao et al. 2024).

    `paths` lists every root-to-leaf path (one per leaf, leaves in index order), padded with -1
    to `depth + 1` columns. `ranks` is set for static trees only (`tree_from_choices`): the
    top-k rank of each node's token at its parent (-1 for the root).
    """

    parents: torch.Tensor  # (N,) long, parents[0] == -1
    depths: torch.Tensor  # (N,) long, depths[0] == 0
    ancestors: torch.Tensor  # (N, N) bool, [i, j] iff j == i or j is an ancestor of i
    paths: torch.Tensor  # (P, D+1) long, padded with -1
    ranks: torch.Tensor | None = None  # (N,) long, root -1

    @property
    def num_nodes(self) -> int:
        """N, the root included."""
        return int(self.parents.shape[0])

    @property
    def depth(self) -> int:
        """D, the largest node depth (0 for a root-only tree)."""
        return int(self.depths.max())

    def children(self, i: int) -> list[int]:
        """Children of node `i`, in index order (the order verification tries them)."""
        return [j for j, p in enumerate(self.parents.tolist()) if p == i]


def tree_from_parents(
    parents: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
) -> Tree:
    """Build a `Tree` from parent indices (SpecInfer token tree, Miao et al. 2024).

    `parents[0]` must be -1 (the root) and `0 <= parents[i] < i` for every other node. This is
    the entry point for dynamic trees (EAGLE-2, Li et al. 2024) whose shape changes every step.
    """
    if isinstance(parents, torch.Tensor):
        device = parents.device if device is None else device
        parents = parents.tolist()
    parents = [int(p) for p in parents]
    if not parents or parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {parents[:1]}")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: need 0 <= parent < {i} (topological order)")
    n = len(parents)
    depths = [0] * n
    has_child = [False] * n
    ancestors = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = parents[i]
        depths[i] = depths[p] + 1
        has_child[p] = True
        ancestors[i] |= ancestors[p]
    depth = max(depths)
    leaves = [i for i in range(n) if not has_child[i]]
    paths = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)  # (P, D+1)
    for row, leaf in enumerate(leaves):
        path = ancestors[leaf].nonzero().flatten()  # ancestors precede descendants
        paths[row, : path.numel()] = path
    return Tree(
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        ancestors=ancestors.to(device),
        paths=paths.to(device),
    )


def checked_choices(choices: Sequence[Sequence[int]]) -> list[Choice]:
    """Paths of ranks as sorted tuples (shallow first), each checked: not empty, no negative
    rank, no duplicate, every prefix present."""
    choices = list(choices)  # read twice: a generator of paths too
    flat = [
        c
        for c in choices
        if isinstance(c, (str, numbers.Number)) or isinstance(c, torch.Tensor) and c.dim() == 0
    ]
    if flat:
        raise TypeError(
            f"choice {flat[0]!r}: each choice is a path of ranks, a list such as [0] or [0, 1] "
            "(the choices [[0], [1], [0, 0]], not [0, 1, 0])"
        )
    out = [tuple(int(r) for r in c) for c in choices]
    present = set()
    for c in out:
        if not c:
            raise ValueError("empty choice (); the root is implicit, list only drafted nodes")
        if min(c) < 0:
            raise ValueError(f"choice {c} has a negative rank")
        if c in present:
            raise ValueError(f"duplicate choice {c}")
        present.add(c)
    for c in out:
        for d in range(1, len(c)):
            if c[:d] not in present:
                raise ValueError(f"choice {c} needs its prefix {c[:d]}, which is missing")
    return sorted(out, key=lambda c: (len(c), c))


def tree_from_choices(
    choices: Sequence[Sequence[int]], device: torch.device | str | None = None
) -> Tree:
    """Build a static Medusa tree from "choices" paths of top-k ranks (Cai et al. 2024).

    Choice `c` is a node at depth `len(c)` holding head `len(c) - 1`'s top-`c[-1]` token; its
    parent is `c[:-1]` (the root for a 1-tuple). Nodes are sorted by (depth, choice), so the
    children of a node are in rank order. Every prefix of a choice must be present.
    """
    ordered = checked_choices(choices)
    index = {(): 0} | {c: i + 1 for i, c in enumerate(ordered)}
    parents = [-1] + [index[c[:-1]] for c in ordered]
    tree = tree_from_parents(parents, device=device)
    ranks = torch.tensor([-1] + [c[-1] for c in ordered], dtype=torch.long, device=device)
    return Tree(tree.parents, tree.depths, tree.ancestors, tree.paths, ranks)


def rank_paths(tree: Tree) -> list[Choice] | None:
    """Each node's path of ranks (`()` for the root; the choices a static tree was built from),
    or None for a tree without ranks (dynamic trees, n-gram chains, unions)."""
    if tree.ranks is None:
        return None
    ranks, parents = tree.ranks.tolist(), tree.parents.tolist()
    paths: list[Choice] = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (ranks[i],))
    return paths


def tree_levels(tree: Tree) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth 1, 2, ...: (its nodes, those of them that have children), for drafters that
    fill a static tree level by level with one forward over each level's parents."""
    has_child = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.parents.device)
    has_child[tree.parents[1:]] = True
    return [
        (
            (tree.depths == d).nonzero().flatten(),
            ((tree.depths == d) & has_child).nonzero().flatten(),
        )
        for d in range(1, tree.depth + 1)
    ]


def check_ranks(tree: Tree, vocab: int, who: str) -> None:
    """Refuse a tree whose nodes take ranks the drafter's vocabulary does not have (the k-th
    best of `vocab` tokens exists only for k < vocab): said when the tree is set, not mid-run."""
    ranks = tree.ranks[1:]
    if ranks.numel() and int(ranks.max()) >= vocab:
        raise ValueError(
            f"the tree takes the rank-{int(ranks.max())} token, but the vocabulary of {who} has "
            f"{vocab} tokens: use ranks below {vocab}"
        )


@dataclass(frozen=True, eq=False)
class StaticTree:
    """A static tree as the drafters that fill it level by level use it (EAGLE, draft model):
    node `c` takes the rank-`c[-1]` token of the drafter's distribution at its parent."""

    tree: Tree
    levels: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # see `tree_levels`
    top: int  # the most ranks any parent needs (the largest rank + 1)

    @classmethod
    def build(
        cls, choices: str | Sequence[Sequence[int]], device: torch.device | str | None = None
    ) -> StaticTree:
        """From choices (paths of ranks) or a preset name of `PRESETS`."""
        choices = get_preset(choices) if isinstance(choices, str) else choices
        tree = tree_from_choices(choices, device=device)
        return cls(tree, tuple(tree_levels(tree)), int(tree.ranks.max()) + 1)


def chain_choices(depth: int) -> list[Choice]:
    """A chain of `depth` top-1 drafts, `[(0,), (0, 0), ...]` (Leviathan et al. 2023)."""
    return [(0,) * d for d in range(1, depth + 1)]


def choice_value(accuracies: Sequence[Sequence[float]], choice: Sequence[int]) -> float:
    """Probability that a choice's whole path is correct, prod_i accuracies[i][choice[i]].

    Heads are treated as independent, as in Medusa's tree construction (Cai et al. 2024).
    """
    return math.prod(accuracies[k][r] for k, r in enumerate(choice))


def static_tree_capacity(accuracies: Sequence[Sequence[float]]) -> int:
    """The most nodes (root included) a static tree over these heads' ranks can hold."""
    return 1 + sum(math.prod(len(a) for a in accuracies[:d]) for d in range(1, len(accuracies) + 1))


def build_static_tree(accuracies: Sequence[Sequence[float]], num_nodes: int) -> list[Choice]:
    """Medusa's greedy tree construction (Cai et al. 2024, sec. 2.1.2).

    `accuracies[k][r]` is the measured probability that head k's rank-r token is right. Starting
    from the root, repeatedly add the candidate with the highest value (see `choice_value`) whose
    parent is already in the tree, until `num_nodes - 1` drafted nodes are chosen. Ties go to
    the shallower, then lexicographically smaller choice. With accuracies <= 1 a child is never
    worth more than its parent, so this maximises `expected_accept_length` for the node count.
    """
    capacity = static_tree_capacity(accuracies)
    if not 1 <= num_nodes <= capacity:
        raise ValueError(f"num_nodes must be in [1, {capacity}] for these heads: {num_nodes}")
    frontier: list[tuple[float, int, Choice]] = []

    def push_children(parent: Choice) -> None:
        k = len(parent)
        if k < len(accuracies):
            for r in range(len(accuracies[k])):
                c = parent + (r,)
                heapq.heappush(frontier, (-choice_value(accuracies, c), len(c), c))

    push_children(())
    chosen: list[Choice] = []
    while len(chosen) < num_nodes - 1:
        _, _, c = heapq.heappop(frontier)
        chosen.append(c)
        push_children(c)
    return sorted(chosen, key=lambda c: (len(c), c))


def expected_accept_length(
    accuracies: Sequence[Sequence[float]], choices: Sequence[Sequence[int]]
) -> float:
    """Expected tokens per step of a static tree: 1 (the bonus) + sum of choice values.

    Each node is on the accepted path with probability equal to its value, under Medusa's
    independent-heads model (Cai et al. 2024).
    """
    return 1.0 + sum(choice_value(accuracies, c) for c in choices)


# Not measured: a plausible shape for trained Medusa heads (Cai et al. 2024 report head-0 top-1
# near 0.6, falling with each further head). Head k's top-1 is 0.6 * 0.8^k, and rank r holds
# 1 / (r + 1)^2 of that, so head 0's top-5 is ~0.88 and top-10 ~0.93.
DEFAULT_ACCURACIES: list[list[float]] = [
    [0.6 * 0.8**k / (r + 1) ** 2 for r in range(10)] for k in range(4)
]

# chain-D: D drafted tokens (D + 1 nodes). cpu-N / gpu-N: N nodes, the root included. cpu sizes
# suit 2-8 CPU cores (a forward costs about the same up to ~16 tokens), gpu-60 a datacenter GPU.
# `PRESETS` holds the sized trees for 4 heads; `get_preset(name, num_heads)` builds them for fewer.
_SIZED = {"cpu-8": 8, "cpu-16": 16, "cpu-24": 24, "gpu-60": 60}
PRESETS: dict[str, list[Choice]] = {
    **{f"chain-{d}": chain_choices(d) for d in range(1, 5)},
    **{name: build_static_tree(DEFAULT_ACCURACIES, n) for name, n in _SIZED.items()},
}


def get_preset(name: str, num_heads: int | None = None) -> list[Choice]:
    """Choices of a named preset tree (see `PRESETS`); unknown names list the valid ones.

    Given `num_heads`, a sized tree (cpu-N, gpu-N) keeps its N nodes but uses only those heads,
    so that `MedusaDrafter(two_heads, "cpu-8")` works; a chain-D still needs D heads.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown tree preset {name!r}; valid: {', '.join(PRESETS)}")
    if name in _SIZED and num_heads is not None and num_heads < len(DEFAULT_ACCURACIES):
        try:
            return build_static_tree(DEFAULT_ACCURACIES[:num_heads], _SIZED[name])
        except ValueError as e:
            raise ValueError(f"tree preset {name!r} does not fit {num_heads} head(s): {e}") from e
    return list(PRESETS[name])
