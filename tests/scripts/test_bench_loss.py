"""scripts/bench_loss.py on small shapes: one line per run and method, the same loss from both,
and a child run's own measurement."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import bench_loss  # noqa: E402  (scripts/ is not a package)


def test_bench_loss_runs_both_methods_in_their_own_processes(capsys):
    bench_loss.main(["--rows", "16", "--vocab", "300", "--dtype", "float32", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("16 rows x 300 vocab, float32 logits")
    runs = [line.split(":")[0].split() for line in lines[1:]]
    assert runs == [["run", "1", "log_softmax"], ["run", "1", "soft_target_ce"]]
    losses = {line.rsplit("loss ", 1)[1] for line in lines[1:]}
    assert len(losses) == 1 and float(losses.pop()) > 0


def test_a_child_run_reports_loss_seconds_and_memory():
    loss, seconds, peak = bench_loss.measure("soft_target_ce", 8, 50, "bfloat16").split()
    assert float(loss) > 0 and float(seconds) > 0 and int(peak) >= 0


def test_resident_bytes_is_the_processs_resident_set():
    """The kernel's VmRSS (kB), not the far larger virtual size."""
    status = Path("/proc/self/status").read_text()
    rss = int(status.split("VmRSS:")[1].split()[0]) * 1024
    assert abs(bench_loss.resident_bytes() - rss) < 2**24


def test_a_childs_memory_is_the_peak_above_what_its_inputs_took():
    """8 x 50 fp32 logits need a few kB more: far below the process's own few hundred MB."""
    _, _, peak = bench_loss.measure("soft_target_ce", 8, 50, "float32").split()
    assert 0 <= int(peak) < 2**26 < bench_loss.resident_bytes()


def test_each_line_prints_the_loss_of_the_rows_and_vocabulary_asked_for(capsys):
    bench_loss.main(["--rows", "16", "--vocab", "300", "--dtype", "float32", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()[1:]
    own = float(bench_loss.measure("log_softmax", 16, 300, "float32").split()[0])
    assert [line.rsplit("loss ", 1)[1] for line in lines] == [f"{own:.6g}"] * 2


def fake_children(monkeypatch, losses: dict[str, float]) -> None:
    def run(child, **kwargs):
        method = child[child.index("--one") + 1]
        return subprocess.CompletedProcess(child, 0, stdout=f"{losses[method]!r} 0.5 1024\n")

    monkeypatch.setattr(bench_loss.subprocess, "run", run)


def test_losses_that_differ_past_one_in_ten_thousand_stop_the_benchmark(monkeypatch, capsys):
    fake_children(monkeypatch, {"log_softmax": 2.0, "soft_target_ce": 2.0001})  # 5e-5: alike
    bench_loss.main(["--runs", "1"])
    assert "loss 2.0001" in capsys.readouterr().out
    fake_children(monkeypatch, {"log_softmax": 2.0, "soft_target_ce": 2.01})
    with pytest.raises(SystemExit, match="the two losses differ: 2.0 against 2.01"):
        bench_loss.main(["--runs", "1"])
