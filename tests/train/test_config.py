from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from train.config import DataConfig, Recipe, RecipeError, load_recipe, save_recipe
from train.typed_config import apply_override, build

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_defaults_live_in_the_dataclasses():
    recipe = load_recipe(None)
    assert recipe == Recipe()
    assert recipe.model.name_or_path == "smollm2-135m-instruct"
    assert recipe.data.sources == ["embedded"] and recipe.data.temperature == 0.0


def test_yaml_and_overrides(tmp_path):
    path = write(
        tmp_path,
        "model:\n  dtype: float32\ndata:\n  sources: [a.jsonl]\n  limit: 5\n  temperature: 1\n",
    )
    recipe = load_recipe(
        path,
        [
            "data.limit=7",  # section.key
            "num_samples=2",  # bare key that names one field of one section
            "data.sources=[a.jsonl, hf:org/set:train]",
            "data.system_prompt=You are terse: answer in one line.",  # str kept verbatim
            "model.name_or_path=123",  # a str field does not become an int
        ],
    )
    assert recipe.model.dtype == "float32"
    assert recipe.data.limit == 7 and recipe.data.num_samples == 2
    assert recipe.data.temperature == 1.0 and isinstance(recipe.data.temperature, float)
    assert recipe.data.sources == ["a.jsonl", "hf:org/set:train"]
    assert recipe.data.system_prompt == "You are terse: answer in one line."
    assert recipe.model.name_or_path == "123"
    assert load_recipe(path, ["data.limit=null"]).data.limit is None
    assert load_recipe(path, ["data.sources=b.jsonl"]).data.sources == ["b.jsonl"]
    with pytest.raises(RecipeError, match="'top_p' is ambiguous; write one of data.top_p, self"):
        load_recipe(path, ["top_p=0.9"])


def test_unknown_key_lists_the_valid_keys(tmp_path):
    path = write(tmp_path, "data:\n  max_new_token: 10\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert (
        "unknown key 'data.max_new_token'" in message and "Did you mean 'max_new_tokens'" in message
    )
    assert "Valid keys of 'data': sources, limit, max_new_tokens" in message
    with pytest.raises(
        RecipeError, match="unknown key 'modle'.*Valid keys of the recipe's top level: model, data"
    ):
        load_recipe(write(tmp_path, "modle: {}\n"))
    with pytest.raises(RecipeError, match="unknown key 'data.bogus'.*Valid keys of 'data'"):
        load_recipe(None, ["data.bogus=1"])
    with pytest.raises(RecipeError, match="unknown key 'bogus'"):
        load_recipe(None, ["bogus=1"])


def test_wrong_type_names_field_expected_and_got(tmp_path):
    with pytest.raises(RecipeError, match=r"'data.limit' expects int \| None, got str 'many'"):
        load_recipe(write(tmp_path, "data:\n  limit: many\n"))
    with pytest.raises(RecipeError, match="'data.temperature' expects float, got bool True"):
        load_recipe(None, ["data.temperature=true"])
    with pytest.raises(RecipeError, match=r"'data.batch_size' expects int, got float 2.5"):
        load_recipe(None, ["data.batch_size=2.5"])
    with pytest.raises(RecipeError, match=r"'data.sources\[1\]' expects str, got int 3"):
        load_recipe(None, ["data.sources=[a, 3]"])
    with pytest.raises(
        RecipeError, match="'data.on_error' must be one of 'skip', 'stop', got 'ignore'"
    ):
        load_recipe(None, ["data.on_error=ignore"])
    with pytest.raises(RecipeError, match="'model' must be a mapping"):
        load_recipe(write(tmp_path, "model: 3\n"))


def test_cross_field_checks_and_bad_overrides():
    with pytest.raises(RecipeError, match="num_samples.*needs 'data.temperature' > 0"):
        load_recipe(None, ["data.num_samples=2"])
    assert load_recipe(None, ["data.num_samples=2", "data.temperature=0.7"]).data.num_samples == 2
    with pytest.raises(RecipeError, match="'data.batch_size' must be >= 1"):
        load_recipe(None, ["data.batch_size=0"])
    with pytest.raises(RecipeError, match="'data.sources' is empty"):
        load_recipe(None, ["data.sources=[]"])
    with pytest.raises(RecipeError, match="expected key=value"):
        load_recipe(None, ["data.limit"])
    with pytest.raises(RecipeError, match="has no sub-keys"):
        load_recipe(None, ["data.limit.x=1"])
    with pytest.raises(RecipeError, match="feature_cache needs training.mode=offline"):
        load_recipe(None, ["training.feature_cache=cache"])
    cached = load_recipe(None, ["training.feature_cache=c", "training.mode=offline"]).training
    assert cached.feature_cache == "c"


def test_yaml_words_that_read_as_bools_keep_their_choice(tmp_path):
    # YAML 1.1 reads a bare `no` as False; mixed_precision's choices are words.
    for text in ("no", "off", "'no'", " no"):
        recipe = load_recipe(None, [f"training.mixed_precision={text}"])
        assert recipe.training.mixed_precision == "no"
    assert load_recipe(None, ['training.mixed_precision="bf16"']).training.mixed_precision == "bf16"
    recipe = load_recipe(write(tmp_path, "training:\n  mixed_precision: no\n"))
    assert recipe.training.mixed_precision == "no"
    with pytest.raises(RecipeError, match="must be one of .*got True .*quote the word"):
        load_recipe(write(tmp_path, "training:\n  mixed_precision: yes\n"))
    with pytest.raises(RecipeError, match="'heads.type' must be one of 'medusa', 'eagle', got 1"):
        load_recipe(None, ["heads.type=1"])


def test_save_recipe_round_trips(tmp_path):
    recipe = load_recipe(None, ["data.limit=3", "data.system_prompt=Hi"])
    save_recipe(recipe, tmp_path / "resolved.yaml")
    assert load_recipe(tmp_path / "resolved.yaml") == recipe
    assert DataConfig().max_new_tokens == recipe.data.max_new_tokens


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_load(path):
    assert isinstance(load_recipe(path), Recipe)


def test_a_new_section_is_just_a_dataclass_field(monkeypatch):
    import train.config as config

    @dataclass
    class Heads:
        num_heads: int = 4
        aux_layer_ids: tuple[int, ...] = (2, 15, 27)
        loss_weights: dict[str, float] = field(default_factory=dict)

    @dataclass
    class Extended(Recipe):
        heads: Heads = field(default_factory=Heads)

    monkeypatch.setattr(config, "Recipe", Extended)
    recipe = load_recipe(
        None, ["heads.num_heads=5", "heads.aux_layer_ids=[1, 2, 3]", "heads.loss_weights={a: 1}"]
    )
    assert recipe.heads == Heads(5, (1, 2, 3), {"a": 1.0})
    with pytest.raises(
        RecipeError, match="Valid keys of 'heads': num_heads, aux_layer_ids, loss_weights"
    ):
        load_recipe(None, ["heads.nm_heads=5"])
    with pytest.raises(RecipeError, match=r"'heads.aux_layer_ids\[1\]' expects int, got str 'x'"):
        load_recipe(None, ["heads.aux_layer_ids=[1, x]"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.keep_last_checkpoints=0", "keep_last_checkpoints >= 1"),
        ("training.max_steps=0", "max_steps >= 1, or null"),
        ("training.warmup_steps=-1", r"warmup_steps >= 0 \(0: no warmup\)"),
        ("training.eval_every_steps=-5", "eval_every_steps >= 0"),
        ("training.save_every_steps=-1", "save_every_steps >= 0"),
        ("training.max_grad_norm=0", "max_grad_norm > 0"),
        ("training.max_length=1", "max_length >= 2"),
        ("training.weight_decay=-0.1", "weight_decay >= 0"),
        ("training.text_max_tokens=-1", r"text_max_tokens >= 0 \(0: all of the text corpus\)"),
        ("logging.log_every_steps=0", "log_every_steps >= 1, got 0"),
        ("heads.draft_vocab_size=0", r"heads.draft_vocab_size >= 1 \(the draft's most frequent"),
    ],
)
def test_counts_that_would_break_a_run_are_refused_up_front(override, message):
    # keep_last_checkpoints=0 would delete the checkpoint just written, log_every_steps=0
    # divide by zero at the first step: refused before any work
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, [override])
    field = override.split("=")[0]
    assert load_recipe(None, [f"{field}=2"]) is not None  # a sane value loads


@pytest.mark.parametrize(
    "override, sane, message",
    [
        ("training.loss_decay=-1", "0", r"loss_decay >= 0 \(head / TTT step k's loss weighs"),
        ("heads.kl_weight=.nan", "0.5", "'heads.kl_weight' expects a finite float, got nan"),
        ("heads.kl_weight=-1", "0", "heads.kl_weight >= 0, got -1"),
        ("heads.heads_loss_warmup_steps=-5", "0", "heads_loss_warmup_steps >= 0, got -5"),
        ("heads.token_loss_weight=-1", "0.2", "token_loss_weight >= 0"),
        ("heads.feature_loss_weight=-0.5", "2", "feature_loss_weight >= 0"),
        ("heads.feature_noise=-1", "0", "feature_noise >= 0"),
        ("heads.heads_lr_multiplier=0", "1", r"heads_lr_multiplier > 0; got 16, 0.0 and 0"),
        ("heads.lora_alpha=0", "32", "lora_alpha > 0"),
        ("heads.lora_dropout=2", "0.1", "0 <= lora_dropout < 1"),
        ("self_instruct.seed_sources=[]", "[embedded]", "seed_sources is empty: name the"),
    ],
)
def test_loss_settings_that_would_train_the_heads_wrong_are_refused(override, sane, message):
    """A negative loss weight trains the heads away from their target and a zero learning-rate
    multiplier never trains them: refused with the recipe, before the base loads."""
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, [override])
    field = override.split("=")[0]
    assert load_recipe(None, [f"{field}={sane}"]) is not None


def test_a_recipe_that_is_not_there_is_named_with_the_shipped_ones(tmp_path):
    with pytest.raises(
        RecipeError,
        match=r"recipe .*nope.yaml not found \(the shipped ones, in recipes/: .*"
        r"smollm2-135m-eagle.yaml",
    ):
        load_recipe(tmp_path / "nope.yaml")


def test_aux_layers_out_of_order_are_refused_up_front():
    # vLLM and SGLang collect the base's states in layer order: a draft trained on another
    # order would be fed its fc's inputs swapped there
    with pytest.raises(RecipeError, match=r"\[15, 2, 27\]: give them in ascending order"):
        load_recipe(None, ["heads.aux_layer_ids=[15, 2, 27]"])
    assert load_recipe(None, ["heads.aux_layer_ids=[2, 15, 27]"]).heads.aux_layer_ids == [2, 15, 27]


def test_a_warm_up_as_long_as_the_run_is_said(capsys):
    from types import SimpleNamespace

    from train.steps import count_steps

    one = SimpleNamespace(num_processes=1, process_index=0, print=print)
    # 7 examples in micro-batches of 4: one optimizer step, all of it warm-up (lr 0)
    recipe = load_recipe(None, ["training.micro_batch_size=4", "training.warmup_steps=1"])
    assert count_steps(7, recipe, one) == (1, 1)
    assert "warmup_steps=1 is not under the run's 1 optimizer steps" in capsys.readouterr().err
    assert count_steps(29, recipe, one) == (7, 7)
    assert capsys.readouterr().err == ""


def test_exponent_floats_and_null_words_read_as_meant(tmp_path):
    # YAML 1.1 leaves 3e-4 a string and reads None as the string "None": neither is what a user
    # writing a learning rate or clearing a setting means
    path = write(tmp_path, "training:\n  learning_rate: 2e-5\n")
    assert load_recipe(path).training.learning_rate == 2e-5
    recipe = load_recipe(
        path,
        [
            "training.learning_rate=3e-4",
            "training.max_steps=1e3",
            "data.system_prompt=None",
            "hub.repo_id=none",
            "data.limit=None",
        ],
    )
    assert recipe.training.learning_rate == 3e-4 and recipe.training.max_steps == 1000
    assert recipe.data.system_prompt is None and recipe.hub.repo_id is None
    assert recipe.data.limit is None
    # where "none" or "" is a value, not null, they stay so
    assert load_recipe(None, ["logging.report_to=none"]).logging.report_to == "none"
    assert load_recipe(None, ["data.system_prompt="]).data.system_prompt == ""
    for bad in (
        "training.learning_rate=3e",
        "training.max_steps=1.5e0",
        "training.max_steps=1e999",
    ):
        with pytest.raises(RecipeError, match="expects"):
            load_recipe(None, [bad])


def test_training_beside_the_answers_it_reads_is_refused(tmp_path, monkeypatch):
    """Training reads every *.jsonl of data.output_dir: its metrics.jsonl written there would be
    read as answers by the next run. Another spelling of the same folder is the same folder."""
    monkeypatch.chdir(tmp_path)
    for same in (["runs/x", "runs/x"], ["runs/x", f"{tmp_path}/runs/./x"]):
        with pytest.raises(RecipeError, match="output.dir and data.output_dir are both runs/x"):
            load_recipe(None, [f"output.dir={same[0]}", f"data.output_dir={same[1]}"])
    recipe = load_recipe(None, ["output.dir=runs/x/heads", "data.output_dir=runs/x"])
    assert recipe.output.dir == "runs/x/heads"


def test_null_for_a_text_field_and_files_where_folders_go_are_refused_up_front(tmp_path):
    # `data.output_dir=null` made a folder named "null"; an output path that is a file, a
    # recipe that is a folder or not text ended in tracebacks from the filesystem or the codec
    with pytest.raises(RecipeError, match="'data.output_dir' cannot be null"):
        load_recipe(None, ["data.output_dir=null"])
    a_file = write(tmp_path, "data:\n  limit: 2\n")
    for key in ("data.output_dir", "output.dir", "training.feature_cache"):
        extra = ["training.mode=offline"] if key == "training.feature_cache" else []
        with pytest.raises(RecipeError, match=f"'{key}' is .*, a file: give a folder"):
            load_recipe(None, [f"{key}={a_file}", *extra])
    with pytest.raises(RecipeError, match="is a folder: give a recipe file"):
        load_recipe(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RecipeError, match="binary.yaml: not a YAML recipe .not UTF-8"):
        load_recipe(binary)


def test_max_steps_overrides_epochs_as_in_hf_trainer():
    from types import SimpleNamespace

    from train.steps import count_steps

    one = SimpleNamespace(num_processes=1, process_index=0, print=print)
    # 29 examples in micro-batches of 4: 7 steps an epoch
    settings = ["training.micro_batch_size=4", "training.epochs=2"]
    assert count_steps(29, load_recipe(None, settings), one) == (7, 14)
    assert count_steps(29, load_recipe(None, [*settings, "training.max_steps=5"]), one) == (7, 5)
    assert count_steps(29, load_recipe(None, [*settings, "training.max_steps=20"]), one) == (7, 20)


def test_settings_of_the_other_eagle_version_are_named():
    eagle1 = load_recipe("recipes/tiny-eagle.yaml", ["heads.version=1"]).heads
    assert eagle1.unused_eagle_settings() == ["heads.draft_vocab_size=256", "heads.ttt_steps=3"]
    eagle3 = load_recipe("recipes/tiny-eagle.yaml", ["heads.feature_noise=0.1"]).heads
    assert eagle3.unused_eagle_settings() == ["heads.feature_noise=0.1"]
    assert load_recipe("recipes/tiny-eagle.yaml").heads.unused_eagle_settings() == []


@dataclass
class Schedule:
    peak: float | Literal["auto"] = "auto"
    window: tuple[int, int] = (0, 10)


def test_null_is_refused_for_a_union_that_does_not_take_none():
    assert build(Schedule, {"peak": 3e-4}, "schedule", "r.yaml") == Schedule(peak=3e-4)
    assert build(Schedule, {"peak": "auto"}, "schedule", "r.yaml") == Schedule(peak="auto")
    with pytest.raises(RecipeError, match=r"r.yaml: 'schedule.peak' expects .*, got NoneType None"):
        build(Schedule, {"peak": None}, "schedule", "r.yaml")


def test_a_fixed_length_tuple_takes_exactly_its_length():
    assert build(Schedule, {"window": [2, 5]}, "schedule", "r.yaml").window == (2, 5)
    for wrong in ([2], [2, 5, 9]):
        with pytest.raises(RecipeError, match=r"'schedule.window' expects tuple\[int, int\]"):
            build(Schedule, {"window": wrong}, "schedule", "r.yaml")


@pytest.mark.parametrize("item", ["=5", " =5", "data.limit"])
def test_an_override_without_a_key_or_value_shows_the_form(item):
    with pytest.raises(RecipeError, match=r"expected key=value \(e.g. data.limit=100\)"):
        apply_override(Recipe, {}, item)


def test_an_override_without_a_value_is_refused_unless_the_field_takes_text():
    # `data.limit=` read as null would answer every prompt of the sources instead of the limit
    for item in ("data.limit=", "training.max_steps= ", "training.learning_rate="):
        with pytest.raises(RecipeError, match=f"override '{item}' has no value"):
            load_recipe(None, [item])
    assert load_recipe(None, ["data.limit=null"]).data.limit is None  # said, it is taken
    assert load_recipe(None, ["hub.repo_id="]).hub.repo_id == ""  # text: empty, no push
    # a folder or the base left empty would be the working directory or no model at all
    for key in ("output.dir", "data.output_dir", "model.name_or_path"):
        with pytest.raises(RecipeError, match=f"'{key}' is empty: give"):
            load_recipe(None, [f"{key}="])
