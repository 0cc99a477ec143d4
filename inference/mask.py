"""Tree attention: the 4D mask and position ids that verify a whole token tree in one forward.

Each tree node attends to the cached prefix and to its own ancestors (itself included), never to
its siblings or cousins, and sits at position `prefix_len + depth`, so its logits equal those of a
plain causal forward over prefix + its root-to-node path (SpecInfer, Miao et al. 2024; Medusa,
Cai et al. 2024). Stock transformers models take this as a 4D *additive float* mask; a 4D bool
mask is read differently by the eager attention, so we never pass one.
"""

from __future__ import annotations

import torch

from inference.tree import Tree


def tree_attention_mask(
    tree: Tree, prefix_len: int, dtype: torch.dtype, batch_size: int = 1
) -> torch.Tensor:
    """Additive tree-attention mask (B, 1, N, prefix_len + N) (SpecInfer, Miao et al. 2024).

    0.0 where node i may attend (every prefix position; tree node j when j is i or an ancestor of
    i) and `torch.finfo(dtype).min` elsewhere. `dtype` should be the model's compute dtype. The
    mask is built on the device of `tree.ancestors`.
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    n = tree.num_nodes
    blocked = torch.finfo(dtype).min
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype, device=tree.ancestors.device)
    mask[0, 0, :, prefix_len:].masked_fill_(~tree.ancestors, blocked)  # (N, N)
    # A real copy per row: attention code may write into or re-stride the mask.
    return mask.expand(batch_size, 1, n, prefix_len + n).contiguous()


def tree_position_ids(tree: Tree, prefix_len: int) -> torch.Tensor:
    """Position ids (1, N) of the tree nodes: `prefix_len + depth` (Cai et al. 2024).

    The root sits right after the cached prefix; siblings share a position, as they would in
    their own causal sequences.
    """
    return (prefix_len + tree.depths).unsqueeze(0)


def frontier_attention_mask(
    allowed: torch.Tensor, prefix_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask (1, 1, F, prefix_len + C) for a drafter's forward over a tree level's
    frontier (F nodes) whose keys follow `prefix_len` cached sequence entries and C tree
    entries: the tree nodes already cached, then the frontier itself (EAGLE and draft-model
    trees, drafted level by level). `allowed` (F, C) bool: frontier node f may attend to tree
    entry c (its cached ancestors and itself); every sequence position is open.
    """
    F, C = allowed.shape
    mask = torch.zeros(F, prefix_len + C, dtype=dtype, device=allowed.device)
    mask[:, prefix_len:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
