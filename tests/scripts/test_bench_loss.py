"""scripts/bench_loss.py on small shapes: one line per run and method, the same loss from both,
and a child run's own measurement."""

import sys
from pathlib import Path

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
