"""The base's features on disk for offline training (`training.feature_cache: DIR`).

One teacher-forced forward of the frozen base per example gives "hidden" (the final-norm output
the lm_head reads), "top" (the base's greedy token at each position) and, for EAGLE-3, "aux" (the
states entering the aux layers). They are stored once as safetensors shards (features in bf16,
tokens in int32) and read back lazily (memory-mapped slices), so a resumed run, a longer second
run, or the other recipe on the same data never runs the base again, and a large set needs disk
rather than memory. Layout of DIR (a folder every process can read):

- `features.json`: what the features are of (base model, a fingerprint of its weights, dtype,
  hidden size, aux layers).
- `features-r{RANK}-{RUN}-{N}.safetensors`: tensors "hidden" (tokens, H), "top" (tokens,) and
  "aux" (tokens, 3H) of many examples end to end (shards made before "top" existed lack it:
  training then computes it in each step); the metadata entry "index" lists [key, first row,
  rows] per example, where the key hashes the example's token ids. RUN is new for every fill,
  so two runs filling one folder never write the same file. Shards are fsynced under a
  temporary name and renamed, so a killed run loses only the shard it was filling and a rerun
  computes the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from safetensors import safe_open

from heads.checkpoint import write_safetensors
from train.distilled import write_atomic
from train.features import feature_batches

FORMAT = "headstart-features-1"
MANIFEST = "features.json"
SHARD_BYTES = 1 << 30
STALE_ELSEWHERE_SECONDS = 3600  # another machine's temporary shard this old is a killed fill's


class FeatureCacheError(ValueError):
    """A cache made for another base / aux layers, or not enough disk for it."""


def example_key(input_ids: Sequence[int]) -> str:
    return hashlib.sha1(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


class FeatureCache(Sequence):
    """The cached features of `examples`, in their order: cache[i] -> {"hidden": (T_i, H), ...}
    in `dtype` ("top" (T_i,) as token ids), read from the shards on demand (only `names`, those
    the recipe uses)."""

    def __init__(
        self,
        cache_dir: str | Path,
        examples: Sequence[dict],
        dtype: torch.dtype,
        names: Sequence[str] = ("hidden", "aux", "top"),
    ):
        self.cache_dir, self.dtype, self.names = Path(cache_dir), dtype, names
        self.keys = [example_key(e["input_ids"]) for e in examples]
        self.where = read_index(self.cache_dir)
        missing = [k for k in self.keys if k not in self.where]
        if missing:
            raise FeatureCacheError(
                f"{len(missing)} examples have no features in {cache_dir}: run fill_cache first"
            )
        self._files: dict[str, object] = {}

    def _open(self, shard: str):
        """A shard's file, opened once (memory-mapped)."""
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = safe_open(self.cache_dir / shard, framework="pt")
        return f

    def lacks_greedy_tokens(self) -> int:
        """How many of the examples have no "top" (shards written before it existed)."""
        shards = [self.where[k][0] for k in self.keys]
        old = {s for s in set(shards) if "top" not in self._open(s).keys()}  # noqa: SIM118
        return sum(s in old for s in shards)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, start, rows = self.where[self.keys[i]]
        f = self._open(shard)
        stored = f.keys()  # "hidden", "top", and "aux" for EAGLE-3
        return {
            name: f.get_slice(name)[start : start + rows].to(
                torch.long if name == "top" else self.dtype
            )
            for name in self.names
            if name in stored
        }


def read_index(cache_dir: Path) -> dict[str, tuple[str, int, int]]:
    """key -> (shard file name, first row, rows) over every shard in the folder."""
    where: dict[str, tuple[str, int, int]] = {}
    for path in sorted(cache_dir.glob("features-r*.safetensors")):
        try:
            with safe_open(path, framework="pt") as f:
                index = json.loads(f.metadata()["index"])
        except Exception as e:  # safetensors raises its own error types
            raise FeatureCacheError(
                f"{path} is unreadable ({e}); delete it and rerun to compute its examples again"
            ) from e
        for key, start, rows in index:
            where[key] = (path.name, start, rows)
    return where


def _read_identity(cache_dir: Path) -> dict | None:
    path = cache_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        identity = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        identity = e
    if not isinstance(identity, dict):  # written whole (renamed into place): damaged since
        raise FeatureCacheError(
            f"{path} is damaged ({identity}): it says what the cached features are of, so the "
            "cache cannot be checked; delete the folder to compute the features again"
        )
    return identity


def cache_base_dtype(cache_dir: str | Path) -> str | None:
    """The dtype of the base whose features `cache_dir` holds; None for no cache there yet."""
    identity = _read_identity(Path(cache_dir))
    return identity.get("base_dtype") if identity else None


# Keys a cache made by an earlier headstart may lack: not a difference of setup.
ADDED_KEYS = ("base_weights",)


def weights_fingerprint(model: torch.nn.Module, per_tensor: int = 64) -> str:
    """A hash of `per_tensor` evenly spaced values of every parameter: another base under the
    same name (re-exported, fine-tuned in place, a LoRA merged) tells itself apart."""
    digest = hashlib.sha1()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // per_tensor)][:per_tensor]
            digest.update(name.encode())
            digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def ensure_identity(cache_dir: Path, identity: dict) -> None:
    """Write features.json for a new cache; refuse a cache made with other settings."""
    old = _read_identity(cache_dir)
    if old is None:
        write_atomic(cache_dir / MANIFEST, json.dumps(identity, indent=2))
        return
    diffs = [
        f"{k}: {old.get(k)!r} there, {v!r} now"
        for k, v in identity.items()
        if old.get(k) != v and not (k in ADDED_KEYS and k not in old)
    ]
    if diffs:
        # a cache without aux layers (Medusa's, EAGLE-1's) for EAGLE-3, all else the same
        first = (
            " (train EAGLE-3 first: its cache serves Medusa too)"
            if len(diffs) == 1 and not old.get("aux_layer_ids") and identity.get("aux_layer_ids")
            else ""
        )
        raise FeatureCacheError(
            f"{cache_dir} holds features of another setup ({'; '.join(diffs)}): "
            f"point training.feature_cache at a new folder{first}"
        )


def bytes_per_token(hidden_size: int, with_aux: bool) -> int:
    return 2 * hidden_size * (4 if with_aux else 1) + 4  # bf16 H ("hidden"), 3H ("aux"); int32


@torch.no_grad()
def fill_cache(
    base: torch.nn.Module,
    examples: Sequence[dict],
    aux_layer_ids: Sequence[int],
    cache_dir: str | Path,
    *,
    base_name: str,
    batch_size: int,
    pad_token_id: int,
    accelerator,  # an Accelerator or PartialState
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """Compute the features the cache lacks (each process a share of them) and write them.
    The main process decides what is missing and whether it fits, and tells the others."""
    cache_dir = Path(cache_dir)
    hidden_size = base.config.hidden_size
    made = _read_identity(cache_dir)
    if not aux_layer_ids and made and made.get("aux_layer_ids"):
        # A cache made for EAGLE-3 also serves a recipe that reads "hidden" only (Medusa);
        # what this run adds must have the same tensors as the rest.
        aux_layer_ids = made["aux_layer_ids"]
    identity = {
        "format": FORMAT,
        "base_model": base_name,
        "base_weights": weights_fingerprint(base),
        "base_dtype": str(base.dtype).removeprefix("torch."),
        "hidden_size": hidden_size,
        "aux_layer_ids": list(aux_layer_ids),
        "dtype": "bfloat16",
    }
    plan = [None, None]  # [missing keys, error message]
    if accelerator.is_main_process:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            ensure_identity(cache_dir, identity)
            plan = _plan(cache_dir, examples, bytes_per_token(hidden_size, bool(aux_layer_ids)))
            accelerator.print(plan.pop())
        except FeatureCacheError as e:
            plan = [None, str(e)]
    missing, error = broadcast_object_list(plan, from_process=0)
    if error:  # every process stops, none waits for the others
        raise FeatureCacheError(error)
    _remove_stale_tmp(cache_dir)
    todo = {example_key(e["input_ids"]): e for e in examples}
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = [todo[k] for k in missing[rank::world]]
    shard = _ShardBuffer(cache_dir, rank, shard_bytes)
    batches = feature_batches(
        base,
        mine,
        aux_layer_ids,
        batch_size,
        pad_token_id,
        desc="base features -> cache",
        disable_progress=not accelerator.is_main_process,
    )
    for idx, feats in batches:
        for b, i in enumerate(idx):
            n = len(mine[i]["input_ids"])
            shard.add(example_key(mine[i]["input_ids"]), {k: v[b, :n] for k, v in feats.items()})
    shard.flush()
    accelerator.wait_for_everyone()


def _plan(cache_dir: Path, examples: Sequence[dict], per_token: int) -> list:
    """[keys of the distinct examples without features, None (no error), a line to print]."""
    have = read_index(cache_dir)
    missing: dict[str, int] = {}  # key -> tokens, each distinct token sequence once
    for e in examples:
        key = example_key(e["input_ids"])
        if key not in have:
            missing[key] = len(e["input_ids"])
    need, free = sum(missing.values()) * per_token, shutil.disk_usage(cache_dir).free
    if need > free:
        raise FeatureCacheError(
            f"the feature cache needs {need / 2**30:.2f} GiB but {cache_dir} has "
            f"{free / 2**30:.2f} GiB free: free some space, point training.feature_cache "
            "elsewhere, or unset it to keep the features in memory"
        )
    line = (
        f"feature cache {cache_dir}: {len(have)} examples cached, {len(missing)} to compute, "
        f"{need / 2**30:.2f} GiB more at {per_token / 1024:.1f} KiB per token "
        f"({free / 2**30:.1f} GiB free)"
    )
    return [list(missing), None, line]


def _remove_stale_tmp(cache_dir: Path) -> None:
    """Temporary shards of killed fills: this machine's whose process is gone, and another
    machine's (on shared storage: its process ids mean nothing here) once an hour old, far longer
    than a shard takes to write (a container's or VM's next life has another host name)."""
    here = socket.gethostname()
    for tmp in cache_dir.glob(".features-*.tmp"):  # .NAME.HOST.PID.tmp (.NAME.PID.tmp before)
        host, _, pid = tmp.name.removesuffix(".tmp").partition(".safetensors.")[2].rpartition(".")
        if host not in ("", here):
            try:
                if time.time() - tmp.stat().st_mtime > STALE_ELSEWHERE_SECONDS:
                    tmp.unlink(missing_ok=True)
            except FileNotFoundError:  # renamed into place meanwhile
                pass
            continue
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            tmp.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            pass


class _ShardBuffer:
    """Rows of finished examples, written as one atomic shard once `limit` bytes are held."""

    def __init__(self, cache_dir: Path, rank: int, limit: int):
        self.cache_dir, self.limit = cache_dir, limit
        self.prefix = f"features-r{rank:03d}-{uuid.uuid4().hex[:12]}"
        self.next_index = 0
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.index: list[tuple[str, int, int]] = []
        self.count = self.bytes = 0

    def add(self, key: str, feats: dict[str, torch.Tensor]) -> None:
        """One example's features, {name: (T, D) or (T,)}."""
        n = next(iter(feats.values())).shape[0]
        for name, value in feats.items():
            value = value.to("cpu", torch.int32 if name == "top" else torch.bfloat16)
            self.rows.setdefault(name, []).append(value)
            self.bytes += value.numel() * value.element_size()
        self.index.append((key, self.count, n))
        self.count += n
        if self.bytes >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.index:
            return
        name = f"{self.prefix}-{self.next_index:05d}.safetensors"
        tmp = self.cache_dir / f".{name}.{socket.gethostname()}.{os.getpid()}.tmp"
        tensors = {k: torch.cat(v).contiguous() for k, v in self.rows.items()}  # (rows, D)
        write_safetensors(tensors, tmp, metadata={"index": json.dumps(self.index)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        tmp.replace(self.cache_dir / name)
        self.next_index += 1
        self.rows, self.index, self.count, self.bytes = {}, [], 0, 0
