"""Writing heads in other engines' layouts.

vLLM and SGLang read headstart's native EAGLE-3 folders as they are (docs/formats.md; the aux
layer ids are written in each engine's meaning), and vLLM its Medusa and EAGLE-1 folders, so
exporting to them writes the loaded heads in that layout (a checked copy of a native folder);
SGLang wants EAGLE-1 under its own architecture name with an fc bias, which the export rewrites.
TGI and TensorRT-LLM read Medusa heads as `medusa_lm_head.safetensors` with keys
`{h}.{l}.linear.weight/bias` (residual layer l of head h) and `{h}.{L}.weight` (its lm_head),
plus a config.json with `medusa_num_heads` / `medusa_num_layers`. What a target cannot represent
is refused with the reason, never silently dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from heads.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_heads,
    resolve_folder,
    write_safetensors,
)
from heads.eagle_config import engine_refusal
from heads.hub import headstart_card, model_card
from heads.lora import LORA_FOLDER
from heads.medusa import MedusaHeads

TARGETS = ("vllm", "sglang", "tgi", "trtllm")


class ExportError(ValueError):
    """The heads cannot be represented in the requested engine's format."""


def missing_folders(path: str | Path) -> list[Path]:
    """The folders `Path(path).mkdir(parents=True)` would make, deepest first ("a" of "a/../b"
    too, which it makes on the way; a ".." step is no folder of its own to remove)."""
    path = Path(path).absolute()
    return [p for p in (path, *path.parents) if p.name != ".." and not p.exists()]


def make_folders(path: Path) -> list[Path]:
    """Make `path` and its missing parents; returns the folders made, deepest first."""
    made = missing_folders(path)
    path.mkdir(parents=True, exist_ok=True)
    return made


def remove_made(made: list[Path]) -> None:
    """Remove folders `make_folders` made, deepest first, while they are empty (another run
    may have written beside this one's meanwhile)."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def export_heads(
    src: str | Path, target: str, out: str | Path, base_name: str | None = None
) -> Path:
    """Export the heads folder or Hub repo id `src` to `target` (one of TARGETS) into `out`.
    `base_name`: the base's Hub id or path as the engine sees it, written for TGI (which loads
    the base from the heads' config) instead of the name the heads recorded."""
    if target not in TARGETS:
        raise ExportError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if base_name is not None and target != "tgi":
        raise ExportError(
            f"--base-name is for tgi, which loads the base from the heads' config; {target} "
            "is given the base by its own command line"
        )
    src = resolve_folder(src)
    heads = load_heads(src)  # validates the folder before anything is written
    out = Path(out)
    if out.resolve() == Path(src).resolve():
        raise ExportError("--out must differ from the source folder")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file: give a folder to write the export into")
    if out.is_dir():
        check_earlier_export(out)
    lora = getattr(heads.config, "base_lora", "")
    if lora and not (Path(src) / lora).is_dir():
        raise ExportError(
            f"these Medusa-2 heads read the base with the LoRA adapter of their '{lora}' "
            f"folder, which {src} lacks: export them from the training run's heads folder"
        )
    # Written into a hidden folder inside `out` (its filesystem, its mode; a mount point or a
    # link stays what it is) and moved in by renames: a refused, failed or interrupted export
    # leaves `out` as it was.
    made = make_folders(out)
    for leftover in out.glob(f"*{WORK_PREFIX}*"):  # of an export killed before
        shutil.rmtree(leftover, ignore_errors=True)
    staging = out / f"{WORK_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _export_to(heads, Path(src), target, staging, base_name)
        if lora and not (staging / LORA_FOLDER).is_dir():  # vllm's save_pretrained copied it
            shutil.copytree(Path(src) / lora, staging / LORA_FOLDER)
        (staging / EXPORT_MARK).write_text(json.dumps({"target": target}) + "\n")
        _move_in(staging, out)
    except BaseException:
        shutil.rmtree(out if made else staging, ignore_errors=True)  # made: out is this one's
        remove_made(made[1:])  # the folders above it, while empty: another may write there
        raise
    if lora and target in ("tgi", "trtllm"):  # the engine serves the base with it merged
        warnings.warn(
            f"{target} loads the base these heads name, without their LoRA adapter: merge "
            f"{out / LORA_FOLDER} into the base, save it, and give that to {target}",
            stacklevel=2,
        )
    return out


def _export_to(heads, src: Path, target: str, out: Path, base_name: str | None) -> None:
    is_medusa = isinstance(heads, MedusaHeads)
    if target in ("vllm", "sglang"):
        if target == "sglang" and is_medusa:
            raise ExportError(
                "SGLang has no Medusa support; export Medusa heads to vllm, tgi or trtllm"
            )
        reason = None if is_medusa else engine_refusal(heads.config, target)
        if reason:
            raise ExportError(reason)
        # Written from the loaded heads, in the native layout and dtype of the source: a folder
        # of another layout (Medusa's reference, another trainer's EAGLE-3) or written by an
        # earlier headstart comes out as the engines read it.
        # A card written by hand is kept; headstart's own is written anew, which says how the
        # engines serve these heads now (an older one may not).
        heads.save_pretrained(out, dtype=_stored_dtype(src))
        # EAGLE-3's config names its aux layers for both engines (`engine_aux_ids`)
        if target == "sglang" and heads.config.version == 1:
            _sglang_eagle1(out)
            if headstart_card(out / "README.md"):
                (out / "README.md").write_text(model_card(heads.config, sglang_layout=True))
        return
    if not is_medusa:
        raise ExportError(
            f"{target} export is for Medusa heads; for EAGLE draft layers use the native folder "
            "with vLLM or SGLang"
        )
    _write_medusa_lm_head(heads, target, out, base_name)


# Written into every export's folder: a folder without it is no earlier export (a heads folder
# of save_pretrained holds the same names as a vllm export).
EXPORT_MARK = ".headstart-export"
# In the name of the hidden folders an export works in inside its `--out` (those a killed export
# left are removed by the next).
WORK_PREFIX = ".headstart-export-work-"
# Everything an export writes into its folder, of every target.
EXPORT_NAMES = {
    CONFIG_NAME,
    WEIGHTS_NAME,
    "medusa_lm_head.safetensors",
    "README.md",
    LORA_FOLDER,
    EXPORT_MARK,
}


def _move_in(staging: Path, out: Path) -> None:
    """Replace the earlier export's files in `out` by the staged ones, by renames: put aside,
    moved in, and put back if a rename fails; the earlier files are deleted last."""
    replaced = staging.with_name(f"{staging.name}-replaced")
    replaced.mkdir()
    old, new = [], []
    try:
        for path in [p for p in out.iterdir() if p.name in EXPORT_NAMES]:
            path.rename(replaced / path.name)
            old.append(path.name)
        for path in list(staging.iterdir()):
            path.rename(out / path.name)
            new.append(path.name)
    except BaseException:
        for name in new:
            (out / name).rename(staging / name)
        for name in old:
            (replaced / name).rename(out / name)
        shutil.rmtree(replaced, ignore_errors=True)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
    staging.rmdir()


def check_earlier_export(out: Path) -> None:
    """Refuse a folder `out` that is neither empty nor an earlier export (which the new export
    replaces whole: one of another target left its weights beside the new ones, and an engine
    may read either). A refused folder is left untouched."""
    present = sorted(p.name for p in out.iterdir() if WORK_PREFIX not in p.name)
    other = sorted(set(present) - EXPORT_NAMES)
    if other:
        raise ExportError(
            f"--out {out} holds files an export does not write ({', '.join(other[:5])}): give "
            "an empty or new folder"
        )
    if present and EXPORT_MARK not in present:
        raise ExportError(
            f"--out {out} holds {', '.join(present)} but no {EXPORT_MARK}, so no export wrote "
            "it (a heads folder saved by save_pretrained or training looks the same): give an "
            "empty or new folder, or remove it yourself if it is an export of an older headstart"
        )


def _stored_dtype(folder: Path) -> torch.dtype | None:
    """The floating dtype of a folder's safetensors weights (read from their headers)."""
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                dtype = names.get(f.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    return None


def _sglang_eagle1(out: Path) -> None:
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
    write_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _tgi_base_name(given: str | None, recorded: str) -> str:
    """The base TGI is to load (it reads the heads' base_model_name_or_path): `given` (the
    --base-name flag) or the recorded name; none is refused, a name without an owner or a
    local path is warned about (TGI may not see it; an old Hub id such as gpt2 is one)."""
    name = given or recorded
    told = (
        f"--base-name {name!r}" if given else f"these heads record {name!r} as their base"
    ) + ", which TGI loads from the heads' base_model_name_or_path"
    if not name:
        raise ExportError(
            f"{told}: pass the base's Hub id or path as TGI sees it (--base-name, e.g. "
            "--base-name HuggingFaceTB/SmolLM2-135M-Instruct)"
        )
    local = name.startswith((".", "/", "~")) or Path(name).expanduser().exists()
    if local or "/" not in name:
        warnings.warn(
            f"{told}: {'a local path' if local else 'a name without an owner'}; unless TGI "
            "loads it as it is, pass the base's Hub id (--base-name)",
            stacklevel=3,
        )
    return name


def _write_medusa_lm_head(
    heads: MedusaHeads, target: str, out: Path, base_name: str | None = None
) -> None:
    cfg = heads.config
    if cfg.original_lm_head:
        raise ExportError(
            f"{target} needs one lm_head per Medusa head, but these heads share the base's "
            "lm_head (original_lm_head); train with own lm_heads (heads.shared_lm_head=false)"
        )
    if cfg.truncated_vocab_size is not None:
        raise ExportError(
            f"{target} has no reduced draft vocabulary (token_map); train with the full vocabulary "
            "(heads.draft_vocab_size=null), or export to vllm"
        )
    if target == "tgi":
        base_name = _tgi_base_name(base_name, cfg.base_model_name_or_path)
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
    write_safetensors(tensors, out / "medusa_lm_head.safetensors")
    config = {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": L,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "base_model_name_or_path": base_name or cfg.base_model_name_or_path,
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
