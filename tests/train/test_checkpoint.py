"""Resume's check of a checkpoint against the recipe (the runs themselves: test_recipes.py)."""

import json

import pytest
import yaml

from train.checkpoint import STATE_NAME, check_same_run
from train.config import RecipeError, load_recipe, recipe_to_dict


def _checkpoint(path, recipe, processes=1, drop=()):
    path.mkdir()
    (path / STATE_NAME).write_text(json.dumps({"step": 4, "num_processes": processes}))
    saved = recipe_to_dict(recipe)
    for section, key in drop:  # a recipe written before these keys existed
        del saved[section][key]
    (path / "recipe.yaml").write_text(yaml.safe_dump(saved))
    return path


def test_what_may_change_on_resume_and_what_may_not(tmp_path):
    recipe = load_recipe(None, ["training.seed=3", "data.limit=100"])
    ckpt = _checkpoint(tmp_path / "a", recipe)
    # epochs, learning rate, logging and the data folder's place may change
    check_same_run(
        ckpt,
        load_recipe(
            None,
            [
                "training.seed=3",
                "data.limit=100",
                "training.epochs=9",
                "training.learning_rate=0.5",
                "logging.log_every_steps=1",
                "data.output_dir=/elsewhere/distill",
            ],
        ),
        processes=1,
    )
    with pytest.raises(RecipeError, match=r"data.limit: 100 there, 200 now.*resume=never"):
        check_same_run(ckpt, load_recipe(None, ["training.seed=3", "data.limit=200"]), 1)
    with pytest.raises(RecipeError, match="processes: 1 there, 2 now"):
        check_same_run(ckpt, recipe, processes=2)


def test_keys_newer_than_the_checkpoint_and_old_checkpoints_pass(tmp_path):
    recipe = load_recipe(None, ["heads.num_heads=3"])
    ckpt = _checkpoint(tmp_path / "a", recipe, drop=[("heads", "num_heads"), ("training", "seed")])
    check_same_run(ckpt, load_recipe(None, ["heads.num_heads=5", "training.seed=7"]), 1)
    (ckpt / "recipe.yaml").unlink()
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 4}))  # before either was recorded
    check_same_run(ckpt, recipe, processes=4)
