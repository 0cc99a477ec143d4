"""Distributed launches of the real recipes on CPU processes: `accelerate launch` with DDP over
gloo, and with DeepSpeed ZeRO-2 / ZeRO-3 (DeepSpeed's CPU accelerator) when deepspeed is
installed, including a resume from a DeepSpeed checkpoint; the shipped launch configs parse."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from heads import MedusaHeads, load_heads
from tests.train.conftest import ROOT, TINY_MEDUSA, load_tiny_base
from tests.train.test_recipes import CHECKPOINT_FILES, HEADS_FILES, free_port, read_metrics
from tests.train.test_resume import assert_same_run


@pytest.mark.slow
def test_two_processes(tiny_task, medusa_run, tmp_path):
    """Two CPU processes joined by gloo. `accelerate launch --cpu --num_processes 2` starts only
    one process (accelerate's simple launcher); `--multi_gpu` starts two through torchrun and the
    recipe joins them on the CPU. They start from heads recorded for another base's name (of
    the same sizes): each process checks them, and the first one warns."""
    out = tmp_path / "out"
    start = tmp_path / "start"
    shutil.copytree(medusa_run[0] / "heads", start)
    config = json.loads((start / "config.json").read_text())
    config["base_model_name_or_path"] = "someone/another-model"
    (start / "config.json").write_text(json.dumps(config))
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch"),
        *("--multi_gpu", "--num_processes", "2", "--num_machines", "1"),
        *("--mixed_precision", "no", "--dynamo_backend", "no"),
        *("--main_process_port", str(free_port())),
        str(ROOT / "train" / "medusa.py"),
        str(TINY_MEDUSA),
        *tiny_task.overrides(out),
        f"training.init_heads={start}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("trainable parameters") == 1  # printed by the main process only
    assert result.stderr.count("trained on 'someone/another-model'") == 1, result.stderr[-3000:]
    assert result.stderr.count("Loading weights: 100%") == 1  # the base's, on the first process
    assert {p.name for p in (out / "heads").iterdir()} == HEADS_FILES
    assert isinstance(load_heads(out / "heads", base=load_tiny_base(tiny_task)), MedusaHeads)
    ckpt = out / "checkpoints" / "step-00000004"
    assert {p.name for p in ckpt.iterdir()} == CHECKPOINT_FILES | {"random_states_1.pkl"}
    # 36 examples, 4 per process: 4 steps of 8; the schedule is the one-process run's (1 warmup
    # step, then cosine over 3): each step logs the rate its update used.
    train_lines, _ = read_metrics(out)
    assert sorted(train_lines) == [1, 2, 3, 4]
    lrs = [train_lines[s]["lr"] for s in range(1, 5)]
    assert lrs == pytest.approx([0.0, 1e-3, 7.5e-4, 2.5e-4])


def test_deepspeed_configs(tmp_path):
    deepspeed = pytest.importorskip(
        "deepspeed", reason="deepspeed is not installed (pip install headstart[deepspeed])"
    )
    from accelerate.utils import DeepSpeedPlugin

    configs = sorted((ROOT / "recipes" / "deepspeed").glob("*.json"))
    if not configs:
        pytest.skip("no recipes/deepspeed/*.json")
    for path in configs:
        config = json.loads(path.read_text())
        plugin = DeepSpeedPlugin(hf_ds_config=str(path))
        assert plugin.zero_stage == config["zero_optimization"]["stage"], path
    assert deepspeed.__version__


def deepspeed_launch(stage: str, task, out) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file recipes/accelerate/{stage}-8gpu.yaml` (the shipped
    launch config, as the README gives it, with its ZeRO json) of the tiny Medusa recipe on two
    CPU processes instead of 8 GPUs (DeepSpeed's CPU accelerator over gloo); asserts success."""
    config = ROOT / "recipes" / "accelerate" / f"{stage}-8gpu.yaml"
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)),
        *("--num_processes", "2", "--dynamo_backend", "no"),
        *("--main_process_port", str(free_port())),
        str(ROOT / "train" / "medusa.py"),
        str(TINY_MEDUSA),
        *task.overrides(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ranks = "\n".join(line for line in result.stderr.splitlines() if line.startswith("[rank"))
    assert result.returncode == 0, ranks[-4000:] or result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_launch_on_cpu(tiny_task, tmp_path, stage):
    """A real DeepSpeed launch of the tiny Medusa recipe; then a resume from its step-2
    checkpoint, as after a kill during step 4, continues with the same losses and heads."""
    pytest.importorskip(
        "deepspeed", reason="deepspeed is not installed (pip install headstart[deepspeed])"
    )
    out = tmp_path / "out"
    deepspeed_launch(stage, tiny_task, out)
    # DeepSpeed ran (not a silent DDP fallback): its checkpoints hold each rank's ZeRO shard.
    ckpt = out / "checkpoints" / "step-00000004"
    assert len(list(ckpt.rglob("zero_pp_rank_*optim_states.pt"))) == 2
    assert {p.name for p in (out / "heads").iterdir()} == HEADS_FILES
    assert isinstance(load_heads(out / "heads", base=load_tiny_base(tiny_task)), MedusaHeads)
    train_lines, _ = read_metrics(out)
    assert sorted(train_lines) == [1, 2, 3, 4]
    assert all(math.isfinite(line["loss"]) for line in train_lines.values())

    # What a kill during step 4 leaves: checkpoints up to step 2, metrics up to step 3.
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    shutil.rmtree(out / "heads")
    shutil.rmtree(ckpt)
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in metrics if json.loads(line)["step"] <= 3]
    (out / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    result = deepspeed_launch(stage, tiny_task, out)
    assert "at step 2" in result.stdout
    assert_same_run(out, reference, 4)


LAUNCH_CONFIGS = sorted((ROOT / "recipes" / "deepspeed").glob("*.json")) + sorted(
    (ROOT / "recipes" / "accelerate").glob("*.yaml")
)


@pytest.mark.skipif(not LAUNCH_CONFIGS, reason="no recipes/deepspeed/*.json or accelerate/*.yaml")
@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=[p.name for p in LAUNCH_CONFIGS])
def test_launch_configs_parse(path):
    text = path.read_text()
    config = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    assert isinstance(config, dict) and config


def test_an_fsdp_launch_is_refused_not_run_as_something_else(monkeypatch):
    """On CPUs accelerate would quietly run an FSDP config as DDP; the recipes say to use ZeRO-3."""
    from train.config import load_recipe
    from train.run import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(SystemExit, match="do not run under FSDP.*zero3-8gpu.yaml"):
        make_accelerator(load_recipe(None))
