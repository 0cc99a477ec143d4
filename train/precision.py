"""Which autocast a recipe's `training.mixed_precision` means on this machine.

bf16 autocast pays on a GPU with bf16 and on a CPU with bf16 instructions (AVX512-BF16 or AMX):
the demo's EAGLE-3 step took 1.3 s instead of 2.0 s in fp32 on such a CPU. On a CPU without
them torch emulates bf16 matmuls: the same step took 67 s instead of 2.0 s (an AVX2-only AMD
EPYC, 2026-12-03). "auto" takes bf16 where it pays and fp32 elsewhere.
"""

from __future__ import annotations

import warnings

import torch

from heads.cpu import can_prepack_bf16


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX tiles), as torch sees it."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_mixed_precision(setting: str, on_gpu: bool) -> tuple[str, str]:
    """(what accelerate is given, why) for a recipe's setting on this machine.

    "auto" is bf16 on a GPU that supports it or a CPU with bf16 instructions, else "no".
    An explicit "bf16" on a CPU without them is kept, with a warning: it is many times slower.
    """
    has_bf16 = torch.cuda.is_bf16_supported() if on_gpu else cpu_has_bf16()
    if setting == "auto":
        where = "this GPU" if on_gpu else "this CPU"
        if has_bf16:
            return "bf16", f"auto: {where} computes in bf16"
        return "no", f"auto: {where} has no bf16 instructions, so fp32"
    if setting == "bf16" and not on_gpu and not has_bf16:
        warnings.warn(
            "training.mixed_precision=bf16 on a CPU without bf16 instructions (AVX512-BF16 or "
            "AMX): torch emulates them, and steps run many times slower than in fp32 (67 s "
            "against 2.0 s for the demo's EAGLE-3 step on an AVX2 CPU). Set "
            "training.mixed_precision=auto (bf16 only where it pays) or no.",
            stacklevel=2,
        )
    return setting, setting


def bf16_base_pays(device: torch.device) -> bool:
    """Whether a frozen base in bf16 runs fast on `device` as a CPU: one with bf16 instructions
    whose bf16 weights oneDNN packs (`heads.cpu`); unpacked, bf16 runs slower than fp32."""
    return device.type == "cpu" and cpu_has_bf16() and can_prepack_bf16()


def answering_dtype(setting: str, temperature: float, device: torch.device) -> str | None:
    """The base's dtype for distilling answers from a recipe's `model.dtype` (None: load_base's
    default, bf16 on a GPU and fp32 on a CPU).

    "auto" also takes bf16 for *sampled* answers on a CPU with bf16 instructions, whose weights
    oneDNN packs (`heads.cpu`): they are training data, a sample of the base's distribution,
    which bf16 changes by its rounding only, and the batched generation runs about twice as fast
    (AMX). Greedy answers stay fp32 on a CPU: they are the base's exact greedy output, the one
    that decoding reproduces and that `scripts/eval_heads.py` scores heads on.
    """
    if setting != "auto":
        return setting
    if temperature > 0 and bf16_base_pays(device):
        return "bfloat16"
    return None


def training_base_dtype(
    setting: str, mixed_precision: str, mode: str, device: torch.device, earlier: str | None
) -> tuple[str | None, str]:
    """(the frozen base's dtype for training, why) from a recipe's `model.dtype`; the dtype None
    is load_base's default, bf16 on a GPU and fp32 on a CPU.

    "auto" keeps `earlier`, the base dtype of what the run builds on (a resumed checkpoint, an
    existing feature cache), whose fingerprints hold the weights in that dtype. Otherwise it takes
    bf16 for offline training under bf16 autocast on a CPU with bf16 instructions, whose weights
    oneDNN packs: the features are stored in bf16 anyway, and the base's forward over them ran
    4.8x faster than in fp32 (SmolLM2-135M, an Intel Xeon with AMX), while the drafts it trained
    scored as those of the fp32 base (docs/distill.md).
    """
    if setting != "auto":
        return setting, setting
    if earlier is not None:
        if earlier == "bfloat16" and device.type == "cpu" and not cpu_has_bf16():
            warnings.warn(
                "the checkpoint or feature cache this run builds on holds the base's bf16 "
                "weights, and this CPU has no bf16 instructions: the bf16 base runs emulated, "
                "slowly. model.dtype=float32 with a new training.feature_cache (or "
                "training.resume=never) trains in fp32.",
                stacklevel=2,
            )
        return earlier, "auto: as the checkpoint or feature cache it builds on"
    if mode == "offline" and mixed_precision == "bf16" and bf16_base_pays(device):
        return "bfloat16", "auto: bf16 features on this CPU"
    return None, "auto: load_base's default"
