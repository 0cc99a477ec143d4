"""scripts/gpu_check.sh on a machine without CUDA stops before any benchmark (they would build
random 8B models on the CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: it would run")
def test_without_cuda_it_refuses_before_any_benchmark(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "torch sees no CUDA device here" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing started, no log
    env["PYTHON"] = str(tmp_path / "no-python")
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "cannot import torch" in done.stderr
