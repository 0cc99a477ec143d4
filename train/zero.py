"""DeepSpeed's engine settled with the recipe: the config's "auto" values it would otherwise fill
its own way, and what its bf16 cast of the whole model changes."""

from __future__ import annotations

import torch

from train.config import Recipe


def fill_deepspeed_config(config: dict, recipe: Recipe) -> list[str]:
    """Fill a DeepSpeed config's "auto" values that accelerate would fill otherwise: the micro
    batch (accelerate reads it from a prepared DataLoader; the recipes batch by themselves) and
    the gradient clipping (accelerate's 1.0; DeepSpeed clips in its engine, so the recipe's
    max_grad_norm is applied only through it). Returns notes on values the config sets itself
    that differ from the recipe's."""
    training, notes = recipe.training, []
    if config.get("train_micro_batch_size_per_gpu") == "auto":
        config["train_micro_batch_size_per_gpu"] = training.micro_batch_size
    clipping = config.get("gradient_clipping", "auto")
    if clipping == "auto":
        config["gradient_clipping"] = training.max_grad_norm
    elif clipping != training.max_grad_norm:
        notes.append(
            f"note: the DeepSpeed config's gradient_clipping {clipping} is applied, not "
            f"training.max_grad_norm {training.max_grad_norm} (DeepSpeed clips in its engine: "
            'set it to "auto" to take the recipe\'s)'
        )
    return notes


def keep_rotary_in_fp32(model: torch.nn.Module) -> int:
    """Set RoPE's inverse frequencies back to float32 where a cast of the whole model (DeepSpeed's
    bf16 engine casts every buffer of the model it wraps) left them in a lower precision:
    transformers keeps them in float32, as do the engines that serve the heads, so the heads
    would train on the base's features at other angles (0.7 rad off at position 4,096 in bf16).
    Recomputed as transformers initialises them; returns how many modules were set back."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    restored = 0
    for module in model.modules():
        freq = getattr(module, "inv_freq", None)
        rotary = "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")
        if not rotary or freq is None or freq.dtype == torch.float32:
            continue
        init = {
            "default": getattr(module, "compute_default_rope_parameters", None),
            **ROPE_INIT_FUNCTIONS,
        }.get(getattr(module, "rope_type", None))
        if init is None:
            continue
        value, _ = init(module.config)
        module.inv_freq = value.float().to(freq.device)
        module.original_inv_freq = module.inv_freq.clone()
        restored += 1
    return restored
