"""Bad input to the training scripts: each stops with a clear message (exit 2) before the work
it would spoil, on the tiny recipes of conftest.py."""

from types import SimpleNamespace

import pytest
import yaml

import train.eagle
import train.medusa
from tests.train.conftest import TINY_EAGLE, TINY_MEDUSA, load_tiny_base, run
from train.config import load_recipe


def test_unknown_recipe_key_exits_2_listing_the_valid_keys(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.medusa.main([str(TINY_MEDUSA), "training.lerning_rate=0.1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key 'training.lerning_rate'" in err and "Did you mean 'learning_rate'" in err
    assert "Valid keys of 'training': mode, feature_cache, epochs, max_steps" in err

    recipe = yaml.safe_load(TINY_EAGLE.read_text())
    recipe["heads"]["ttt_step"] = 3
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_:
        train.eagle.main([str(path)])
    assert exit_.value.code == 2
    assert "Valid keys of 'heads': type, num_heads" in capsys.readouterr().err


def test_training_before_distill_or_on_a_missing_base_says_so(tiny_task, tmp_path, capsys):
    # refused once the base has loaded, after the output folder (and its lock) was made: the
    # folders the run made go, those it found stay
    (tmp_path / "runs").mkdir()
    for module, recipe, out in (
        (train.medusa, TINY_MEDUSA, tmp_path / "runs" / "new" / "out"),
        (train.eagle, TINY_EAGLE, tmp_path / "runs" / "x" / ".." / "new" / "out"),  # x made too
    ):
        with pytest.raises(SystemExit) as exit_:
            run(module, recipe, tiny_task, out, f"data.output_dir={tmp_path}/none")
        assert exit_.value.code == 2
        assert f"error: {tmp_path}/none: no .jsonl shards (run scripts/distill.py first)" in (
            capsys.readouterr().err
        )
        assert list((tmp_path / "runs").iterdir()) == []
    (tmp_path / "empty").mkdir()  # shards without a record (a distill killed at its start)
    (tmp_path / "empty" / "shard-r000-00000.jsonl").write_text("\n")
    with pytest.raises(SystemExit) as exit_:
        run(
            train.medusa,
            TINY_MEDUSA,
            tiny_task,
            tmp_path / "out",
            f"data.output_dir={tmp_path}/empty",
        )
    assert exit_.value.code == 2
    assert f"error: {tmp_path}/empty: its .jsonl shards hold no answers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        run(train.medusa, TINY_MEDUSA, tiny_task, tmp_path / "out", "model.name_or_path=./nowhere")
    assert exit_.value.code == 2
    assert "error: base model folder not found: ./nowhere" in capsys.readouterr().err


def test_a_draft_vocabulary_past_the_bases_is_refused_before_the_data(
    tiny_task, tmp_path, capsys, monkeypatch
):
    def no_data(*args, **kwargs):
        raise AssertionError("the data was prepared before the check")

    for module, recipe in ((train.medusa, TINY_MEDUSA), (train.eagle, TINY_EAGLE)):
        monkeypatch.setattr(module, "prepare_data", no_data)
        with pytest.raises(SystemExit) as exit_:
            run(module, recipe, tiny_task, tmp_path / "out", "heads.draft_vocab_size=1000000")
        assert exit_.value.code == 2
        vocab = load_tiny_base(tiny_task).config.vocab_size
        assert (
            f"error: heads.draft_vocab_size=1000000 is more than the base's vocabulary ({vocab} "
            in capsys.readouterr().err
        )


def test_processes_that_loaded_different_examples_stop_together(
    tiny_task, smollm2_tokenizer, tmp_path, capsys, monkeypatch
):
    import train.run

    # as if another process had read the folder while distill was still writing to it
    monkeypatch.setattr(train.run, "gather_object", lambda mine: [*mine, "another"])
    two = SimpleNamespace(num_processes=2, process_index=0, print=print)
    recipe = load_recipe(TINY_MEDUSA, tiny_task.overrides(tmp_path / "out"))
    with pytest.raises(SystemExit) as exit_:
        train.run.prepare_data(recipe, None, smollm2_tokenizer, two)
    assert exit_.value.code == 2
    assert "the processes loaded different examples from" in capsys.readouterr().err


def test_heads_type_must_match_the_script(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.eagle.main([str(TINY_MEDUSA)])
    assert exit_.value.code == 2
    assert "heads.type='medusa': run train/medusa.py" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        train.medusa.main([str(TINY_EAGLE)])
    assert exit_.value.code == 2
    assert "run train/eagle.py" in capsys.readouterr().err


def test_medusa2_offline_is_refused_before_the_run(capsys):
    """Medusa-2 adapts the base, so its features cannot be cached: said before any work."""
    with pytest.raises(SystemExit) as exit_:
        train.medusa.main([str(TINY_MEDUSA), "heads.lora_r=4", "training.mode=offline"])
    assert exit_.value.code == 2
    assert "heads.lora_r > 0 adapts the base, so it needs training.mode=online" in (
        capsys.readouterr().err
    )


def test_a_hub_repo_that_could_not_be_pushed_to_is_refused_before_the_run(monkeypatch, capsys):
    """Offline or without a token, the push at the end would fail after the whole run."""
    import huggingface_hub

    import heads.hub

    argv = [str(TINY_MEDUSA), "hub.repo_id=me/heads"]
    monkeypatch.setattr(heads.hub, "hub_offline", lambda: True)
    with pytest.raises(SystemExit) as exit_:
        train.medusa.main(argv)
    assert exit_.value.code == 2
    assert "hub.repo_id=me/heads: HF_HUB_OFFLINE is set" in capsys.readouterr().err
    monkeypatch.setattr(heads.hub, "hub_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        train.medusa.main(argv)
    assert exit_.value.code == 2
    assert "no Hugging Face token: log in with `hf auth login`" in capsys.readouterr().err
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_token")
    assert train.run.parse_args(argv, "medusa").hub.repo_id == "me/heads"


def test_a_tracker_that_is_not_installed_is_refused_before_the_run(monkeypatch, capsys):
    """accelerate only warns and logs nothing: an 8-GPU run would find out when it is over."""
    import importlib.util

    from train.run import make_accelerator

    find_spec = importlib.util.find_spec
    missing = {"wandb", "tensorboard", "tensorboardX"}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in missing else find_spec(name, *a),
    )
    for tracker, advice in (
        ("wandb", "pip install 'headstart[wandb]'"),
        ("tensorboard", "tensorboard"),
    ):
        with pytest.raises(SystemExit) as exit_:
            make_accelerator(load_recipe(None, [f"logging.report_to={tracker}"]))
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"logging.report_to={tracker} needs the {tracker} package" in err
        assert advice in err and "logging.report_to=none" in err


def test_ctrl_c_says_what_is_kept_and_how_to_go_on(monkeypatch, capsys):
    """Ctrl-C printed a KeyboardInterrupt traceback (nothing was lost: checkpoints and shards
    are written whole); it now exits 130 with what is kept and the command that goes on."""
    import sys
    from pathlib import Path

    from train.run import run_training

    def interrupted(recipe):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        run_training(interrupted, [str(TINY_MEDUSA)], "medusa")
    assert exit_.value.code == 130
    assert "interrupted: the checkpoints in" in capsys.readouterr().err

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    import distill

    monkeypatch.setattr(distill, "distill", interrupted)
    assert distill.main([str(TINY_MEDUSA)]) == 130
    assert "the records written are kept" in capsys.readouterr().err


def test_an_output_folder_this_user_cannot_write_is_refused_before_the_base(
    tiny_task, tmp_path, capsys, monkeypatch
):
    """A folder under one the user may not write (root reads every permission as granted, so
    os.access answers as it would for another user): said before any loading, exit 2."""
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    import distill

    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and p != locked)
    monkeypatch.setattr(train.medusa, "load_frozen_base", None)  # never reached
    with pytest.raises(SystemExit) as exit_:
        run(train.medusa, TINY_MEDUSA, tiny_task, locked / "out")
    assert exit_.value.code == 2
    assert f"is {locked}/out, but {locked} is not writable by this user" in capsys.readouterr().err
    argv = [str(TINY_MEDUSA), f"data.output_dir={locked}/answers"]
    assert distill.main(argv) == 2
    assert f"is {locked}/answers, but {locked} is not writable" in capsys.readouterr().err


def test_a_base_the_generator_cannot_decode_is_said_when_training_starts(
    tmp_path, capsys, smollm2_tokenizer
):
    # A sliding window narrower than the context: the heads train and export, but the
    # generator refuses the base; that is said before the training, not found out after it.
    import torch
    from accelerate import Accelerator
    from transformers import MistralConfig, MistralForCausalLM

    from tests.conftest import TINY
    from train.run import load_frozen_base

    torch.manual_seed(0)
    tok = smollm2_tokenizer
    config = MistralConfig(**{**TINY, "vocab_size": len(tok), "sliding_window": 16})
    MistralForCausalLM(config).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    recipe = load_recipe(TINY_MEDUSA, [f"model.name_or_path={tmp_path / 'base'}"])
    load_frozen_base(recipe, Accelerator(cpu=True))
    out = capsys.readouterr().out
    assert "DynamicSlidingWindowLayer cache layers (sliding-window attention" in out
    assert "headstart's generator cannot decode it" in out
    config.sliding_window = None  # full attention: nothing to say
    MistralForCausalLM(config).save_pretrained(tmp_path / "full")
    tok.save_pretrained(tmp_path / "full")
    load_frozen_base(
        load_recipe(TINY_MEDUSA, [f"model.name_or_path={tmp_path / 'full'}"]), Accelerator(cpu=True)
    )
    assert "cannot decode" not in capsys.readouterr().out


def test_a_base_that_changes_its_logits_an_unknown_way_is_refused_before_training(
    tiny_base, monkeypatch, capsys
):
    # The heads learn the base's logits as heads.base.output_logits reads them: a transform
    # after the lm_head that it does not know (here a soft-cap without its config key) would
    # train them on other targets than the base's, so the run stops, as decoding would.
    import torch
    from accelerate import Accelerator

    import train.run
    from tests.conftest import change_logits

    real = train.run.load_base

    def capped(*args, **kwargs):
        base, tokenizer = real(*args, **kwargs)
        change_logits(base, torch.tanh)
        return base, tokenizer

    monkeypatch.setattr(train.run, "load_base", capped)
    recipe = load_recipe(TINY_MEDUSA, [f"model.name_or_path={tiny_base}"])
    with pytest.raises(SystemExit) as stop:
        train.run.load_frozen_base(recipe, Accelerator(cpu=True))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: the LlamaForCausalLM base computes its logits otherwise" in err
    monkeypatch.setattr(train.run, "load_base", real)
    base, _ = train.run.load_frozen_base(recipe, Accelerator(cpu=True))  # as it is: trains
    assert base.config.model_type == "llama"


def test_training_and_distill_refuse_each_others_folders(tiny_task, tmp_path, capsys, monkeypatch):
    """Training reads every *.jsonl of a distill folder: a run writing its metrics.jsonl and
    checkpoints into one (or distill answering into a training run's) is refused before any
    work, and the folder is left as it was."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    import distill

    answers = tmp_path / "answers"
    shutil.copytree(tiny_task.data_dir, answers)
    (answers / "manifest.json").touch()
    before = sorted(p.name for p in answers.iterdir())
    monkeypatch.setattr(train.medusa, "load_frozen_base", None)  # never reached
    with pytest.raises(SystemExit) as exit_:
        run(train.medusa, TINY_MEDUSA, tiny_task, answers)
    assert exit_.value.code == 2
    said = f"'output.dir' is {answers}, a distill run's folder (it holds manifest.json)"
    assert said in capsys.readouterr().err
    assert sorted(p.name for p in answers.iterdir()) == before
    for mark in ("metrics.jsonl", "checkpoints"):
        trained = tmp_path / mark.replace(".", "-")
        trained.mkdir()
        (trained / mark).touch()
        assert distill.main([str(TINY_MEDUSA), f"data.output_dir={trained}"]) == 2
        said = f"'data.output_dir' is {trained}, a training run's folder (it holds {mark})"
        assert said in capsys.readouterr().err
        assert [p.name for p in trained.iterdir()] == [mark]
