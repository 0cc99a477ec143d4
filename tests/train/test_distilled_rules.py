"""Resuming a distill folder: which changed settings extend the run and which are refused, and
the counts its manifest records. Hand-made manifests and shards, no model (tests/scripts/
test_distill.py runs distill itself over such folders).
"""

import json

import pytest

from train.distilled import MANIFEST, DistillError, check_manifest, summarize_shards

# As scripts/distill.py's generation_settings records them.
RECORDED = {
    "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "dtype": "auto",
    "sources": ["a.jsonl", "b.jsonl"],
    "limit": 100,
    "seed": 0,
    "max_new_tokens": 256,
    "temperature": 0.0,
    "top_p": 1.0,
    "num_samples": 1,
    "system_prompt": None,
    "chat_template": None,
    "max_length": 2048,
    "order": "prompt-hash",
}


def folder_of(tmp_path, **recorded):
    """A distill output whose manifest holds RECORDED with `recorded`'s changes."""
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": {**RECORDED, **recorded}}))
    return tmp_path


def now(**changes):
    return {**RECORDED, **changes}


def test_a_folder_without_recorded_settings_takes_any_run(tmp_path):
    check_manifest(tmp_path, now(limit=5, num_samples=3))  # no manifest: a new folder
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": {}, "counts": {}}))
    check_manifest(tmp_path, now(limit=5, num_samples=3))


def test_the_recorded_settings_resume(tmp_path):
    check_manifest(folder_of(tmp_path), now())


@pytest.mark.parametrize("limit", [100, 300, None])
def test_the_same_a_larger_or_no_limit_extends_a_run(tmp_path, limit):
    check_manifest(folder_of(tmp_path), now(limit=limit))


def test_a_smaller_limit_is_another_selection(tmp_path):
    with pytest.raises(DistillError) as e:
        check_manifest(folder_of(tmp_path), now(limit=99))
    assert "other settings (limit: 100 in the manifest, 99 now)" in str(e.value)


def test_a_limit_on_a_run_that_took_every_prompt_is_refused(tmp_path):
    with pytest.raises(DistillError, match=r"\(limit: None in the manifest, 1000 now\)"):
        check_manifest(folder_of(tmp_path, limit=None), now(limit=1000))


@pytest.mark.parametrize(
    "sources",
    [["a.jsonl", "b.jsonl", "c.jsonl"], ["c.jsonl", "b.jsonl", "a.jsonl"], ["b.jsonl", "a.jsonl"]],
)
def test_more_or_reordered_sources_extend_a_run_that_now_takes_every_prompt(tmp_path, sources):
    check_manifest(folder_of(tmp_path), now(sources=sources, limit=None))
    check_manifest(folder_of(tmp_path, limit=None), now(sources=sources, limit=None))


def test_more_sources_under_a_limit_are_refused(tmp_path):
    """Under a limit the prompts kept are drawn from all sources: another set than the first."""
    with pytest.raises(DistillError) as e:
        check_manifest(folder_of(tmp_path), now(sources=["a.jsonl", "b.jsonl", "c.jsonl"]))
    assert str(e.value).count(" in the manifest, ") == 1
    assert "(sources: ['a.jsonl', 'b.jsonl'] in the manifest, " in str(e.value)


def test_a_dropped_source_is_refused_even_without_a_limit(tmp_path):
    with pytest.raises(
        DistillError,
        match=r"\(sources: \['a.jsonl', 'b.jsonl'\] in the manifest, \['a.jsonl'\] now\)",
    ):
        check_manifest(folder_of(tmp_path, limit=None), now(sources=["a.jsonl"], limit=None))


def test_more_samples_per_prompt_extend_a_run_and_fewer_are_refused(tmp_path):
    check_manifest(folder_of(tmp_path, num_samples=2), now(num_samples=3))
    with pytest.raises(DistillError, match=r"\(num_samples: 2 in the manifest, 1 now\)"):
        check_manifest(folder_of(tmp_path, num_samples=2), now(num_samples=1))


def test_a_manifest_without_num_samples_was_one_sample_per_prompt(tmp_path):
    """Manifests written before num_samples existed: one answer per prompt."""
    folder = folder_of(tmp_path)
    settings = json.loads((folder / MANIFEST).read_text())
    del settings["settings"]["num_samples"]
    (folder / MANIFEST).write_text(json.dumps(settings))
    check_manifest(folder, now(num_samples=1))
    check_manifest(folder, now(num_samples=2))


def test_every_other_change_is_refused_and_each_named_in_key_order(tmp_path):
    with pytest.raises(DistillError) as e:
        check_manifest(folder_of(tmp_path), now(temperature=0.7, max_new_tokens=128, seed=1))
    assert str(e.value) == (
        f"{tmp_path} holds a run made with other settings (max_new_tokens: 256 in the manifest, "
        "128 now; seed: 0 in the manifest, 1 now; temperature: 0.0 in the manifest, 0.7 now). "
        "Use another data.output_dir, or restore the settings to resume it."
    )


def test_a_setting_only_one_side_has_counts_as_changed(tmp_path):
    """distill.py drops `order` from its settings for a folder whose manifest lacks it: both
    directions must be refused for that to matter."""
    without_order = {k: v for k, v in RECORDED.items() if k != "order"}
    with pytest.raises(DistillError, match=r"\(order: None in the manifest, 'prompt-hash' now\)"):
        check_manifest(folder_of(tmp_path, order=None), now())
    with pytest.raises(DistillError, match=r"\(order: 'prompt-hash' in the manifest, None now\)"):
        check_manifest(folder_of(tmp_path), without_order)


def test_a_grown_limit_does_not_excuse_a_changed_temperature(tmp_path):
    with pytest.raises(DistillError) as e:
        check_manifest(folder_of(tmp_path), now(limit=None, temperature=0.7))
    assert "(temperature: 0.0 in the manifest, 0.7 now)" in str(e.value)


def write_shard(folder, name, records):
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_counts_cover_every_ranks_shards(tmp_path):
    write_shard(
        tmp_path,
        "shard-r000-00000.jsonl",
        [
            {"id": "p1-0", "finished": True, "dropped_turns": 2},
            {"id": "p2-0", "finished": False},
        ],
    )
    write_shard(tmp_path, "shard-r000-00001.jsonl", [{"id": "p3-0", "finished": True}])
    write_shard(
        tmp_path, "shard-r001-00000.jsonl", [{"id": "p4-0", "finished": True, "dropped_turns": 1}]
    )
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": RECORDED}))
    (tmp_path / ".shard-r000-00002.jsonl.123.tmp").write_text('{"id": "half"')  # a write cut off
    assert summarize_shards(tmp_path) == {
        "records_written": 4,
        "unfinished": 1,
        "turns_dropped_too_long": 3,
    }
