"""Prepacked linear weights for CPU inference.

`torch.nn.Linear` on CPU calls MKL's GEMM, which re-packs the whole weight on every call. At the
row counts speculative decoding verifies (1-32 tokens), that packing costs as much as the product
itself: on a 2-core CPU, SmolLM2-135M's forward over 8 tokens took 1.5x its 1-token forward.
oneDNN can keep the weight in its blocked layout once (what inductor's CPU freezing does), which
makes an 8-token forward cost about 1.2x a 1-token one; the 1-token forward (HF `generate`'s
step) costs the same as before.

bf16 weights are packed too where oneDNN computes bf16 (a CPU with AVX512 or AMX): with AMX tiles
their products run several times faster than fp32's, and the packed path gives the same numbers as
the plain bf16 GEMM. It also avoids a copy that the plain one makes: a batch's last-position
logits (HF `generate`'s prefill, `hidden[:, -1:]` into the lm_head) go through a batched matmul
that copies the lm_head's weight once per row of the batch (64 x 576 x 49k values for SmolLM2 at
batch 64, 8 s on 2 cores).

`prepack_linear_weights` swaps the class of each such `nn.Linear` to `PackedLinear` in place:
the module, its `weight` Parameter (tied embeddings included) and the state dict are unchanged,
so saving, `get_output_embeddings()` and peft still work. It falls back to the plain GEMM whenever
the packed copy cannot be used: autograd, another device or dtype, or a weight replaced or changed
in place since packing (its storage, dtype or `Tensor._version`). A change written through
`weight.data` (peft's `merge_and_unload` adds the adapter so) moves none of these: `repack_stale`
finds it by a probe of the weight's values and packs again, and `SpeculativeGenerator` calls it
when built. A copy (`copy.deepcopy`, pickling) leaves the packed copy behind and computes with the
plain GEMM until packed again. The packed copy costs one more copy of the linear weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocking for this many rows; trees on CPU verify 1-16 tokens.
PACK_ROWS_HINT = 8
# Weight values kept at packing to tell a change written through `.data` (spread over the weight:
# a merged LoRA adapter changes nearly every one of them).
PROBES = 64


def can_prepack() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


@functools.cache
def can_prepack_bf16() -> bool:
    """Whether oneDNN computes bf16 on this CPU (AVX512, AMX): bf16 weights are packed too."""
    return can_prepack() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed linear takes this weight: fp32 on the CPU, or bf16 where oneDNN
    computes it."""
    if weight.device.type != "cpu":
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and can_prepack_bf16())


class PackedLinear(nn.Linear):
    """An `nn.Linear` that also holds its CPU weight (fp32 or bf16) in oneDNN's packed layout."""

    _packed: torch.Tensor
    # The weight as packed: held, so that its storage's address cannot be handed to another
    # weight (a replaced one is then told by its address), and its version counter when packed.
    _packed_from: torch.Tensor | None = None  # None: not packed yet (or a copy's)
    _packed_version: int | None = None
    _probe: tuple[torch.Tensor, torch.Tensor]  # (flat indices, their values) when packed

    def pack(self) -> None:
        weight = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        self._packed_from, self._packed_version = weight, self.weight._version
        # integer steps: a float linspace rounds past the end of a weight of 28M values
        where = (torch.arange(PROBES) * (weight.numel() - 1) // (PROBES - 1)).unique()
        self._probe = (where, weight.reshape(-1)[where].clone())

    def _current(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is the tensor packed, unchanged by any op autograd sees."""
        return (
            self._packed_from is not None
            and weight.data_ptr() == self._packed_from.data_ptr()
            and weight._version == self._packed_version
            and packable(weight)
        )

    def stale(self) -> bool:
        """Whether the weight changed since packing, also through `weight.data`."""
        if not self._current(self.weight):
            return True
        where, values = self._probe
        return not torch.equal(self.weight.detach().reshape(-1)[where], values)

    def __getstate__(self) -> dict:
        # oneDNN's packed tensor cannot be copied or pickled: a copy packs again when asked
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state["_packed_from"] = state["_packed_version"] = None
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # A base forward makes ~200 of these calls: under no_grad (decoding) the cheap checks
        # first; a weight replaced or moved has another address, one changed in place another
        # version, so packable() need not be asked again (1.7 ms a SmolLM2 forward, 1 thread).
        if (
            not torch.is_grad_enabled()
            and weight._version == self._packed_version
            and self._packed_from is not None
            and weight.data_ptr() == self._packed_from.data_ptr()
            and x.dtype == weight.dtype
            and x.is_cpu
        ):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        usable = (
            x.device.type == "cpu"
            and x.dtype == weight.dtype
            and self._current(weight)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )
        if not usable:
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def prepack_linear_weights(model: nn.Module) -> int:
    """Prepack every fp32 (and, where oneDNN computes it, bf16) CPU `nn.Linear` of `model` in
    place (again where a packed weight changed); returns how many are packed.

    A no-op (returns 0) when oneDNN is unavailable. Use it on a frozen model for inference.
    """
    if not can_prepack():
        return 0
    for module in model.modules():
        if type(module) is nn.Linear and packable(module.weight):
            module.__class__ = PackedLinear  # not packed yet: stale
    repack_stale(model)
    return sum(isinstance(m, PackedLinear) and packable(m.weight) for m in model.modules())


def repack_stale(model: nn.Module) -> int:
    """Pack again the `PackedLinear`s of `model` whose weight changed since packing (a merged
    LoRA adapter, weights loaded into it); returns how many. Packs nothing that was not packed."""
    if not can_prepack():
        return 0
    repacked = 0
    for module in model.modules():
        if isinstance(module, PackedLinear) and packable(module.weight) and module.stale():
            module.pack()
            repacked += 1
    return repacked
