"""training.mixed_precision=auto: bf16 autocast only where the hardware computes bf16.

On a CPU without AVX512-BF16 or AMX torch emulates bf16 matmuls: the demo's EAGLE-3 step took
67 s there instead of 2.0 s in fp32, so the SmolLM2 recipes say "auto".
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

import train.eagle
import train.precision
import train.run
from tests.train.conftest import TINY_EAGLE, run
from train.config import load_recipe
from train.precision import (
    answering_dtype,
    cpu_has_bf16,
    resolve_mixed_precision,
    training_base_dtype,
)

SMOLLM2_RECIPES = ["recipes/smollm2-135m-medusa.yaml", "recipes/smollm2-135m-eagle.yaml"]


def test_auto_is_bf16_only_on_hardware_that_computes_it(monkeypatch):
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    assert resolve_mixed_precision("auto", on_gpu=False) == (
        "bf16",
        "auto: this CPU computes in bf16",
    )
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: False)
    assert resolve_mixed_precision("auto", on_gpu=False) == (
        "no",
        "auto: this CPU has no bf16 instructions, so fp32",
    )
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_mixed_precision("auto", on_gpu=True)[0] == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_mixed_precision("auto", on_gpu=True)[0] == "no"
    assert isinstance(cpu_has_bf16(), bool)


def test_explicit_settings_are_kept_and_emulated_bf16_is_warned(monkeypatch):
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match="without bf16 instructions.*mixed_precision=auto"):
        assert resolve_mixed_precision("bf16", on_gpu=False) == ("bf16", "bf16")
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for setting in ("no", "bf16", "fp16"):
            assert resolve_mixed_precision(setting, on_gpu=False)[0] == setting


@pytest.mark.parametrize("path", SMOLLM2_RECIPES)
def test_the_cpu_recipes_ask_for_auto(path):
    assert load_recipe(path).training.mixed_precision == "auto"


def test_a_run_hands_accelerate_the_resolved_setting(tiny_task, tmp_path, monkeypatch, capsys):
    """An auto run on a CPU without bf16 trains in fp32 and says why."""
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: False)
    given = {}
    real = train.run.Accelerator

    def recording(*args, **kwargs):
        given.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(train.run, "Accelerator", recording)
    out = tmp_path / "out"
    run(
        train.eagle,
        TINY_EAGLE,
        tiny_task,
        out,
        "training.mixed_precision=auto",
        "training.max_steps=1",
    )
    assert given["mixed_precision"] == "no"
    printed = capsys.readouterr().out
    assert "mixed precision: no (auto: this CPU has no bf16 instructions, so fp32)" in printed
    assert (out / "heads").is_dir()


def test_distilling_takes_bf16_for_sampled_answers_on_a_cpu_that_computes_it(monkeypatch):
    """model.dtype=auto: sampled answers (training data) in bf16 where the CPU computes it and
    oneDNN packs it; greedy ones (the base's exact greedy output) in fp32; a GPU and an explicit
    dtype as load_base takes them."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: True)
    assert answering_dtype("auto", 0.7, cpu) == "bfloat16"
    assert answering_dtype("auto", 0.0, cpu) is None  # load_base's fp32
    assert answering_dtype("auto", 0.7, gpu) is None  # load_base's bf16
    assert answering_dtype("float32", 0.7, cpu) == "float32"
    assert answering_dtype("bfloat16", 0.0, cpu) == "bfloat16"
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: False)
    assert answering_dtype("auto", 0.7, cpu) is None
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: True)
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: False)
    assert answering_dtype("auto", 0.7, cpu) is None


def test_training_takes_a_bf16_base_for_offline_features_on_a_cpu_that_computes_it(monkeypatch):
    """model.dtype=auto: bf16 for offline training under bf16 autocast on a CPU that computes
    and packs bf16; what the run builds on (a checkpoint, a feature cache) keeps its dtype;
    online training, fp32 training, a GPU and an explicit dtype as load_base takes them."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: True)

    def dtype(*args):
        return training_base_dtype(*args)[0]

    assert training_base_dtype("auto", "bf16", "offline", cpu, None) == (
        "bfloat16",
        "auto: bf16 features on this CPU",
    )
    assert dtype("auto", "bf16", "offline", cpu, "float32") == "float32"
    assert dtype("auto", "no", "offline", cpu, "bfloat16") == "bfloat16"
    assert dtype("auto", "bf16", "online", cpu, None) is None
    assert dtype("auto", "no", "offline", cpu, None) is None
    assert dtype("auto", "bf16", "offline", gpu, None) is None
    assert dtype("float32", "bf16", "offline", cpu, None) == "float32"
    assert dtype("float32", "bf16", "offline", cpu, "bfloat16") == "float32"
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: False)
    assert dtype("auto", "bf16", "offline", cpu, None) is None
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: True)
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: False)
    assert dtype("auto", "bf16", "offline", cpu, None) is None
    with pytest.warns(UserWarning, match="no bf16 instructions: the bf16 base runs emulated"):
        assert dtype("auto", "bf16", "offline", cpu, "bfloat16") == "bfloat16"


def test_the_trainers_base_keeps_the_dtype_of_its_cache_and_checkpoint(
    tiny_task, tmp_path, monkeypatch, capsys
):
    """base_dtype_for_training under model.dtype=auto on a bf16 CPU: bf16 for a new run; an fp32
    feature cache, or a checkpoint of an fp32 run (recorded, or from before the dtype was
    recorded: its recipe's, else load_base's default), keep fp32, whose weights their
    fingerprints hold."""
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: True)
    accelerator = SimpleNamespace(device=torch.device("cpu"), mixed_precision="bf16", print=print)
    cache = tmp_path / "features"
    offline = ["model.dtype=auto", "training.mode=offline", f"training.feature_cache={cache}"]

    def dtype(*overrides, ckpt=None):
        recipe = load_recipe(TINY_EAGLE, [*offline, *overrides])
        return train.run.base_dtype_for_training(recipe, accelerator, ckpt)

    assert dtype() == "bfloat16"
    assert "base dtype: bfloat16 (auto: bf16 features on this CPU)" in capsys.readouterr().out
    cache.mkdir()
    (cache / "features.json").write_text(json.dumps({"base_dtype": "float32"}))
    assert dtype() == "float32"
    assert "as the checkpoint or feature cache it builds on" in capsys.readouterr().out
    assert dtype("model.dtype=bfloat16") == "bfloat16"
    (cache / "features.json").write_text("{")
    with pytest.raises(SystemExit) as stopped:
        dtype()
    assert stopped.value.code == 2 and "features.json is damaged" in capsys.readouterr().err

    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2}))  # an earlier headstart's
    assert dtype("training.feature_cache=null", ckpt=ckpt) == "float32"
    (ckpt / "recipe.yaml").write_text("model:\n  dtype: bfloat16\n")
    assert dtype(ckpt=ckpt) == "bfloat16"
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "base_dtype": "float32"}))
    assert dtype(ckpt=ckpt) == "float32"


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one mixed-precision setting per process: reset it after the test, so
    the next tests' Accelerator ("no") is not refused."""
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow
def test_an_auto_run_on_a_bf16_cpu_caches_bf16_features_resumes_and_is_scored_in_fp32(
    tiny_task, tmp_path, monkeypatch, capsys, fresh_accelerate_state
):
    """The whole path: an offline EAGLE-3 run under bf16 autocast fills its cache with the bf16
    base and records it; resumed, it loads that base again (the fingerprints match); Medusa in
    fp32 on the same cache keeps its bf16 base; eval_heads scores in fp32 as decoding runs."""
    from accelerate.state import AcceleratorState

    import scripts.eval_heads
    import train.medusa
    from tests.train.conftest import TINY_MEDUSA, watching

    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(train.precision, "can_prepack_bf16", lambda: True)
    # accelerate keeps one mixed-precision setting per process: each run here sets its own.
    monkeypatch.setattr(train.run, "Accelerator", fresh_state(train.run.Accelerator))
    cache, out = tmp_path / "features", tmp_path / "eagle"
    auto = ["model.dtype=auto", "training.mode=offline", f"training.feature_cache={cache}"]
    bf16 = [*auto, "training.mixed_precision=bf16"]
    base = run(train.eagle, TINY_EAGLE, tiny_task, out, *bf16, "training.max_steps=2")
    assert base.dtype == torch.bfloat16
    assert json.loads((cache / "features.json").read_text())["base_dtype"] == "bfloat16"
    state = out / "checkpoints" / "step-00000002" / "trainer_state.json"
    assert json.loads(state.read_text())["base_dtype"] == "bfloat16"
    capsys.readouterr()
    base = run(train.eagle, TINY_EAGLE, tiny_task, out, *bf16, "training.max_steps=3")
    assert base.dtype == torch.bfloat16 and "at step 2" in capsys.readouterr().out

    medusa = tmp_path / "medusa"
    fp32 = [*auto, "training.mixed_precision=no", "training.max_steps=1"]
    assert run(train.medusa, TINY_MEDUSA, tiny_task, medusa, *fp32).dtype == torch.bfloat16

    AcceleratorState._reset_state(reset_partial_state=True)  # eval_heads: no autocast
    with watching(scripts.eval_heads) as seen:
        scripts.eval_heads.main([str(out / "recipe.yaml"), str(out / "heads")])
    assert seen["base"].dtype == torch.float32


def fresh_state(accelerator_class):
    """accelerator_class, made after accelerate's process-wide state is reset."""
    from accelerate.state import AcceleratorState

    def make(*args, **kwargs):
        AcceleratorState._reset_state(reset_partial_state=True)
        return accelerator_class(*args, **kwargs)

    return make


def test_resuming_with_the_base_in_another_dtype_says_which(tiny_task, tmp_path):
    """A checkpoint of a bf16-base run resumed with the fp32 base: its fingerprint differs, and
    the error names the dtypes and the setting that resumes it."""
    from tests.train.conftest import load_tiny_base
    from train.checkpoint import base_identity
    from train.config import RecipeError

    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    state = {"step": 2, "base_weights": "0123456789abcdef", "base_dtype": "bfloat16"}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(RecipeError, match="base in bfloat16, loaded in float32 now: resume with "):
        base_identity(load_tiny_base(tiny_task), ckpt)
    state["base_dtype"] = "float32"  # the same dtype: other weights
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(RecipeError, match="other weights of the base"):
        base_identity(load_tiny_base(tiny_task), ckpt)


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected",
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_either_avx512_bf16_or_amx_counts_as_native_bf16(monkeypatch, avx512_bf16, amx, expected):
    """(P5) A CPU with AMX tiles computes bf16 natively even where torch reports no AVX512-BF16."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert cpu_has_bf16() is expected


CPU = torch.device("cpu")


def test_explicit_bf16_on_a_gpu_is_kept_without_the_cpu_warning(monkeypatch):
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_mixed_precision("bf16", on_gpu=True) == ("bf16", "bf16")


def test_a_bf16_cache_warns_only_on_a_cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert training_base_dtype("auto", "bf16", "offline", CPU, "bfloat16") == (
            "bfloat16",
            "auto: as the checkpoint or feature cache it builds on",
        )
    monkeypatch.setattr(train.precision, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match="this CPU has no bf16 instructions: the bf16 base runs"):
        assert training_base_dtype("auto", "bf16", "offline", CPU, "bfloat16")[0] == "bfloat16"
