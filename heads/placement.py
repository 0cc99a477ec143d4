"""Where models go and in which dtype: the defaults (a GPU where there is one, bf16 on it) and
checks of a device or dtype a user names, said as errors that say what this machine has."""

from __future__ import annotations

import torch


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """fp32 on CPU (exact greedy checks, and many CPUs have no bf16 instructions), bf16 on CUDA."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def floating_dtype(dtype: torch.dtype | str | None, auto: str) -> torch.dtype | None:
    """`dtype` as a floating torch.dtype (a name such as "bfloat16" read as torch's), None for
    None or "auto" (`auto` says what that means, for the error), or a ValueError naming them."""
    named = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype != "auto" else dtype
    if dtype is None or dtype == "auto":
        return None
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise ValueError(
            f"dtype={dtype!r} is no floating torch dtype: give one such as 'float32', "
            f"'bfloat16', 'float16', or {auto}"
        )
    return named


def usable_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, or a ValueError that says why this machine cannot use it (a
    name torch does not know; CUDA, MPS or XPU where torch sees none, or too few)."""
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"device={str(device)!r} is no torch device: give 'cpu', 'cuda', 'cuda:1', 'mps', ..."
        ) from e
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if device.type != "cpu" and callable(available) and not available():
        raise ValueError(
            f"device={str(device)!r}, but torch {torch.__version__} sees no {device.type} device "
            "on this machine: give device='cpu', or install a torch build for it"
        )
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise ValueError(f"device={str(device)!r}, but torch sees {count()} {device.type} devices")
    return device
