"""Medusa-2 heads and the LoRA-adapted base they were trained on.

Medusa-2 fine-tunes the base with LoRA adapters beside the heads, so the heads read the adapted
base's hidden states: served on the plain base they draft worse (the output stays the base's own,
only slower). Training saves the adapter in the heads folder (`lora/`) and records a probe of it
in the heads' config: the entries of one adapted weight that the adapter changes most, before
and after merging. `load_heads` reads those entries of the base it is given to tell which it is.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from heads.base import parameter_values

LORA_FOLDER = "lora"  # the adapter's subfolder of a heads folder (peft's save_pretrained)


def lora_probe(peft_model: nn.Module, k: int = 8, gather=None) -> dict[str, Any]:
    """The first adapted linear's weight name (as the plain base names it), the flat indices of
    the `k` entries its adapter changes most, and their values in the plain and in the merged
    base (fp32); {} when no adapter is active. `gather(*params)` makes the module's parameters
    whole to read (DeepSpeed ZeRO-3 shards them; every process must call it then)."""
    for name, module in peft_model.named_modules():
        active = getattr(module, "active_adapters", None)
        if (
            not active
            or not hasattr(module, "get_delta_weight")
            or not hasattr(module, "base_layer")
        ):
            continue
        whole = gather(*module.parameters()) if gather else nullcontext()
        with whole, torch.no_grad():
            delta = module.get_delta_weight(active[0]).float().reshape(-1).cpu()
            plain = module.base_layer.weight.float().reshape(-1).cpu()
        top = delta.abs().topk(min(k, delta.numel())).indices
        return {
            "weight": name.removeprefix("base_model.model.") + ".weight",
            "index": top.tolist(),
            "plain": plain[top].tolist(),
            "merged": (plain + delta)[top].tolist(),
        }
    return {}


def lora_merged(base: nn.Module, probe: dict[str, Any] | None) -> bool | None:
    """Whether `base` computes with the probed adapter: a peft model, or its weight's entries
    nearer the merged values than the plain ones. None where the probe cannot tell (none
    recorded, the weight not in this base, an adapter that changes nothing in the base's
    precision: one whose largest changes are below bf16's rounding, ~0.4% of the weight, leaves
    the base the same merged or not)."""
    if hasattr(base, "peft_config"):
        return True
    if not probe:
        return None
    try:  # a tied weight too; an offloaded one from its hook
        weight = parameter_values(base, probe["weight"])
    except AttributeError:
        return None
    if weight.numel() <= max(probe["index"]):
        return None
    with torch.no_grad():
        values = weight.reshape(-1)[torch.tensor(probe["index"], device=weight.device)]
        values = values.float().cpu()
    # the probe's values as this base would hold them, rounded to its weight's dtype
    merged, plain = (torch.tensor(probe[k]).to(weight.dtype).float() for k in ("merged", "plain"))
    if torch.equal(merged, plain):
        return None
    return bool((values - merged).abs().sum() < (values - plain).abs().sum())


def warn_unless_merged(config, base: nn.Module, where: str) -> None:
    """Warn when Medusa-2 heads (`config.base_lora`) are given the base without their adapter."""
    if getattr(config, "base_lora", "") and lora_merged(base, config.base_lora_probe) is False:
        warnings.warn(
            f"these Medusa-2 heads were trained on the base with the LoRA adapter in their "
            f"'{config.base_lora}' folder, and the base given has it not merged: they will draft "
            "worse (the output stays the base's own). Load the base with it: "
            f"PeftModel.from_pretrained(base, '{where}', subfolder='{config.base_lora}')"
            ".merge_and_unload()",
            stacklevel=3,
        )


def with_heads_adapter(base: nn.Module, heads) -> nn.Module:
    """`base` with the LoRA adapter that Medusa-2 `heads` (loaded from their folder) were trained
    beside merged in (peft's merge_and_unload, which changes `base` in place), as they draft
    when served; `base` as it is for other heads or a base that has it merged already."""
    lora = getattr(heads.config, "base_lora", "")
    if not lora or lora_merged(base, heads.config.base_lora_probe) is not False:
        return base
    return _merge_adapter(base, heads.source_folder, lora)


def _merge_adapter(base: nn.Module, folder, lora: str) -> nn.Module:
    """`base` with the adapter in `folder / lora` merged in."""
    from peft import PeftModel

    from heads.cpu import repack_stale

    merged = PeftModel.from_pretrained(base, str(folder), subfolder=lora).merge_and_unload()
    repack_stale(merged)  # load_base's prepacked CPU weights: the merged ones, not the old
    return merged


def base_as_served(
    base: nn.Module, folders: Iterable[str | os.PathLike], program: str
) -> tuple[nn.Module, str | None]:
    """`base` as the heads of `folders` (paths or Hub repo ids) are served, and the folder whose
    adapter it took: with the LoRA adapter of the Medusa-2 heads among them merged in, said on
    stderr as `program`'s; `base` and None when none has one or the base has it merged already.
    Two Medusa-2 folders raise ValueError: each read the base with its own adapter. Reads the
    heads' configs only (the scripts load the heads themselves, on the base returned)."""
    from heads.checkpoint import read_config, resolve_folder

    paths = {name: resolve_folder(name) for name in folders}
    configs = {name: (path, read_config(path)) for name, path in paths.items()}
    adapted = [name for name, (_, config) in configs.items() if config.get("base_lora")]
    if len(adapted) > 1:
        raise ValueError(
            f"{' and '.join(map(str, adapted))} are Medusa-2 heads, each trained beside its own "
            "LoRA adapter on the base: serve one of them at a time"
        )
    if not adapted:
        return base, None
    folder, config = configs[adapted[0]]
    if lora_merged(base, config.get("base_lora_probe")) is not False:
        return base, None  # merged already (or a probe that cannot tell: left as given)
    print(
        f"{program}: the base with the LoRA adapter of the Medusa-2 heads {adapted[0]} merged: "
        "the model they were trained on and are served with",
        file=sys.stderr,
    )
    return _merge_adapter(base, folder, config["base_lora"]), str(adapted[0])
