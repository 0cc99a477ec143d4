"""The base's features on disk for offline training (`training.feature_cache: DIR`).

One teacher-forced forward of the frozen base per example gives "hidden" (the final-norm output
the lm_head reads) and, for EAGLE-3, "aux" (the states entering the aux layers). They are stored
once as bf16 safetensors shards and read back lazily (memory-mapped slices), so a resumed run,
a longer second run, or the other recipe on the same data never runs the base again, and a
large set needs disk rather than memory. Layout of DIR:

- `features.json`: what the features are of (base model and dtype, hidden size, aux layers).
- `features-r{RANK}-{N}.safetensors`: tensors "hidden" (tokens, H) and "aux" (tokens, 3H) of
  many examples end to end; the metadata entry "index" lists [key, first row, rows] per example,
  where the key hashes the example's token ids. Shards are written to a temporary file and
  renamed, so a killed run loses only the shard it was filling and a rerun computes the rest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from train.data import pad_batch
from train.features import base_features

FORMAT = "headstart-features-1"
MANIFEST = "features.json"
SHARD_BYTES = 1 << 30


class FeatureCacheError(ValueError):
    """A cache made for another base / aux layers, or not enough disk for it."""


def example_key(input_ids: Sequence[int]) -> str:
    return hashlib.sha1(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


class FeatureCache(Sequence):
    """The cached features of `examples`, in their order: cache[i] -> {"hidden": (T_i, H), ...}
    in `dtype`, read from the shards on demand (only `names`, those the recipe uses)."""

    def __init__(
        self,
        cache_dir: str | Path,
        examples: Sequence[dict],
        dtype: torch.dtype,
        names: Sequence[str] = ("hidden", "aux"),
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

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, start, rows = self.where[self.keys[i]]
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = safe_open(self.cache_dir / shard, framework="pt")
        stored = f.keys()  # "hidden", and "aux" for EAGLE-3
        return {
            name: f.get_slice(name)[start : start + rows].to(self.dtype)
            for name in self.names
            if name in stored
        }


def read_index(cache_dir: Path) -> dict[str, tuple[str, int, int]]:
    """key -> (shard file name, first row, rows) over every shard in the folder."""
    where: dict[str, tuple[str, int, int]] = {}
    for path in sorted(cache_dir.glob("features-r*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key, start, rows in json.loads(f.metadata()["index"]):
                where[key] = (path.name, start, rows)
    return where


def _read_identity(cache_dir: Path) -> dict | None:
    path = cache_dir / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def check_identity(cache_dir: Path, identity: dict) -> None:
    """Write features.json for a new cache; refuse a cache made with other settings."""
    path = cache_dir / MANIFEST
    old = _read_identity(cache_dir)
    if old is not None:
        diffs = [
            f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in identity.items() if old.get(k) != v
        ]
        if diffs:
            raise FeatureCacheError(
                f"{cache_dir} holds features of another setup ({'; '.join(diffs)}): "
                "point training.feature_cache at a new folder"
            )
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(identity, indent=2), encoding="utf-8")
    tmp.replace(path)


def bytes_per_token(hidden_size: int, with_aux: bool) -> int:
    return 2 * hidden_size * (4 if with_aux else 1)  # bf16: H for "hidden", 3H for "aux"


@torch.no_grad()
def fill_cache(
    base,
    examples: Sequence[dict],
    aux_layer_ids: Sequence[int],
    cache_dir: str | Path,
    *,
    base_name: str,
    batch_size: int,
    pad_token_id: int,
    accelerator,
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """Compute the features the cache lacks (each process a share of them) and write them."""
    cache_dir = Path(cache_dir)
    hidden_size = base.config.hidden_size
    identity = {
        "format": FORMAT,
        "base_model": base_name,
        "base_dtype": str(base.dtype).removeprefix("torch."),
        "hidden_size": hidden_size,
        "aux_layer_ids": list(aux_layer_ids),
        "dtype": "bfloat16",
    }
    rank, world = accelerator.process_index, accelerator.num_processes
    made = _read_identity(cache_dir)
    if not aux_layer_ids and made and made.get("aux_layer_ids"):
        # A cache made for EAGLE-3 also serves a recipe that reads "hidden" only (Medusa);
        # what this run adds must have the same tensors as the rest.
        aux_layer_ids = identity["aux_layer_ids"] = made["aux_layer_ids"]
    if accelerator.is_main_process:
        cache_dir.mkdir(parents=True, exist_ok=True)
        check_identity(cache_dir, identity)
    accelerator.wait_for_everyone()
    check_identity(cache_dir, identity)
    for stale in cache_dir.glob(f".features-r{rank:03d}-*.tmp"):  # left by a killed run
        stale.unlink()

    have = read_index(cache_dir)
    todo: dict[str, dict] = {}  # each missing token sequence once
    for e in examples:
        key = example_key(e["input_ids"])
        if key not in have:
            todo.setdefault(key, e)
    per_token = bytes_per_token(hidden_size, bool(aux_layer_ids))
    need = sum(len(e["input_ids"]) for e in todo.values()) * per_token
    free = shutil.disk_usage(cache_dir).free
    accelerator.print(
        f"feature cache {cache_dir}: {len(have)} examples cached, {len(todo)} to compute, "
        f"{need / 2**30:.2f} GiB more at {per_token / 1024:.1f} KiB per token "
        f"({free / 2**30:.1f} GiB free)"
    )
    if need > free:  # every process sees the same figures, so all of them stop
        raise FeatureCacheError(
            f"the feature cache needs {need / 2**30:.2f} GiB but {cache_dir} has "
            f"{free / 2**30:.2f} GiB free: free some space, point training.feature_cache "
            "elsewhere, or unset it to keep the features in memory"
        )
    mine = sorted(todo.items(), key=lambda kv: len(kv[1]["input_ids"]))[rank::world]  # less padding
    done = [int(p.stem.rsplit("-", 1)[1]) for p in cache_dir.glob(f"features-r{rank:03d}-*")]
    shard = _ShardBuffer(cache_dir, rank, max(done, default=-1) + 1, shard_bytes)
    device = next(base.parameters()).device
    bar = tqdm(
        total=sum(len(e["input_ids"]) for _, e in mine),
        unit="tok",
        desc="base features -> cache",
        disable=not accelerator.is_main_process,
    )
    with bar:
        for start in range(0, len(mine), batch_size):
            chunk = mine[start : start + batch_size]
            batch = pad_batch([e for _, e in chunk], pad_token_id)
            feats = base_features(
                base,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                aux_layer_ids,
            )
            for b, (key, e) in enumerate(chunk):
                shard.add(key, {k: v[b, : len(e["input_ids"])] for k, v in feats.items()})
            bar.update(sum(len(e["input_ids"]) for _, e in chunk))
    shard.flush()
    accelerator.wait_for_everyone()


class _ShardBuffer:
    """Rows of finished examples, written as one atomic shard once `limit` bytes are held."""

    def __init__(self, cache_dir: Path, rank: int, next_index: int, limit: int):
        self.cache_dir, self.rank, self.next_index, self.limit = cache_dir, rank, next_index, limit
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.index: list[tuple[str, int, int]] = []
        self.count = self.bytes = 0

    def add(self, key: str, feats: dict[str, torch.Tensor]) -> None:
        n = next(iter(feats.values())).shape[0]
        for name, value in feats.items():
            value = value.to("cpu", torch.bfloat16)
            self.rows.setdefault(name, []).append(value)
            self.bytes += value.numel() * 2
        self.index.append((key, self.count, n))
        self.count += n
        if self.bytes >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.index:
            return
        name = f"features-r{self.rank:03d}-{self.next_index:05d}.safetensors"
        tmp = self.cache_dir / f".{name}.tmp"
        tensors = {k: torch.cat(v).contiguous() for k, v in self.rows.items()}
        save_file(tensors, tmp, metadata={"index": json.dumps(self.index)})
        tmp.replace(self.cache_dir / name)
        self.next_index += 1
        self.rows, self.index, self.count, self.bytes = {}, [], 0, 0
