"""The on-disk feature cache of offline training: bf16 shards, lazy reads, resume, refusals."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from accelerate import PartialState
from safetensors import safe_open
from safetensors.torch import save_file

import train.feature_cache as fc
import train.features as features
from tests.conftest import make_tiny_llama
from train.features import ExampleDataset, base_features, collate

AUX = [0, 1, 1]  # states entering layers 0 and 1 of the 2-layer tiny Llama


@pytest.fixture(scope="module")
def base():
    return make_tiny_llama(seed=3)


def examples(n: int = 7, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (n,), generator=g).tolist()
    ids = [torch.randint(3, 256, (t,), generator=g).tolist() for t in lengths]
    return [{"input_ids": x, "loss_mask": [1] * len(x), "labels": x} for x in ids]


def fill(base, exs, cache_dir, aux=AUX, **kwargs):
    fc.fill_cache(
        base,
        exs,
        aux,
        cache_dir,
        base_name="tiny",
        batch_size=3,
        pad_token_id=0,
        accelerator=PartialState(),
        **kwargs,
    )


def expected(base, example, aux=AUX) -> dict[str, torch.Tensor]:
    ids = torch.tensor([example["input_ids"]])
    feats = base_features(base, ids, torch.ones_like(ids), aux)
    return {k: v[0].to(torch.bfloat16).float() for k, v in feats.items()}


def test_cached_features_are_the_bases_in_bf16(base, tmp_path):
    exs = examples()
    fill(base, exs, tmp_path, shard_bytes=4096)  # several shards
    assert len(list(tmp_path.glob("features-r000-*.safetensors"))) > 1
    assert not list(tmp_path.glob(".*tmp"))
    identity = json.loads((tmp_path / "features.json").read_text())
    assert identity["aux_layer_ids"] == AUX and identity["hidden_size"] == 64
    cache = fc.FeatureCache(tmp_path, exs, torch.float32)
    assert len(cache) == len(exs)
    for i in (0, 3, len(exs) - 1):
        got, want = cache[i], expected(base, exs[i])
        assert sorted(got) == ["aux", "hidden", "top"]
        assert got["hidden"].dtype == torch.float32
        # The base's greedy token at each position, kept exactly (int32 on disk).
        ids = torch.tensor([exs[i]["input_ids"]])
        greedy = base(input_ids=ids).logits[0].argmax(-1)
        assert got["top"].dtype == torch.long and torch.equal(got["top"], greedy)
        assert got["hidden"].shape == (len(exs[i]["input_ids"]), 64)
        assert got["aux"].shape == (len(exs[i]["input_ids"]), 3 * 64)
        # Padding in a batch leaves a row's features as they are alone (up to fp32 noise
        # that may flip a bf16 rounding).
        torch.testing.assert_close(got["hidden"], want["hidden"], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(got["aux"], want["aux"], atol=2e-2, rtol=1e-2)


def test_a_killed_fill_resumes_with_the_missing_examples_only(base, tmp_path, capsys, monkeypatch):
    exs = examples(9)
    fill(base, exs, tmp_path, shard_bytes=4096)
    before = fc.FeatureCache(tmp_path, exs, torch.float32)
    full = [before[i] for i in range(len(exs))]
    shards = sorted(tmp_path.glob("features-r000-*.safetensors"))
    lost = {k for k, _, _ in json.loads(_metadata(shards[-1])["index"])}
    shards[-1].unlink()  # the shard being filled when the run was killed
    here = socket.gethostname()
    dead = tmp_path / f".features-r000-0a1b2c-00003.safetensors.{here}.999999999.tmp"  # killed
    older = tmp_path / ".features-r000-0a1b2c-00004.safetensors.999999999.tmp"  # named w/o host
    live = tmp_path / f".features-r000-3d4e5f-00000.safetensors.{here}.{os.getpid()}.tmp"
    # another machine's on shared storage: its process ids are not this machine's to judge,
    # only its age (a fill killed there, an hour ago)
    elsewhere = tmp_path / ".features-r008-4f5e6d-00000.safetensors.node-b.lan.999999999.tmp"
    gone = tmp_path / ".features-r009-4f5e6d-00000.safetensors.node-c.999999999.tmp"
    for tmp in (dead, older, live, elsewhere, gone):
        tmp.write_bytes(b"half a shard")
    hour_ago = time.time() - fc.STALE_ELSEWHERE_SECONDS - 60
    os.utime(gone, (hour_ago, hour_ago))
    capsys.readouterr()

    calls = []
    real = features.base_features
    monkeypatch.setattr(
        features, "base_features", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw)
    )
    fill(base, exs, tmp_path, shard_bytes=4096)
    assert sum(calls) == len(lost)  # the rows of the lost shard, nothing else
    assert (
        f"{len(exs) - len(lost)} examples cached, {len(lost)} to compute" in capsys.readouterr().out
    )
    assert not dead.exists() and not older.exists() and not gone.exists()
    assert live.exists() and elsewhere.exists()
    after = fc.FeatureCache(tmp_path, exs, torch.float32)
    for i in range(len(exs)):
        for k in full[i]:
            torch.testing.assert_close(after[i][k], full[i][k], atol=2e-2, rtol=1e-2)

    calls.clear()
    fill(base, exs, tmp_path)  # complete: nothing to compute
    assert calls == []


def test_duplicates_are_computed_and_stored_once(base, tmp_path, capsys):
    exs = examples(4)
    fill(base, exs + exs[:3], tmp_path)
    assert "0 examples cached, 4 to compute" in capsys.readouterr().out
    (shard,) = tmp_path.glob("features-r000-*.safetensors")
    index = json.loads(_metadata(shard)["index"])
    assert len(index) == 4 and sum(rows for _, _, rows in index) == sum(
        len(e["input_ids"]) for e in exs
    )
    cache = fc.FeatureCache(tmp_path, exs + exs[:3], torch.float32)
    torch.testing.assert_close(cache[5]["hidden"], cache[1]["hidden"])


def test_an_unreadable_shard_names_itself(base, tmp_path):
    fill(base, examples(3), tmp_path)
    (tmp_path / "features-r000-ffffff-00000.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(
        fc.FeatureCacheError, match="ffffff-00000.safetensors is unreadable.*delete"
    ):
        fill(base, examples(3), tmp_path)


@pytest.mark.parametrize("damage", [b'{"base": "tiny", "dty', b"\xff\xfe", b"[1, 2]"])
def test_a_damaged_manifest_names_itself(base, tmp_path, damage):
    fill(base, examples(3), tmp_path)
    (tmp_path / fc.MANIFEST).write_bytes(damage)
    with pytest.raises(fc.FeatureCacheError, match="features.json is damaged.*delete the folder"):
        fill(base, examples(3), tmp_path)


def _metadata(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.metadata()


def test_a_cache_of_another_setup_is_refused(base, tmp_path):
    exs = examples(3)
    fill(base, exs, tmp_path)
    with pytest.raises(fc.FeatureCacheError, match="aux_layer_ids.*new folder") as refused:
        fill(base, exs, tmp_path, aux=[1, 1, 1])
    fill(base, exs + examples(2, seed=1), tmp_path, aux=[])  # "hidden" only: served, and
    cache = fc.FeatureCache(tmp_path, examples(2, seed=1), torch.float32, names=("hidden",))
    assert list(cache[1]) == ["hidden"]  # what it adds has the aux layers too
    assert list(fc.FeatureCache(tmp_path, examples(2, seed=1), torch.float32)[1]) == [
        "hidden",
        "aux",
        "top",
    ]
    with pytest.raises(fc.FeatureCacheError, match="no features"):
        fc.FeatureCache(tmp_path, examples(2, seed=2), torch.float32)
    assert "train EAGLE-3 first" not in str(refused.value)  # a cache with aux layers
    medusa = tmp_path / "medusa"
    fill(base, exs, medusa, aux=[])  # Medusa's: no aux layers, which an EAGLE-3 run needs
    with pytest.raises(fc.FeatureCacheError, match="new folder .train EAGLE-3 first: its cache"):
        fill(base, exs, medusa)


def test_another_base_under_the_same_name_is_refused(base, tmp_path):
    """A base re-exported under its old name (fine-tuned, a LoRA merged into one projection)
    has other features: its weights' fingerprint tells it apart."""
    fill(base, examples(3), tmp_path)
    other = make_tiny_llama(seed=3)
    with torch.no_grad():
        other.model.layers[1].self_attn.q_proj.weight.mul_(1.01)
    with pytest.raises(fc.FeatureCacheError, match="base_weights: .* there, .* now"):
        fill(other, examples(3), tmp_path)
    fill(make_tiny_llama(seed=3), examples(3), tmp_path)  # the same weights: served
    # a cache made before the fingerprint existed serves as before
    identity = json.loads((tmp_path / fc.MANIFEST).read_text())
    del identity["base_weights"]
    (tmp_path / fc.MANIFEST).write_text(json.dumps(identity))
    fill(other, examples(3), tmp_path)


def test_not_enough_disk_is_a_clear_error_before_any_work(base, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10**6, 10**6 - 100, 100))
    with pytest.raises(fc.FeatureCacheError, match="GiB free: free some space"):
        fill(base, examples(3), tmp_path)
    assert not list(tmp_path.glob("features-r*"))


def test_disk_estimate_is_printed_first(base, tmp_path, capsys):
    exs = examples(4)
    tokens = sum(len(e["input_ids"]) for e in exs)
    fill(base, exs, tmp_path / "plain", aux=[])
    out = capsys.readouterr().out
    assert "0 examples cached, 4 to compute" in out
    assert f"{tokens * (2 * 64 + 4) / 2**30:.2f} GiB more at 0.1 KiB per token" in out
    # bf16 features and the greedy token in int32: ~32 KB per token at H=4096
    assert fc.bytes_per_token(64, with_aux=False) == 2 * 64 + 4
    assert fc.bytes_per_token(4096, with_aux=True) == 32 * 1024 + 4


def test_a_cache_filled_before_greedy_tokens_existed_still_serves(base, tmp_path):
    """Shards without "top" (older caches) next to new ones: a batch mixing them holds only
    what all its examples have, and training computes the greedy token itself."""
    old, new = examples(3), examples(2, seed=1)
    fill(base, old, tmp_path)
    for shard in tmp_path.glob("features-r000-*.safetensors"):  # as written before "top"
        with safe_open(shard, framework="pt") as f:
            names = [k for k in f.keys() if k != "top"]  # noqa: SIM118 (not a dict)
            tensors = {k: f.get_tensor(k) for k in names}
            metadata = f.metadata()
        save_file(tensors, shard, metadata=metadata)
    fill(base, old + new, tmp_path)  # computes the 2 new examples only, with "top"
    cache = fc.FeatureCache(tmp_path, old + new, torch.float32)
    assert "top" not in cache[0] and "top" in cache[3]
    assert cache.lacks_greedy_tokens() == 3  # what training's note counts
    ds = features.ExampleDataset(old + new, cache)
    mixed = features.collate(ds, [0, 3], pad_token_id=0, device="cpu")
    assert sorted(mixed) == ["attention_mask", "aux", "hidden", "input_ids", "labels", "loss_mask"]
    fresh = features.collate(ds, [3, 4], pad_token_id=0, device="cpu")
    assert fresh["top"].shape == fresh["input_ids"].shape and fresh["top"].dtype == torch.long
    assert torch.equal(fresh["top"][0, : len(new[0]["input_ids"])], cache[3]["top"])


def test_a_single_example_without_features_is_refused_up_front(base, tmp_path):
    exs = examples(3)
    fill(base, exs, tmp_path)
    with pytest.raises(fc.FeatureCacheError, match=r"^1 examples have no features.*fill_cache"):
        fc.FeatureCache(tmp_path, [*exs, examples(1, seed=5)[0]], torch.float32)


def test_the_disk_check_counts_the_aux_states_of_eagle3(base, tmp_path, monkeypatch):
    """EAGLE-3's cache holds 3H aux values per token beside H hidden: the disk check must count
    them (4x the bytes), or a disk with room for "hidden" only fills up mid-way."""
    exs = examples(4)
    tokens = sum(len(e["input_ids"]) for e in exs)
    hidden_only, with_aux = fc.bytes_per_token(64, False), fc.bytes_per_token(64, True)
    assert with_aux > hidden_only
    Usage = namedtuple("Usage", "total used free")
    free = tokens * (hidden_only + with_aux) // 2  # room for "hidden", not for "aux" too
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10**12, 10**12 - free, free))
    with pytest.raises(fc.FeatureCacheError, match="GiB free: free some space"):
        fill(base, exs, tmp_path / "eagle3", aux=AUX)
    assert not list((tmp_path / "eagle3").glob("features-r*"))
    fill(base, exs, tmp_path / "medusa", aux=[])  # "hidden" only: fits


def test_a_fill_killed_while_writing_a_shard_leaves_no_shard_under_its_name(
    base, tmp_path, monkeypatch
):
    """A shard is written under a temporary name and renamed: killed mid-write, the cache holds
    no torn shard (which read_index would refuse), and the rerun computes the examples."""
    exs = examples(3)
    real = fc.write_safetensors

    def killed_mid_write(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr(fc, "write_safetensors", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        fill(base, exs, tmp_path)
    assert not list(tmp_path.glob("features-r*.safetensors"))
    monkeypatch.setattr(fc, "write_safetensors", real)
    fill(base, exs, tmp_path)  # no "unreadable shard" error
    cache = fc.FeatureCache(tmp_path, exs, torch.float32)
    assert cache[2]["hidden"].shape == (len(exs[2]["input_ids"]), 64)


def test_the_cache_records_the_dtype_of_the_base_it_was_filled_with(tmp_path):
    """A run under model.dtype=auto keeps the dtype of the cache it builds on
    (train.checkpoint.built_on_dtype reads it back): the cache must record it."""
    from train.checkpoint import built_on_dtype

    exs = examples(2)
    fill(make_tiny_llama(seed=3), exs, tmp_path / "fp32")
    fill(make_tiny_llama(seed=3).to(torch.bfloat16), exs, tmp_path / "bf16")
    assert fc.cache_base_dtype(tmp_path / "fp32") == "float32"
    assert fc.cache_base_dtype(tmp_path / "bf16") == "bfloat16"
    assert built_on_dtype(None, str(tmp_path / "bf16"), torch.device("cpu")) == "bfloat16"


def test_a_batch_whose_first_example_has_greedy_tokens_leaves_them_out_for_all():
    examples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9], "loss_mask": [0, 1], "labels": [-100, 9]},
    ]
    features = [
        {"hidden": torch.ones(3, 4), "top": torch.tensor([1, 2, 3])},  # filled with "top"
        {"hidden": torch.full((2, 4), 2.0)},  # from a cache filled before it existed
    ]
    batch = collate(ExampleDataset(examples, features), [0, 1], pad_token_id=0, device="cpu")
    assert sorted(batch) == ["attention_mask", "hidden", "input_ids", "labels", "loss_mask"]
    assert batch["hidden"][:, :, 0].tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]  # (B, T)


def test_offline_features_are_each_examples_own_length_and_the_bases():
    """Computed in padded batches, kept per example: (T_i, H) and (T_i,), padding dropped."""
    from tests.conftest import make_tiny_llama
    from train.features import base_features, precompute_features

    base = make_tiny_llama(seed=3)
    lengths = [3, 9, 5, 12, 4]
    examples = [
        {"input_ids": list(range(10, 10 + n)), "loss_mask": [1] * n, "labels": list(range(n))}
        for n in lengths
    ]
    features = precompute_features(base, examples, (), batch_size=2, pad_token_id=0)
    for example, feats in zip(examples, features):
        ids = torch.tensor([example["input_ids"]])
        alone = base_features(base, ids, torch.ones_like(ids), greedy=True)
        assert sorted(feats) == ["hidden", "top"]
        assert feats["hidden"].shape == (len(example["input_ids"]), 64)
        torch.testing.assert_close(feats["hidden"], alone["hidden"][0], atol=1e-5, rtol=1e-4)
        assert torch.equal(feats["top"], alone["top"][0])


class Process(SimpleNamespace):
    """What fill_cache uses of an Accelerator, as process `rank` of `world` sees it."""

    def __init__(self, rank: int, world: int):
        super().__init__(is_main_process=rank == 0, process_index=rank, num_processes=world)

    def print(self, *args):
        print(*args)

    def wait_for_everyone(self):
        pass


def test_two_processes_compute_each_missing_example_once(tmp_path, monkeypatch):
    base, exs = make_tiny_llama(seed=3), examples(5)
    plans = []  # the main process's plan, as broadcast_object_list hands it to the other

    def broadcast(plan, from_process):
        if plan[0] is not None or plan[1] is not None:
            plans.append(plan)
        return plans[-1]

    computed = []
    real = features.base_features
    monkeypatch.setattr(fc, "broadcast_object_list", broadcast)
    monkeypatch.setattr(
        features, "base_features", lambda *a, **kw: computed.append(a[1].shape[0]) or real(*a, **kw)
    )
    for rank in (0, 1):
        fc.fill_cache(
            base,
            exs,
            [],
            tmp_path,
            base_name="tiny",
            batch_size=3,
            pad_token_id=0,
            accelerator=Process(rank, 2),
        )
    assert sum(computed) == len(exs)  # 3 on the main process, 2 on the other
    shards = sorted(tmp_path.glob("features-r*.safetensors"))
    assert [s.name[:13] for s in shards] == ["features-r000", "features-r001"]
    cache = fc.FeatureCache(tmp_path, exs, torch.float32)
    assert [cache[i]["hidden"].shape[0] for i in range(len(exs))] == [
        len(e["input_ids"]) for e in exs
    ]


def test_greedy_tokens_of_a_large_vocabulary_are_kept_exactly(tmp_path):
    """Token ids past 256 are not all bf16 numbers (49,153 would read 49,152): "top" is int32."""
    base = make_tiny_llama(seed=3, vocab_size=50_000)
    ids = [40_001, 49_153, 257, 12_345, 33_333]
    exs = [{"input_ids": ids, "loss_mask": [1] * len(ids), "labels": ids}]
    fill(base, exs, tmp_path, aux=[])
    greedy = base(input_ids=torch.tensor([exs[0]["input_ids"]])).logits[0].argmax(-1)
    assert torch.equal(fc.FeatureCache(tmp_path, exs, torch.float32)[0]["top"], greedy)
    assert not torch.equal(greedy.to(torch.bfloat16).long(), greedy)  # ids bf16 cannot hold


def test_the_fingerprint_tells_apart_a_base_retrained_past_each_tensors_start():
    """Embedding rows of the upper half of the vocabulary retrained (tokens added, say): the
    values sampled over each whole tensor see it, not only its first ones."""
    base, other = make_tiny_llama(seed=3), make_tiny_llama(seed=3)
    assert fc.weights_fingerprint(base) == fc.weights_fingerprint(other)
    with torch.no_grad():
        other.model.embed_tokens.weight[128:] += 0.5
    assert fc.weights_fingerprint(base) != fc.weights_fingerprint(other)


def test_a_cache_that_just_fits_the_free_disk_is_filled(tmp_path, monkeypatch):
    exs = examples(3)
    need = sum(len(e["input_ids"]) for e in exs) * fc.bytes_per_token(64, with_aux=False)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(fc.shutil, "disk_usage", lambda _: Usage(10**9, 10**9 - need, need))
    fill(make_tiny_llama(seed=3), exs, tmp_path, aux=[])
    index = []
    for shard in tmp_path.glob("features-r000-*.safetensors"):
        with fc.safe_open(shard, framework="pt") as f:
            index += json.loads(f.metadata()["index"])
    assert len(index) == 3


def test_a_shard_is_written_once_it_holds_its_limit(tmp_path):
    """Each shard holds the examples added until its bytes reached shard_bytes; the rest wait
    for the next."""
    exs, limit = examples(7), 4096
    fill(make_tiny_llama(seed=3), exs, tmp_path, aux=[], shard_bytes=limit)
    per_token = fc.bytes_per_token(64, with_aux=False)  # what a shard holds of each token
    sizes = []
    for shard in sorted(tmp_path.glob("features-r000-*.safetensors")):
        with fc.safe_open(shard, framework="pt") as f:
            sizes.append([rows for _, _, rows in json.loads(f.metadata()["index"])])
    tokens = sum(len(e["input_ids"]) for e in exs)
    assert tokens * per_token > 2 * limit and len(sizes) >= 2
    for rows in sizes[:-1]:  # each reached the limit, and would not have without its last
        assert sum(rows) * per_token >= limit > sum(rows[:-1]) * per_token
    assert sum(map(len, sizes)) == len(exs)
