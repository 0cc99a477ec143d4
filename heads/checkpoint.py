"""Saving and loading heads folders: config.json + model.safetensors (+ a model card).

Only safetensors are read: nothing is unpickled and no remote code runs. Every tensor is checked
against the module built from config.json (missing, unexpected and misshaped tensors are errors
naming the tensor) before anything is copied in, so a bad folder never half-loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from heads.base import check_model, hub_offline, input_device, is_repo_id, parameter_values
from heads.cpu import PackedLinear, prepack_linear_weights
from heads.placement import floating_dtype, usable_device

WEIGHTS_NAME = "model.safetensors"
# Other layouts load_heads reads, which a re-save in place replaces: shards, TGI's Medusa file
LOADED_LAYOUTS = re.compile(r"model-\d+-of-\d+\.safetensors|medusa_lm_head\.safetensors")
CONFIG_NAME = "config.json"


class PretrainedHeads(nn.Module):
    """Mixin for head modules: `save_pretrained`, `push_to_hub`, `from_pretrained`."""

    config = None  # set by subclasses

    def save_pretrained(self, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write config.json, model.safetensors and README.md into `folder`, atomically. A model
        card written by hand is kept: `folder`'s own where it holds heads of this kind for this
        base, else the one beside the weights these heads were loaded from; otherwise headstart
        writes its own.

        Args:
            dtype: cast floating tensors (e.g. torch.bfloat16 to halve the size); default: as is.
        """
        from heads.hub import hand_written_card, model_card

        folder = Path(folder)
        adapter = self._base_adapter(folder)  # Medusa-2: checked before anything is written
        replaced = self._other_weights(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp"))
        try:
            tensors = {}
            for name, t in self.state_to_save().items():
                t = t.detach().to("cpu")
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                tensors[name] = t.contiguous().clone()
            write_safetensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
            self.config.save(tmp)
            floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
            if floats:  # engines read the checkpoint dtype from config.json
                config = json.loads((tmp / CONFIG_NAME).read_text())
                config["torch_dtype"] = str(floats[0]).removeprefix("torch.")
                (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            card = hand_written_card(folder, getattr(self, "source_folder", None), self.config)
            (tmp / "README.md").write_text(card or model_card(self.config))
            folder.mkdir(parents=True, exist_ok=True)
            for f in tmp.iterdir():  # os.replace per file: readers never see a torn file
                os.replace(f, folder / f.name)
            for f in replaced:  # these heads' own weights, now in model.safetensors
                f.unlink()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if adapter is not None:
            shutil.copytree(adapter, folder / self.config.base_lora, dirs_exist_ok=True)
        return folder

    def _other_weights(self, folder: Path) -> list[Path]:
        """Weights files in `folder` that loaders would read beside the model.safetensors saved
        there: a shard index (vLLM and transformers read the shards it names, not the new file)
        is replaced; shards and TGI's file too when they are the ones these heads were loaded
        from (a re-save in place). Any other .safetensors file is refused."""
        index = folder / "model.safetensors.index.json"
        found = sorted(p for p in folder.glob("*.safetensors") if p.name != WEIGHTS_NAME)
        source = getattr(self, "source_folder", None)
        in_place = source is not None and Path(source).resolve() == folder.resolve()
        own = [p for p in found if in_place and LOADED_LAYOUTS.fullmatch(p.name)]
        others = [p.name for p in found if p not in own]
        if others:
            raise ValueError(
                f"{folder} holds {', '.join(others)}, which load_heads would read beside the "
                "model.safetensors saved there: save into another folder, or move those out"
            )
        return own + ([index] if index.is_file() else [])

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | os.PathLike, base: nn.Module | None = None, **kwargs
    ) -> PretrainedHeads:
        """`load_heads(path_or_repo_id, base, **kwargs)`, for heads of this class only."""
        heads = load_heads(path_or_repo_id, base, **kwargs)
        if not isinstance(heads, cls):
            kind = type(heads).__name__
            raise TypeError(
                f"{path_or_repo_id} holds {kind}, not {cls.__name__}: load it with "
                f"{kind}.from_pretrained or load_heads"
            )
        return heads

    def state_to_save(self) -> dict[str, torch.Tensor]:
        """The tensors `save_pretrained` writes, as the engines read them (the state dict)."""
        return self.state_dict()

    def _base_adapter(self, folder: Path) -> Path | None:
        """Medusa-2 heads read their base with a LoRA adapter (`config.base_lora`), which the
        heads module does not hold: the folder it was loaded from has it (copied from there), or
        `folder` already does (training writes it first); else saving would lose it."""
        lora = getattr(self.config, "base_lora", "")
        if not lora:
            return None
        source = getattr(self, "source_folder", None)
        if source is not None and (Path(source) / lora).is_dir():
            same = (Path(source) / lora).resolve() == (folder / lora).resolve()
            return None if same else Path(source) / lora
        if (folder / lora).is_dir():
            return None
        raise ValueError(
            f"these Medusa-2 heads read the base with the LoRA adapter that belongs in their "
            f"'{lora}' folder, and neither {folder} nor the folder they were loaded from has "
            f"it: save the adapter there first (peft's save_pretrained to {folder / lora}), or "
            "load the heads with load_heads from the folder that holds it"
        )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload headstart heads",
        revision: str | None = None,
        create_pr: bool = False,
    ) -> str:
        """Save to a temporary folder and upload it to the Hugging Face Hub; returns the URL
        (`heads.hub.push_folder`: `revision` a branch, made when new; `create_pr` opens a pull
        request instead of committing)."""
        from heads.hub import push_folder

        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return push_folder(
                tmp,
                repo_id,
                private=private,
                token=token,
                commit_message=commit_message,
                revision=revision,
                create_pr=create_pr,
            )


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """`safetensors.torch.save_file`, readable by others as any file this process writes."""
    save_file(tensors, path, metadata=metadata)
    as_new_file(path)


def as_new_file(path: Path) -> None:
    """Give a file the mode any new file of this process takes (0644 under the usual umask):
    safetensors 0.8 (and peft through it) leaves its files owner-only (0600), which a server
    running as another user (a container) cannot read. Best effort: a mount that refuses
    chmod keeps the file as written."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it where Linux tells it (setting it, even
    back at once, would give another thread's new file the wrong mode meanwhile)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def read_config(folder: Path) -> dict:
    path = config_path(folder)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object of settings")
    return data


def config_path(folder: Path) -> Path:
    """A heads folder's config.json, or a FileNotFoundError that says what the folder is
    instead (a training run's, one of its checkpoints) and where its heads are."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        if (folder / "heads" / CONFIG_NAME).is_file():  # a training run's output.dir
            raise FileNotFoundError(
                f"{folder} is a training run's folder: its heads are in {folder / 'heads'}"
            )
        if (folder / "trainer_state.json").is_file():  # one of a run's checkpoints/step-N
            raise FileNotFoundError(
                f"{folder} is a training checkpoint, not a heads folder: a run writes its heads "
                "to OUTPUT/heads when it ends; go on training from the checkpoint with "
                f"training.resume={folder}"
            )
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}; is it a heads folder?")
    return path


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a heads folder's safetensors file(s); refuses pickled checkpoints."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} has no .safetensors weights.{pickle_hint(p.name for p in folder.iterdir())}"
        )
    tensors: dict[str, torch.Tensor] = {}
    file_of: dict[str, Path] = {}
    for f in files:
        try:
            part = load_file(f)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(
                f"{f} is unreadable or truncated ({e}); re-download or re-save it"
            ) from e
        # a leftover other copy (model_v2.safetensors): which one is meant is not known (the
        # same values twice, a consolidated file beside its shards, are the same weights)
        twice = sorted(n for n in part if n in tensors and not torch.equal(tensors[n], part[n]))
        if twice:
            more = f" ({len(twice)} such names)" if len(twice) > 1 else ""
            raise ValueError(
                f"{folder} holds tensor {twice[0]!r} in both {file_of[twice[0]].name} and "
                f"{f.name}, with other values{more}: move the file that is not these heads' "
                "weights out of the folder"
            )
        tensors.update(part)
        file_of.update(dict.fromkeys(part, f))
    return tensors


def load_state_checked(
    module: nn.Module, tensors: dict[str, torch.Tensor], where: str, optional: tuple[str, ...] = ()
) -> None:
    """Copy `tensors` into `module` after checking names and shapes; nothing changes on error."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in tensors and k not in optional]
    unexpected = [k for k in tensors if k not in expected]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    for k, t in tensors.items():
        if k in expected and tuple(t.shape) != tuple(expected[k].shape):
            problems.append(
                f"tensor {k} has shape {tuple(t.shape)}, config says {tuple(expected[k].shape)}"
            )
    if problems:
        raise ValueError(f"{where} does not match its config.json: " + "; ".join(problems))
    with torch.no_grad():
        for k, t in tensors.items():
            expected[k].copy_(t.to(expected[k].dtype))


PICKLED = (".bin", ".pt", ".pth", ".ckpt")


def pickle_hint(names) -> str:
    """What to do with the pickled checkpoints among file `names` ("" when there are none)."""
    pickled = [n for n in names if Path(n).suffix in PICKLED]
    if not pickled:
        return ""
    return (
        f" Found {', '.join(pickled)}: pickled checkpoints are never loaded (they can run code). "
        "Convert it once, in an environment you trust, with "
        "safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')."
    )


def resolve_folder(
    path_or_repo_id: str | os.PathLike,
    revision: str | None = None,
    token: str | None = None,
    **download,
) -> Path:
    """A local folder as is, else download a Hub repo's config, weights and card (`download`:
    huggingface_hub's snapshot_download options, cache_dir, local_files_only, force_download)."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        config_path(path)  # a training run's folder, or a checkpoint: said before any loading
        if revision is not None:  # a folder here named like a repo id is read as it is
            warnings.warn(
                f"{path_or_repo_id} is a local folder: revision={revision!r} is for Hub repos "
                "and is not applied",
                stacklevel=3,
            )
        return path
    if path.is_file():
        raise FileNotFoundError(
            f"{path_or_repo_id} is a file: give the heads folder (the one with {CONFIG_NAME})"
        )
    if not is_repo_id(str(path_or_repo_id)):
        raise FileNotFoundError(f"heads folder not found: {path_or_repo_id}")
    from huggingface_hub import list_repo_files, snapshot_download

    repo_id = str(path_or_repo_id)
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                token=token,
                # lora/: Medusa-2 adapter (heads/lora.py), its config a JSON file
                allow_patterns=[CONFIG_NAME, "*.safetensors", "README.md", "lora/*"],
                **download,
            )
        )
    except (OSError, ValueError) as e:  # no such repo, no network, a gated repo without token
        raise FileNotFoundError(
            f"heads not found: {repo_id} is not a local folder, and the Hub gave: {e}"
        ) from e
    if any(folder.glob("*.safetensors")):
        return folder
    if hub_offline() or download.get("local_files_only"):  # the snapshot of the cache
        raise FileNotFoundError(
            f"the cached copy of {repo_id} ({folder}) has no .safetensors weights (a download "
            "cut short?): download it again online (unset HF_HUB_OFFLINE, or "
            "local_files_only=False)"
        )
    # Pickled weights are not downloaded (they are never loaded): name them from the listing.
    try:
        hint = pickle_hint(list_repo_files(repo_id, revision=revision, token=token))
    except Exception:  # huggingface_hub's and httpx's: the listing only adds a hint
        hint = ""
    raise FileNotFoundError(f"the Hub repo {repo_id} has no .safetensors weights.{hint}")


def read_heads_folder(folder: Path, base_layers: int | None = None):
    """(config, tensors) of a heads folder in any layout `load_heads` reads: headstart's (vLLM's
    Medusa, the engines' EAGLE), Medusa's reference / TGI `medusa_lm_head`, EAGLE's reference
    EAGLE-1 and other trainers' EAGLE-3. What a folder leaves out is completed as the engines
    do (the base's sizes from the heads' own, `base_layers` for EAGLE-3's default aux layers, an
    EAGLE-1 fc bias from the tensors), and tensors the heads do not hold are dropped."""
    from heads.eagle_config import EagleConfig
    from heads.medusa import MedusaConfig, engine_medusa_keys, read_medusa_lm_head, read_vllm_medusa

    raw = read_config(folder)  # the config is checked before the weights are read
    listed = "medusa_num_heads" in raw  # the reference / TGI key (vLLM reads it as num_heads)
    config = None
    if raw.get("model_type") == "medusa" or "MedusaModel" in (raw.get("architectures") or []):
        config = MedusaConfig.from_dict(engine_medusa_keys(raw))
    elif raw.get("model_type") == "llama" and raw.get("num_hidden_layers") == 1:
        config = EagleConfig.from_dict(raw, base_layers)
    elif not listed:
        raise ValueError(
            f"{folder}/{CONFIG_NAME} is neither Medusa heads (model_type 'medusa') nor an EAGLE "
            f"draft layer (a 1-layer llama config); got model_type={raw.get('model_type')!r}"
        )
    if config is not None:
        config.validate()  # a newer format is refused before its keys are read another way
    tensors = read_tensors(folder)
    if listed and any(name.split(".", 1)[0].isdigit() for name in tensors):
        return read_medusa_lm_head(raw, tensors, str(folder))  # `{h}.{l}.linear.weight`
    if config is None or isinstance(config, MedusaConfig):  # vLLM's tensor names
        config, tensors = read_vllm_medusa(raw, config, tensors, f"{folder}/{CONFIG_NAME}")
    if isinstance(config, EagleConfig):
        if config.version == 1:  # EAGLE's reference trains an fc bias its config need not name
            bias = tensors.get("fc.bias")
            if bias is not None and not bias.any():  # an SGLang export's zero bias: none
                del tensors["fc.bias"]
            config.fc_bias = "fc.bias" in tensors
        # Some trainers (SpecForge) also save the base's embeddings; the draft reads the base's.
        tensors.pop("embed_tokens.weight", None)
        for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
            del tensors[name]  # older transformers saved the rope frequencies; made from config
    # Folders from other trainers record no base: their own sizes are the base's.
    if not config.base_hidden_size:
        config.base_hidden_size = int(raw.get("target_hidden_size") or raw.get("hidden_size") or 0)
    if not config.base_vocab_size:
        config.base_vocab_size = int(raw.get("vocab_size") or 0)
    return config, tensors


def load_heads(
    path_or_repo_id: str | os.PathLike,
    base: nn.Module | None = None,
    *,
    revision: str | None = None,
    token: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
):
    """Load Medusa heads or an EAGLE draft layer from a folder or a Hub repo id (downloaded with
    `revision`, `token`, `cache_dir`, `local_files_only` and `force_download` as
    huggingface_hub's snapshot_download takes them).

    The class is chosen from config.json (`model_type: medusa`; `LlamaForCausalLMEagle3`; a
    1-layer Llama = EAGLE-1). With `base`, the heads are checked against it (hidden size, vocab
    size, layer count must match what they were trained on), moved to its device and dtype, and
    a shared Medusa lm_head is tied to the base's. Without `base`, in `dtype` or else as stored
    (`dtype` a torch dtype or its name, "bfloat16"; `device` one torch can use here).
    """
    from heads.eagle import EagleDraft, check_vocab_map, t2d_from_d2t
    from heads.lora import warn_unless_merged
    from heads.medusa import MedusaConfig, MedusaHeads, check_token_map

    if base is not None:
        check_model(base)
    dtype = floating_dtype(dtype, "'auto' (the base's, without one as stored)")
    device = usable_device(device) if device is not None else None
    folder = resolve_folder(
        path_or_repo_id,
        revision,
        token,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        force_download=force_download,
    )
    config, tensors = read_heads_folder(
        folder, base.config.num_hidden_layers if base is not None else None
    )
    module = MedusaHeads(config) if isinstance(config, MedusaConfig) else EagleDraft(config)
    if base is not None:
        config.check_base(base.config)
        warn_unless_merged(config, base, str(path_or_repo_id))
    optional: tuple[str, ...] = ()
    if isinstance(module, MedusaHeads) and config.original_lm_head:
        # vLLM also accepts the shared head under `lm_heads.0.weight`.
        if "lm_head.weight" not in tensors and "lm_heads.0.weight" in tensors:
            tensors["lm_head.weight"] = tensors.pop("lm_heads.0.weight")
        if base is not None:
            optional = ("lm_head.weight",)
        missing_head = "lm_head.weight" not in tensors and "token_map" in tensors
        if module.token_map is not None and missing_head and base is not None:
            head = next(n for n, m in base.named_modules() if m is base.get_output_embeddings())
            weight = parameter_values(base, f"{head}.weight")  # an offloaded one from its hook
            tensors["lm_head.weight"] = weight[tensors["token_map"].to(weight.device)].cpu()
    whole_vocab = isinstance(module, EagleDraft) and config.draft_vocab_size == config.vocab_size
    if whole_vocab and config.version == 3:
        optional += ("d2t", "t2d")  # the whole vocabulary: the identity map, as engines read
    elif isinstance(module, EagleDraft) and "d2t" in tensors and "t2d" not in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], config.vocab_size)
    load_state_checked(module, tensors, str(folder), optional=optional)
    if isinstance(module, MedusaHeads) and module.token_map is not None:
        check_token_map(module.token_map, config.vocab_size, f"{folder}: token_map")
    if isinstance(module, EagleDraft) and config.version == 3:
        check_vocab_map(module.d2t, module.t2d)
    if base is not None:
        ref = next(base.parameters())  # its dtype (a weight offloaded to 'meta' keeps it)
        module.to(device=device or input_device(base), dtype=dtype or ref.dtype)
    else:  # as stored, as transformers 5 loads (dtype="auto"): a bf16 folder saves bf16 again
        stored = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
        module.to(device=device, dtype=dtype or stored)
    if isinstance(module, EagleDraft):  # rotary frequencies stay fp32, as in the base
        module.rotary_emb = type(module.rotary_emb)(module.llama_config).to(module.fc.weight.device)
    if base is not None:
        if isinstance(module, MedusaHeads) and config.original_lm_head and module.token_map is None:
            module.lm_head = base.get_output_embeddings()  # the base's module: one packed copy
        if any(isinstance(m, PackedLinear) for m in base.modules()):
            prepack_linear_weights(module)  # the draft runs every step too: same CPU fast path
    module.source_folder = folder  # a Medusa-2 adapter beside it is saved with the heads
    module.eval()
    return module
