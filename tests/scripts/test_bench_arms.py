"""scripts/bench_arms.py's figures and command line, without timing a model: stand-in generators
give known outputs, and main stops (or is handed rows) where the timing would start."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (scripts/ is not a package)
import bench_arms  # noqa: E402

from tests.scripts.test_bench import MT_BENCH, _jsonl  # noqa: E402


def out(seq, accepted, total, base=0.0, prefill_base=0.0, draft=0.0, prefill_draft=0.0):
    timings = dict(base=base, prefill_base=prefill_base, draft=draft, prefill_draft=prefill_draft)
    return SimpleNamespace(
        sequences=torch.tensor([seq]),
        accepted_lengths=accepted,
        num_steps=len(accepted),
        timings={**timings, "total": total},
    )


class FakeGenerator:
    """Answers each timed prompt with the next of `outputs` (the warm-up with the first); as
    SpeculativeGenerator, a policy made by generate is kept from one call to the next, and a
    policy's update is told of every step."""

    def __init__(self, arm, outputs):
        self.arm, self.outputs, self.calls = arm, outputs, 0
        self.arms = arm if isinstance(arm, list) else [arm]
        self.policy = None
        self.policies_seen = []

    def generate(self, ids, max_new_tokens):
        self.policies_seen.append(self.policy)
        result = self.outputs[max(self.calls - 1, 0)]
        self.calls += 1
        if self.policy is None:
            self.policy = SimpleNamespace(update=lambda *a: None)
        for tokens in result.accepted_lengths:
            self.policy.update(0, tokens, 0.1, None, (), True)
        return result


# Two prompts: plain decoding, a setting matching it on the first, one matching it on neither.
A, B = [1, 2, 3, 4], [5, 6, 7, 8]
OUTPUTS = {
    None: [
        out(A, [1] * 4, total=1.0, base=0.8, prefill_base=0.2),  # 4 tok/s
        out(B, [1] * 4, total=2.0, base=1.8, prefill_base=0.2),  # 2 tok/s
    ],
    "x": [
        out(A, [2, 2], 0.5, base=0.5, prefill_base=0.1, draft=0.3, prefill_draft=0.1),  # 8 tok/s
        out([5, 6, 7, 9], [3, 1], 0.4, base=0.6, prefill_base=0.2, draft=0.2, prefill_draft=0.1),
    ],
    "y": [out([1, 2, 3, 0], [2, 3], 1.0), out([0, 6, 7, 8], [4], 1.0)],
}
ARMS = [None, {"choices": "x"}, {"choices": "y"}]


def fake_generators(monkeypatch) -> dict:
    made = {}

    def build(base, heads, arm):
        key = arm["choices"] if isinstance(arm, dict) else arm
        made[key] = FakeGenerator(arm, OUTPUTS.get(key, OUTPUTS["y"]))
        return made[key]

    monkeypatch.setattr(bench_arms, "build_generator", build)
    return made


def test_time_arms_reports_each_settings_figures_against_plain_decoding(monkeypatch):
    fake_generators(monkeypatch)
    ids = [torch.tensor([[1]]), torch.tensor([[2]])]
    plain, x, y = bench_arms.time_arms(None, None, ARMS, ids, 8)
    approx = pytest.approx
    assert (plain["tokens"], plain["steps"], plain["tau"]) == (8, 8, 1.0)
    assert (x["tokens"], x["steps"], x["tau"]) == (8, 4, 2.0)
    # a step's cost, its prompt's prefill left out: (0.5 - 0.1 + 0.6 - 0.2) s over 4 steps
    assert x["base_ms_per_step"] == approx(200.0) and x["draft_ms_per_step"] == approx(75.0)
    assert plain["base_ms_per_step"] == approx(275.0) and plain["draft_ms_per_step"] == 0.0
    assert x["tokens_per_s"] == approx(8 / 0.9) and plain["tokens_per_s"] == approx(8 / 3.0)
    # per prompt 8 vs 4 and 10 vs 2 tok/s: median 3.5x; overall (8 / 0.9) / (8 / 3)
    assert x["vs_plain_median"] == approx(3.5) and x["vs_plain"] == approx(3.0 / 0.9)
    assert plain["vs_plain_median"] == approx(1.0) and plain["vs_plain"] == approx(1.0)
    assert (plain["identical"], x["identical"], y["identical"]) == (1.0, 0.5, 0.0)
    table = bench_arms.render_markdown([plain, x, y])
    row = '| `{"choices": "x"}` | 2.00 | 200.0 | 75.0 | 8.9 | 3.50x / 3.33x | 50.0% (1/2) |'
    assert row in table
    assert "| `plain` | 1.00 | 275.0 | 0.0 | 2.7 | 1.00x / 1.00x | 100% |" in table
    assert "| 0.0% (0/2) |" in table
    nearly = bench_arms.render_markdown([{**x, "identical": 199 / 200, "prompts": 200}])
    assert nearly.endswith("| 99.5% (199/200) |\n")  # never rounded up to 100%


def test_time_arms_needs_plain_decoding_first(monkeypatch):
    fake_generators(monkeypatch)
    for arms in ([], [{"choices": "x"}, None]):
        with pytest.raises(ValueError, match="first setting must be null"):
            bench_arms.time_arms(None, None, arms, [torch.tensor([[1]])], 8)


def test_an_adaptive_setting_starts_the_timed_prompts_with_a_fresh_policy(monkeypatch):
    made = fake_generators(monkeypatch)
    bench_arms.time_arms(None, None, [None, "adaptive"], [torch.tensor([[1]])], 8)
    warm_up, first_timed = made["adaptive"].policies_seen
    assert warm_up is None and first_timed is None  # the warm-up's policy was dropped


def test_record_keeps_plain_decodings_lengths(monkeypatch):
    fake_generators(monkeypatch)

    class Policy(SimpleNamespace):
        @classmethod
        def from_options(cls, options):
            return cls(update=lambda *a, **k: None)

    monkeypatch.setattr(bench_arms, "AdaptivePolicy", Policy)
    record = {}
    ids = [torch.tensor([[1]]), torch.tensor([[2]])]
    bench_arms.time_arms(None, None, [*ARMS, "adaptive"], ids, 8, record)
    assert record["arms"] == ARMS  # the fixed settings, not the adaptive one
    # plain decoding's 4 tokens a prompt, not the last setting's (5 and 4)
    assert record["lengths"] == [4, 4]
    steps = [[s[:2] for s in log] for log in record["prompts"][0]]
    assert steps == [[[0, 1], [1, 1], [2, 1], [3, 1]], [[0, 2], [2, 2]], [[0, 2], [2, 3]]]


class Timed(Exception):
    """Raised where main would start timing."""


def stop_at_timing(monkeypatch) -> dict:
    seen = {}

    def time_arms(base, heads, arms, ids, max_new_tokens, record=None):
        seen.update(arms=arms, ids=ids, max_new_tokens=max_new_tokens)
        raise Timed

    monkeypatch.setattr(bench_arms, "time_arms", time_arms)
    return seen


def test_plain_decoding_is_timed_once_however_often_arms_names_it(folders, tmp_path, monkeypatch):
    seen = stop_at_timing(monkeypatch)
    argv = ["--base", str(folders["base"]), "--heads", str(folders["medusa"]), "--threads", "1"]
    argv += ["--prompts", str(_jsonl(tmp_path / "q.jsonl", MT_BENCH[:1])), "--device", "cpu"]
    with pytest.raises(Timed):
        bench_arms.main([*argv, "--arms", "[null, {}, null, [null, {}]]"])
    assert seen["arms"] == [None, {}, [None, {}]]


def test_a_prompt_that_just_fits_the_context_is_timed(folders, tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    seen = stop_at_timing(monkeypatch)
    prompts = bench.read_prompts(str(_jsonl(tmp_path / "q.jsonl", MT_BENCH[:1])))
    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    n = bench.prompt_ids([{"role": "user", "content": prompts[0].users[0]}], tokenizer).shape[1]
    argv = ["--base", str(folders["base"]), "--heads", str(folders["medusa"]), "--arms", "[]"]
    argv += ["--prompts", str(tmp_path / "q.jsonl"), "--device", "cpu", "--threads", "1"]
    # the tiny base's 2048 positions: the prompt and its new tokens fill them exactly
    with pytest.raises(Timed):
        bench_arms.main([*argv, "--max-new-tokens", str(2048 - n)])
    assert len(seen["ids"]) == 1 and seen["max_new_tokens"] == 2048 - n
    assert "skipped" not in capsys.readouterr().err
    assert bench_arms.main([*argv, "--max-new-tokens", str(2049 - n)]) == 2
    assert "every prompt passes the base's context" in capsys.readouterr().err


def test_per_category_then_limit_select_the_prompts(folders, tmp_path, monkeypatch):
    records = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"Q{i}?"]} for i in range(6)]
    path = str(_jsonl(tmp_path / "q.jsonl", records))
    read = bench_arms.read_prompts
    selected = []
    monkeypatch.setattr(bench_arms, "read_prompts", lambda *a: selected.extend(read(*a)) or [])
    argv = ["--base", str(tmp_path / "none"), "--heads", str(folders["medusa"]), "--prompts", path]
    assert bench_arms.main([*argv, "--per-category", "2", "--limit", "3"]) == 2  # no such base
    assert [p.id for p in selected] == [0, 1, 2]  # a, b, a, b of the categories' first 2; then 3


def test_threads_flag_sets_torchs_threads_and_refuses_zero(tmp_path, monkeypatch, capsys):
    threads = []
    monkeypatch.setattr(bench_arms.torch, "set_num_threads", threads.append)
    argv = ["--heads", str(tmp_path), "--prompts", str(tmp_path / "missing.jsonl")]
    assert bench_arms.main([*argv, "--threads", "3"]) == 2  # no such prompts
    assert threads == [3]
    with pytest.raises(SystemExit) as stop:
        bench_arms.main([*argv, "--threads", "0"])
    assert stop.value.code == 2 and "--threads >= 1" in capsys.readouterr().err
    assert threads == [3]


def test_arms_json_names_the_run(folders, tmp_path, monkeypatch, capsys):
    row = dict(arm=None, tokens=4, steps=4, base_s=0.4, draft_s=0.0, total_s=1.0, tau=1.0)
    row.update(base_ms_per_step=100.0, draft_ms_per_step=0.0, tokens_per_s=4.0)
    row.update(vs_plain_median=1.0, vs_plain=1.0, identical=1.0, prompts=1)
    monkeypatch.setattr(bench_arms, "time_arms", lambda *a: [row])
    argv = ["--base", str(folders["base"]), "--heads", str(folders["medusa"]), "--arms", "[]"]
    argv += ["--prompts", str(_jsonl(tmp_path / "q.jsonl", MT_BENCH[:1])), "--threads", "1"]
    out = tmp_path / "arms"
    assert bench_arms.main([*argv, "--max-new-tokens", "4", "--out", str(out)]) == 0
    results = json.loads((out / "arms.json").read_text())
    assert results["base"] == str(folders["base"]) and results["heads"] == str(folders["medusa"])
    assert results["max_new_tokens"] == 4 and results["prompts"]["count"] == 1
    assert results["arms"] == [row]
    assert "| `plain` | 1.00 | 100.0 |" in capsys.readouterr().out


def test_a_bad_out_or_heads_is_refused_before_any_timing(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_arms, "time_arms", lambda *a: pytest.fail("timed"))
    prompts = _jsonl(tmp_path / "q.jsonl", MT_BENCH[:1])
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--threads", "1"]
    (tmp_path / "file").write_text("notes")
    heads = ["--heads", str(folders["medusa"])]
    assert bench_arms.main([*argv, *heads, "--out", str(tmp_path / "file")]) == 2
    assert f"bench_arms failed: --out {tmp_path / 'file'} is a file" in capsys.readouterr().err
    heads = ["--heads", str(folders["other-medusa"])]  # refused once the base has loaded
    assert bench_arms.main([*argv, *heads, "--out", str(tmp_path / "new" / "arms")]) == 2
    assert "num_hidden_layers=3" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the folders it made for the run, removed again
