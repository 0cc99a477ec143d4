"""KV-cache compaction after tree verification.

The verify forward appends all N tree nodes to the base's cache; only the accepted path may stay.
`Cache.crop` trims the end only, so the accepted rows are gathered into place first.
"""

from __future__ import annotations

import torch
from transformers import Cache


def keep_accepted(cache: Cache, prefix_len: int, nodes: torch.Tensor) -> None:
    """Keep the first `prefix_len` positions plus tree rows `nodes` (A,), in that order.

    Afterwards the cache is exactly what a plain forward over prefix + accepted tokens leaves
    (the accepted rows were computed with the same positions and the same visible context).
    """
    n_tree = cache.get_seq_length() - prefix_len
    rows = prefix_len + nodes.to(torch.long)
    in_place = bool((nodes == torch.arange(nodes.numel(), device=nodes.device)).all())
    for layer in [] if in_place else cache.layers:  # a chain's accepted rows already sit in place
        # (B, heads, T, head_dim): copy the accepted rows right after the prefix, then crop. A
        # base dispatched over devices keeps each layer's cache on that layer's device.
        at = rows.to(layer.keys.device)
        layer.keys[..., prefix_len : prefix_len + at.numel(), :] = layer.keys[..., at, :]
        layer.values[..., prefix_len : prefix_len + at.numel(), :] = layer.values[..., at, :]
    drop = n_tree - nodes.numel()
    if drop > 0:
        cache.crop(-drop)
