"""scripts/demo.py's wiring, without running its stages: what each stage is asked to do, paths
given on its command line read from where the demo runs, and the report it writes."""

from __future__ import annotations

import json
import subprocess
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

    def fake_stage(name, args, timings, folder=""):
        stages.append(args)
        if name == "benchmark":
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "results.md").write_text("")

    monkeypatch.setattr(demo, "run_stage", fake_stage)
    return stages


def test_demo_runs_its_stages_in_order_and_writes_the_report(tmp_path, monkeypatch, capsys):
    stages = []

    def fake_stage(name, args, timings, folder=""):
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
    assert "stage 'distill' failed (exit 1" in message
    assert "Rerunning the same command (make demo, or scripts/demo.py with its flags)" in message
    assert "move it away" not in message  # not a refusal: a folder is not the likely cause


def test_a_stage_that_refuses_its_folder_says_to_move_it_away(monkeypatch, tmp_path):
    """A distill folder of the user's own, made with data.limit=2000, refused (exit 2) at every
    rerun of the demo: the message names the folder to move."""
    refuses = tmp_path / "refuses"
    refuses.write_text("#!/bin/sh\nexit 2\n")
    refuses.chmod(0o755)
    monkeypatch.setattr(demo.sys, "executable", str(refuses))
    with pytest.raises(SystemExit) as stop:
        demo.run_stage("distill", ["scripts/distill.py"], {}, demo.DISTILLED)
    message = str(stop.value.code)
    assert "stage 'distill' failed (exit 2" in message
    assert f"If {demo.DISTILLED} holds a run of your own with other settings, move it" in message


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
        (
            ["--max-new-tokens", "8192"],
            "no room for a prompt in the base's context (8192 positions)",
        ),
        (["--per-category", "0"], "must be >= 1"),
        (["--out", "bad.jsonl"], "is a file: give a folder for the report"),
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


def fake_repository(tmp_path, monkeypatch) -> Path:
    """demo.ROOT pointed at an empty folder; the demo run from another one."""
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.setattr(demo, "ROOT", repo)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delenv("HEADSTART_MT_BENCH", raising=False)
    return repo


def arg(stage: list[str], flag: str) -> str:
    return stage[stage.index(flag) + 1]


def test_a_stage_runs_this_python_in_the_repository(monkeypatch):
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(demo.subprocess, "run", run)
    timings = {}
    demo.run_stage("distill", ["scripts/distill.py", "recipe.yaml"], timings)
    assert calls == [([sys.executable, "scripts/distill.py", "recipe.yaml"], {"cwd": demo.ROOT})]
    assert list(timings) == ["distill"]


def test_a_stage_killed_by_a_signal_stops_the_demo(monkeypatch):
    monkeypatch.setattr(
        demo.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, -9)
    )
    with pytest.raises(SystemExit) as stop:
        demo.run_stage("train medusa", ["train/medusa.py"], {})
    assert "stage 'train medusa' failed (exit -9" in str(stop.value.code)


def test_defaults_are_the_repositorys_mt_bench_and_runs_demo(tmp_path, monkeypatch):
    repo = fake_repository(tmp_path, monkeypatch)
    (repo / "mt_bench.jsonl").write_text(json.dumps({"turns": ["Hi?"], "category": "c"}) + "\n")
    stages = record_stages(monkeypatch)
    assert demo.main([]) == 0
    bench = stages[-1]
    assert arg(bench, "--prompts") == str((repo / "mt_bench.jsonl").resolve())
    assert arg(bench, "--out") == str(repo / "runs/demo/bench")
    assert (repo / "runs/demo/REPORT.md").is_file()
    assert not (tmp_path / "elsewhere" / "runs").exists()


def test_mt_bench_named_relative_to_where_the_demo_runs(tmp_path, monkeypatch):
    fake_repository(tmp_path, monkeypatch)
    here = tmp_path / "elsewhere"
    (here / "questions.jsonl").write_text(json.dumps({"turns": ["Hi?"]}) + "\n")
    monkeypatch.setenv("HEADSTART_MT_BENCH", "questions.jsonl")
    stages = record_stages(monkeypatch)
    assert demo.main(["--out", "report"]) == 0
    assert arg(stages[-1], "--prompts") == str(here.resolve() / "questions.jsonl")


def test_mt_bench_naming_a_folder_is_refused_naming_the_variable(tmp_path, monkeypatch, capsys):
    fake_repository(tmp_path, monkeypatch)
    monkeypatch.setattr(demo, "run_stage", lambda *a: pytest.fail("a stage ran"))
    monkeypatch.setenv("HEADSTART_MT_BENCH", str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        demo.main(["--out", "report"])
    assert stop.value.code == 2
    assert f"HEADSTART_MT_BENCH={tmp_path}: no such file" in capsys.readouterr().err


def test_humaneval_asked_for_is_not_warned_about_and_is_named_in_the_report(
    tmp_path, monkeypatch, capsys
):
    fake_repository(tmp_path, monkeypatch)
    stages = record_stages(monkeypatch)
    assert demo.main(["--prompts", "humaneval", "--out", "report"]) == 0
    assert "no mt_bench.jsonl" not in capsys.readouterr().err
    assert demo.main(["--out", "default"]) == 0  # none in the repository: HumanEval, said so
    assert "no mt_bench.jsonl" in capsys.readouterr().err
    assert arg(stages[-1], "--prompts") == "humaneval"
    report = (tmp_path / "elsewhere" / "default" / "REPORT.md").read_text()
    assert "Prompts: `humaneval`" in report


@pytest.mark.parametrize("eagle_writes_features", [True, False])
def test_medusa_trains_on_the_feature_cache_only_when_eagle_made_one(
    tmp_path, monkeypatch, eagle_writes_features
):
    repo = fake_repository(tmp_path, monkeypatch)
    stages, folders = [], []

    def fake_stage(name, args, timings, folder=""):
        stages.append(args)
        folders.append(folder)  # named if the stage refuses it
        if name == "train eagle-3" and eagle_writes_features:
            (repo / demo.FEATURES).mkdir(parents=True)
            (repo / demo.FEATURES / "features.json").write_text("{}")
        if name == "benchmark":
            Path(arg(args, "--out")).mkdir(parents=True)
            (Path(arg(args, "--out")) / "results.md").write_text("")

    monkeypatch.setattr(demo, "run_stage", fake_stage)
    assert demo.main(["--prompts", "humaneval", "--out", "report"]) == 0
    cache = [f"training.feature_cache={demo.FEATURES}"]
    assert stages[0] == ["scripts/distill.py", str(demo.MEDUSA)]
    assert stages[1] == ["train/eagle.py", str(demo.EAGLE), *cache]
    assert stages[2] == [
        "train/medusa.py",
        str(demo.MEDUSA),
        *(cache if eagle_writes_features else []),
    ]
    medusa = "runs/smollm2-medusa" + (f" or {demo.FEATURES}" if eagle_writes_features else "")
    assert folders[:3] == [demo.DISTILLED, f"runs/smollm2-eagle or {demo.FEATURES}", medusa]


@pytest.mark.parametrize("categories, per_category", [(6, "3"), (12, "2")])
def test_about_16_prompts_and_at_least_2_of_each_category(
    tmp_path, monkeypatch, categories, per_category
):
    stages = record_stages(monkeypatch)
    monkeypatch.chdir(tmp_path)
    questions = [{"turns": [f"Hi {i}?"], "category": f"c{i}"} for i in range(categories)] * 3
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    assert demo.main(["--prompts", "q.jsonl", "--out", "report"]) == 0
    assert arg(stages[-1], "--per-category") == per_category


def test_the_benchmark_compares_every_method_on_the_distilled_corpus(tmp_path, monkeypatch):
    stages = record_stages(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--prompts", "humaneval", "--out", "report", "--max-new-tokens", "32"]) == 0
    bench = stages[-1]
    assert bench[0] == "scripts/bench.py" and arg(bench, "--base") == "smollm2-135m-instruct"
    methods = "baseline,hf-lookup,ngram,ngram+corpus,heads,heads+ngram+corpus"
    assert arg(bench, "--methods") == methods
    assert arg(bench, "--lookup-corpus") == demo.DISTILLED == "runs/smollm2-distill"
    assert arg(bench, "--max-new-tokens") == "32"


def test_the_report_gives_both_trainings_held_out_metrics(tmp_path, monkeypatch):
    repo = fake_repository(tmp_path, monkeypatch)
    for name, loss in (("smollm2-medusa", 2.34567), ("smollm2-eagle", 1.5)):
        heads = repo / "runs" / name / "heads"
        heads.mkdir(parents=True)
        (heads / "training_metrics.json").write_text(json.dumps({"loss": loss, "acc": 0.25}))
    record_stages(monkeypatch)
    assert demo.main(["--prompts", "humaneval", "--out", "report"]) == 0
    report = (tmp_path / "elsewhere" / "report" / "REPORT.md").read_text()
    assert "- smollm2-medusa: loss 2.346, acc 0.250" in report
    assert "- smollm2-eagle: loss 1.500, acc 0.250" in report


def test_an_unreadable_prompts_file_stops_the_demo_naming_it(tmp_path, monkeypatch, capsys):
    import bench

    def unreadable(spec, turns):  # open() as a user without read permission meets it
        raise PermissionError(13, "Permission denied", spec)

    monkeypatch.setattr(bench, "read_prompts", unreadable)
    monkeypatch.setattr(demo, "run_stage", lambda *a: pytest.fail("a stage ran"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        demo.main(["--prompts", "secret.jsonl"])
    assert stop.value.code == 2
    assert "--prompts secret.jsonl: [Errno 13] Permission denied" in capsys.readouterr().err
