"""Prepacked fp32 weights for CPU inference.

`torch.nn.Linear` on CPU calls MKL's GEMM, which re-packs the whole weight on every call. At the
row counts speculative decoding verifies (1-32 tokens), that packing costs as much as the product
itself: on a 2-core CPU, SmolLM2-135M's forward over 8 tokens took 1.5x its 1-token forward.
oneDNN can keep the weight in its blocked layout once (what inductor's CPU freezing does), which
makes an 8-token forward cost about 1.2x a 1-token one; the 1-token forward (HF `generate`'s
step) costs the same as before.

`prepack_linear_weights` swaps the class of each fp32 CPU `nn.Linear` to `PackedLinear` in place:
the module, its `weight` Parameter (tied embeddings included) and the state dict are unchanged,
so saving, `get_output_embeddings()` and peft still work. It falls back to the plain GEMM whenever
the packed copy cannot be used: autograd, another device or dtype, or a weight changed in place
since packing (`Tensor._version`). The packed copy costs one more copy of the linear weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocking for this many rows; trees on CPU verify 1-16 tokens.
PACK_ROWS_HINT = 8


def can_prepack() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` that also holds its fp32 CPU weight in oneDNN's packed layout."""

    _packed: torch.Tensor
    _packed_version: int

    def pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS_HINT)
        self._packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        usable = (
            x.device.type == "cpu"
            and weight.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32
            and weight._version == self._packed_version
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )
        if not usable:
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def prepack_linear_weights(model: nn.Module) -> int:
    """Prepack every fp32 CPU `nn.Linear` of `model` in place; returns how many are packed.

    A no-op (returns 0) when oneDNN is unavailable. Use it on a frozen model for inference.
    """
    if not can_prepack():
        return 0
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is nn.Linear
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
        ):
            module.__class__ = PackedLinear
            module.pack()
            packed += 1
        elif isinstance(module, PackedLinear):  # repacked only if its weight changed
            if module._packed_version != module.weight._version:
                module.pack()
            packed += 1
    return packed
