"""Writing heads in other engines' layouts.

vLLM reads headstart's native folders as they are (DESIGN.md), so exporting to it is a checked
copy; SGLang too, except that it counts EAGLE-3 aux layer ids one lower (the output of layer i
rather than the state entering it), and wants EAGLE-1 under its own architecture name with an fc
bias, which the export rewrites. TGI and TensorRT-LLM read Medusa heads as `medusa_lm_head.safetensors` with keys
`{h}.{l}.linear.weight/bias` (residual layer l of head h) and `{h}.{L}.weight` (its lm_head), plus
a config.json with `medusa_num_heads` / `medusa_num_layers`. What a target cannot represent is
refused with the reason, never silently dropped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heads.checkpoint import CONFIG_NAME, load_heads, resolve_folder
from heads.medusa import MedusaHeads

TARGETS = ("vllm", "sglang", "tgi", "trtllm")


class ExportError(ValueError):
    """The heads cannot be represented in the requested engine's format."""


def export_heads(src: str | Path, target: str, out: str | Path) -> Path:
    """Export the heads folder or Hub repo id `src` to `target` (one of TARGETS) into `out`."""
    if target not in TARGETS:
        raise ExportError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    src = resolve_folder(src)
    heads = load_heads(src)  # validates the folder before anything is written
    out = Path(out)
    if out.resolve() == Path(src).resolve():
        raise ExportError("--out must differ from the source folder")
    is_medusa = isinstance(heads, MedusaHeads)
    if target in ("vllm", "sglang"):
        if target == "sglang" and is_medusa:
            raise ExportError(
                "SGLang has no Medusa support; export Medusa heads to vllm, tgi or trtllm"
            )
        biased = [
            name
            for name in ("attention_bias", "mlp_bias")
            if not is_medusa and getattr(heads.config, name, False)
        ]
        if target == "vllm" and not is_medusa and heads.config.fc_bias:
            raise ExportError(
                "vLLM's EAGLE-1 fc has no bias and would drop this layer's (EAGLE's reference "
                "trains one): serve it with SGLang (--to sglang) or headstart"
            )
        if target == "sglang" and heads.config.version == 3 and biased:
            raise ExportError(
                f"SGLang's EAGLE-3 layer has no attention or MLP biases, and these heads have "
                f"{' and '.join(biased)} (from their base): serve them with vLLM"
            )
        out.mkdir(parents=True, exist_ok=True)
        for name in (CONFIG_NAME, "model.safetensors", "README.md"):
            if (Path(src) / name).is_file():
                shutil.copy2(Path(src) / name, out / name)
        if target == "sglang" and heads.config.version == 3:
            _sglang_aux_ids(out / CONFIG_NAME)
        elif target == "sglang":
            _sglang_eagle1(heads, out)
        return out
    if not is_medusa:
        raise ExportError(
            f"{target} export is for Medusa heads; for EAGLE draft layers use the native folder "
            "with vLLM or SGLang"
        )
    _write_medusa_lm_head(heads, target, out)
    return out


def _sglang_aux_ids(config_path: Path) -> None:
    """SGLang reads aux id i as the *output* of layer i (it captures before layer i + 1), where
    headstart and vLLM mean the state *entering* layer i: write i - 1 for SGLang."""
    config = json.loads(config_path.read_text())
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if min(ids) < 1:
        raise ExportError(f"aux layer ids {ids}: SGLang cannot capture the embeddings (id 0)")
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
    if "eagle_aux_hidden_state_layer_ids" in config:  # the copy vLLM reads: the same ids
        config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _sglang_eagle1(heads, out: Path) -> None:
    """SGLang builds its EAGLE-1 model only for the architecture `LlamaForCausalLMEagle` (a
    plain `LlamaForCausalLM`, which vLLM maps to its EAGLE model, would load as a one-layer
    Llama), and its fc has a bias, which stays randomly initialised when the file has none:
    write headstart's bias-free fc as a zero bias."""
    config_path = out / CONFIG_NAME
    config = json.loads(config_path.read_text())
    config["architectures"] = ["LlamaForCausalLMEagle"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = load_file(out / "model.safetensors")
    weight = tensors["fc.weight"]
    tensors.setdefault("fc.bias", torch.zeros(weight.shape[0], dtype=weight.dtype))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def read_medusa_lm_head(raw: dict, tensors: dict[str, torch.Tensor], where: str):
    """(MedusaConfig, tensors in headstart's names) from the reference Medusa / TGI layout
    (config `medusa_num_heads`, `medusa_num_layers`; tensors `{h}.{l}.linear.weight/bias`,
    `{h}.{L}.weight`), as FasterDecoding's and TGI's Medusa repos ship it, once in safetensors.
    Sizes come from the tensors; the base is the one the config names."""
    from heads.medusa import MedusaConfig

    K, L = raw.get("medusa_num_heads"), raw.get("medusa_num_layers", 1)
    if not isinstance(K, int) or not isinstance(L, int) or K < 1 or L < 0:
        raise ValueError(
            f"{where}: medusa_num_heads={K!r}, medusa_num_layers={L!r}: need integers >= 1, >= 0"
        )
    head = tensors.get(f"0.{L}.weight")
    if head is None or head.dim() != 2:
        raise ValueError(
            f"{where}: no tensor 0.{L}.weight (head 0's lm_head after {L} residual layers): "
            "not the Medusa lm_head layout its config.json says"
        )
    vocab, hidden = head.shape
    renamed = {}
    for name, tensor in tensors.items():
        h, rest = name.split(".", 1) if "." in name else (name, "")
        layer, _, kind = rest.partition(".")
        if kind.startswith("linear.") and h.isdigit() and layer.isdigit():
            renamed[f"blocks.{h}.layers.{layer}.{kind.removeprefix('linear.')}"] = tensor
        elif rest == f"{L}.weight" and h.isdigit():
            renamed[f"lm_heads.{h}.weight"] = tensor
        else:
            renamed[name] = tensor  # named as unexpected by the load
    config = MedusaConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=K,
        num_hidden_layers=L,
        medusa_fc_bias=L == 0 or "0.0.linear.bias" in tensors,
        base_model_name_or_path=str(raw.get("base_model_name_or_path") or ""),
        base_hidden_size=hidden,
        base_vocab_size=vocab,
    )
    return config, renamed


def _write_medusa_lm_head(heads: MedusaHeads, target: str, out: Path) -> None:
    cfg = heads.config
    if cfg.original_lm_head:
        raise ExportError(
            f"{target} needs one lm_head per Medusa head, but these heads share the base's "
            "lm_head (original_lm_head); train with own lm_heads (heads.shared_lm_head=false)"
        )
    if cfg.truncated_vocab_size is not None:
        raise ExportError(
            f"{target} has no reduced draft vocabulary (token_map); train with the full vocabulary"
        )
    L = cfg.num_hidden_layers
    tensors = {}
    for h, block in enumerate(heads.blocks):
        for i, layer in enumerate(block.layers):
            weight = layer.weight.detach().contiguous()
            tensors[f"{h}.{i}.linear.weight"] = weight
            # TGI's residual block always reads a bias: a bias-free one (medusa_fc_bias false)
            # is written as zeros, which computes the same
            bias = layer.bias if layer.bias is not None else weight.new_zeros(weight.shape[0])
            tensors[f"{h}.{i}.linear.bias"] = bias.detach().contiguous()
        tensors[f"{h}.{L}.weight"] = heads.lm_heads[h].weight.detach().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "medusa_lm_head.safetensors")
    config = {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": L,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "base_model_name_or_path": cfg.base_model_name_or_path,
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
