"""scripts/demo.py's wiring, without running its stages: what each stage is asked to do, paths
given on its command line read from where the demo runs, and the report it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import demo  # noqa: E402  (scripts/ is not a package)


def record_stages(monkeypatch) -> list[list[str]]:
    """Stand in for the stages: each one's command line is recorded, the benchmark writes an
    empty table."""
    stages: list[list[str]] = []

    def fake_stage(name, args, timings):
        stages.append(args)
        if name == "benchmark":
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "results.md").write_text("")

    monkeypatch.setattr(demo, "run_stage", fake_stage)
    return stages


def test_demo_runs_its_stages_in_order_and_writes_the_report(tmp_path, monkeypatch, capsys):
    stages = []

    def fake_stage(name, args, timings):
        stages.append((name, args))
        timings[name] = 60.0
        if name == "benchmark":
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "results.md").write_text("| method | tau |\n|---|---|\n| medusa | 1.50 |\n")

    monkeypatch.setattr(demo, "run_stage", fake_stage)
    monkeypatch.chdir(tmp_path)  # a user's folder, not the repository
    (tmp_path / "mine.jsonl").write_text(json.dumps({"turns": ["Hi?"]}) + "\n")
    assert demo.main(["--prompts", "mine.jsonl", "--out", "report", "--per-category", "1"]) == 0

    assert [name for name, _ in stages] == ["distill", "train eagle-3", "train medusa", "benchmark"]
    assert stages[1][1][-1] == f"training.feature_cache={demo.FEATURES}"
    bench = stages[3][1]
    assert bench[bench.index("--prompts") + 1] == str(tmp_path / "mine.jsonl")
    assert bench[bench.index("--out") + 1] == str(tmp_path / "report" / "bench")
    assert bench[bench.index("--per-category") + 1] == "1"
    assert bench[bench.index("--heads") + 1 : bench.index("--heads") + 3] == [
        "runs/smollm2-medusa/heads",
        "runs/smollm2-eagle/heads",
    ]
    report = (tmp_path / "report" / "REPORT.md").read_text()
    assert f"Prompts: `{tmp_path / 'mine.jsonl'}`" in report
    assert "- distill: 1.0 min" in report and "| medusa | 1.50 |" in report
    assert "- in all: 4.0 min" in report  # the four stages' minute each
    assert str(tmp_path / "report" / "REPORT.md") in capsys.readouterr().out


def test_a_failed_stage_stops_the_demo_saying_a_rerun_resumes(monkeypatch):
    monkeypatch.setattr(demo.sys, "executable", "false")  # every stage exits 1
    with pytest.raises(SystemExit) as stop:
        demo.run_stage("distill", ["scripts/distill.py"], {})
    message = str(stop.value.code)
    assert "stage 'distill' failed (exit 1" in message and "resumes" in message


@pytest.mark.parametrize(
    "prompts, per_category", [("humaneval", "16"), ("mt_bench.jsonl", "2"), ("plain.jsonl", "16")]
)
def test_the_benchmark_takes_16_prompts_whatever_their_categories(
    tmp_path, monkeypatch, prompts, per_category
):
    stages = record_stages(monkeypatch)
    monkeypatch.chdir(tmp_path)
    questions = [{"turns": [f"Hi {i}?"], "category": f"c{i % 8}"} for i in range(24)]
    (tmp_path / "mt_bench.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "plain.jsonl").write_text("".join(f'{{"prompt": "Say {i}."}}\n' for i in range(20)))
    assert demo.main(["--prompts", prompts, "--out", "report"]) == 0
    bench = stages[-1]
    assert bench[bench.index("--per-category") + 1] == per_category


def test_bad_flags_stop_the_demo_before_any_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_stage", lambda *a: pytest.fail("a stage ran"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"turns": ["Hi?"]}\nnot json\n')
    for argv, message in (
        (["--prompts", "missing.jsonl"], "--prompts missing.jsonl:"),
        (["--prompts", "bad.jsonl"], "bad.jsonl:2"),
        (["--max-new-tokens", "0"], "must be >= 1"),
        (["--per-category", "0"], "must be >= 1"),
    ):
        with pytest.raises(SystemExit) as stop:
            demo.main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err, argv


def test_without_mt_bench_the_demo_says_it_benchmarks_humaneval(tmp_path, monkeypatch, capsys):
    stages = record_stages(monkeypatch)
    monkeypatch.delenv("HEADSTART_MT_BENCH", raising=False)
    monkeypatch.setattr(demo, "MT_BENCH_CANDIDATES", [str(tmp_path / "none.jsonl")])
    assert demo.main(["--out", str(tmp_path / "report")]) == 0
    assert stages[-1][stages[-1].index("--prompts") + 1] == "humaneval"
    assert "no mt_bench.jsonl in the repository" in capsys.readouterr().err


def test_mt_bench_named_by_the_environment(tmp_path, monkeypatch, capsys):
    """HEADSTART_MT_BENCH names the benchmark's questions; a path that is not there is an error
    naming it (it was passed over for HumanEval without a word)."""
    stages = record_stages(monkeypatch)
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"category": "math", "turns": ["What is 2+2?"]}) + "\n")
    monkeypatch.setenv("HEADSTART_MT_BENCH", str(questions))
    assert demo.main(["--out", str(tmp_path / "report")]) == 0
    assert stages[-1][stages[-1].index("--prompts") + 1] == str(questions.resolve())
    monkeypatch.setenv("HEADSTART_MT_BENCH", str(tmp_path / "missing.jsonl"))
    with pytest.raises(SystemExit) as stop:
        demo.main(["--out", str(tmp_path / "report")])
    assert stop.value.code == 2
    assert "HEADSTART_MT_BENCH=" in capsys.readouterr().err
