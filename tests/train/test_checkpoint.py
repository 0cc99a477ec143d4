"""Resume's check of a checkpoint against the recipe (the runs themselves: test_recipes.py)."""

import json
import math
import shutil

import pytest
import yaml

from train.checkpoint import STATE_NAME, check_same_run, data_fingerprint, resolve_resume
from train.config import RecipeError, load_recipe, recipe_to_dict


def _checkpoint(path, recipe, processes=1, drop=()):
    path.mkdir()
    state = {
        "step": 4,
        "num_processes": processes,
        "data": data_fingerprint(recipe.data.output_dir),
    }
    (path / STATE_NAME).write_text(json.dumps(state))
    saved = recipe_to_dict(recipe)
    for section, key in drop:  # a recipe written before these keys existed
        del saved[section][key]
    (path / "recipe.yaml").write_text(yaml.safe_dump(saved))
    return path


def _answers(folder, *sizes):
    folder.mkdir(parents=True)
    for i, n in enumerate(sizes):
        (folder / f"shard-r000-{i:05d}.jsonl").write_text("x" * n)
    return folder


def test_what_may_change_on_resume_and_what_may_not(tmp_path):
    data = _answers(tmp_path / "distill", 10, 20)
    recipe = load_recipe(None, ["training.seed=3", f"data.output_dir={data}"])
    ckpt = _checkpoint(tmp_path / "a", recipe)
    moved = shutil.copytree(data, tmp_path / "elsewhere" / "distill")
    # epochs, learning rate, logging, the data folder's place and the base's spelling may change,
    # and what did is said (the base's spelling is the same base)
    said = check_same_run(
        ckpt,
        load_recipe(
            None,
            [
                "training.seed=3",
                f"data.output_dir={moved}",
                "training.epochs=9",
                "training.learning_rate=0.5",
                "logging.log_every_steps=1",
                "model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct",
            ],
        ),
        processes=1,
    )
    assert said == [
        f"data.output_dir: {str(data)!r} there, {str(moved)!r} now",
        "training.epochs: 1 there, 9 now",
        "training.learning_rate: 0.001 there, 0.5 now",
        "logging.log_every_steps: 10 there, 1 now",
    ]
    assert check_same_run(ckpt, recipe, processes=1) == []
    changed = {
        "data.system_prompt=Be brief.": r"data.system_prompt: None there, 'Be brief.' now",
        "training.micro_batch_size=3": "training.micro_batch_size: 8 there, 3 now",
        "training.loss_decay=0.5": "training.loss_decay: 0.8 there, 0.5 now",  # another loss
        "training.soft_labels=false": "training.soft_labels: True there, False now",
        "model.name_or_path=meta-llama/Llama-3.2-1B": "model.name_or_path: 'smollm2-135m-instruct'",
    }
    for override, message in changed.items():
        with pytest.raises(RecipeError, match=rf"{message}.*resume=never"):
            check_same_run(
                ckpt, load_recipe(None, ["training.seed=3", f"data.output_dir={data}", override]), 1
            )
    with pytest.raises(RecipeError, match="processes: 1 there, 2 now"):
        check_same_run(ckpt, recipe, processes=2)
    # distill added answers since (or the folder holds others): not the data it trained on
    (data / "shard-r000-00002.jsonl").write_text("more")
    with pytest.raises(
        RecipeError, match="answers in data.output_dir=.* are not those it trained on"
    ):
        check_same_run(ckpt, recipe, processes=1)


def test_keys_newer_than_the_checkpoint_and_old_checkpoints_pass(tmp_path):
    recipe = load_recipe(None, ["heads.num_heads=3"])
    ckpt = _checkpoint(tmp_path / "a", recipe, drop=[("heads", "num_heads"), ("training", "seed")])
    check_same_run(ckpt, load_recipe(None, ["heads.num_heads=5", "training.seed=7"]), 1)
    (ckpt / "recipe.yaml").unlink()
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 4}))  # before any of it was recorded
    check_same_run(ckpt, recipe, processes=4)


def test_resume_names_a_checkpoint_or_says_it_is_not_one(tmp_path):
    out = tmp_path / "out"
    assert resolve_resume("never", out) is None and resolve_resume("auto", out) is None
    step = out / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / STATE_NAME).write_text("{}")
    assert resolve_resume("auto", out) == step and resolve_resume(str(step), out) == step
    with pytest.raises(
        FileNotFoundError, match=rf"training.resume='{out}' is not a checkpoint folder"
    ):
        resolve_resume(str(out), out)  # the run's folder, not one of its checkpoints


def test_the_hub_gets_the_heads_folder_as_written(tiny_llama, tmp_path, fake_hub):
    """hub.repo_id pushes OUTPUT/heads as saved: in output.heads_dtype, with its model card and
    training_metrics.json (not a fresh fp32 save without them)."""
    import torch
    from accelerate import Accelerator
    from safetensors import safe_open

    from heads import MedusaConfig, MedusaHeads
    from train.outputs import save_final

    recipe = load_recipe(
        None, [f"output.dir={tmp_path}", "hub.repo_id=me/tiny-medusa", "hub.private=true"]
    )
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2))
    folder = save_final(recipe, heads, Accelerator(cpu=True), {"eval/step0/top1": 0.5})
    assert fake_hub.private == {"me/tiny-medusa": True}
    assert folder == tmp_path / "heads"
    assert fake_hub.folders["me/tiny-medusa"].name == "heads"  # a staged copy, as saved
    uploaded = fake_hub.files["me/tiny-medusa"]
    assert uploaded["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert {"config.json", "model.safetensors", "README.md", "training_metrics.json"} <= set(
        uploaded
    )
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_heads.0.weight").dtype == torch.bfloat16  # the recipe's default
    # the uploaded card names the repo; the folder's keeps its placeholder for other pushes
    assert '"model": "me/tiny-medusa"' in fake_hub.card("me/tiny-medusa")
    assert '"model": "REPO"' in (folder / "README.md").read_text()
    from heads.hub import push_folder

    push_folder(folder, "me/elsewhere")
    assert '"model": "me/elsewhere"' in fake_hub.card("me/elsewhere")
    assert not list(tmp_path.glob(".heads.push.*"))  # the staged copy is gone

    # no network: said, with where the heads are and how to push them again
    fake_hub.unreachable = True
    with pytest.raises(
        SystemExit, match="could not push to the Hub repo me/tiny-medusa: ConnectionError"
    ) as stop:
        save_final(recipe, heads, Accelerator(cpu=True), {})
    assert f"The heads are saved in {folder}; push them again" in str(stop.value)
    assert (folder / "model.safetensors").is_file()
    # the command given pushes them as the run would have: private, as the recipe asked
    command = str(stop.value).split("push them again with: python -c ")[1]
    fake_hub.unreachable, fake_hub.private = False, {}
    exec(command.strip('"'))
    assert fake_hub.private == {"me/tiny-medusa": True}


def test_a_resumed_optimizer_takes_the_recipes_rates_at_the_step_resumed(tmp_path):
    """A finished 4-step run resumed for 8 steps at another learning rate and weight decay:
    the optimizer itself, before its first step, holds the new rate on the 8-step schedule."""
    import torch
    from accelerate import Accelerator

    from train.checkpoint import load_checkpoint
    from train.steps import make_optimizer

    def prepared(rate: float, decay: float, steps: int):
        accelerator = Accelerator(cpu=True)
        recipe = load_recipe(
            None,
            [
                f"training.learning_rate={rate}",
                f"training.weight_decay={decay}",
                "training.warmup_steps=1",
            ],
        )
        model = torch.nn.Linear(2, 2)
        optimizer, scheduler = make_optimizer(recipe, model.parameters(), steps)
        return accelerator, *accelerator.prepare(model, optimizer, scheduler)

    accelerator, model, optimizer, scheduler = prepared(1e-3, 0.0, 4)
    for _ in range(4):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.0  # the 4-step schedule's end
    accelerator.save_state(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / STATE_NAME).write_text("{}")
    accelerator, model, optimizer, scheduler = prepared(1e-2, 0.1, 8)
    load_checkpoint(accelerator, tmp_path / "ckpt", optimizer, scheduler)
    # the 8-step schedule at step 4: cosine from the peak after 1 warm-up step, 3 of 7 done
    want = 1e-2 * 0.5 * (1 + math.cos(math.pi * 3 / 7))
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(want) and group["weight_decay"] == 0.1
    assert scheduler.get_last_lr() == [group["lr"]]
    scheduler.step()  # and on from there on the new schedule
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        1e-2 * 0.5 * (1 + math.cos(math.pi * 4 / 7))
    )
