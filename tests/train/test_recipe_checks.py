"""Recipe checks at their boundaries: values just outside and inside each range, empty files and
sections, where an error says it came from, unwritable folders, override parsing (typos, a
mapping for a list, bools for ints, exponents, `~`, `=` in a value) and non-finite floats."""

import os
from pathlib import Path

import pytest

from train.config import RecipeError, check_writable, load_recipe


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "override, message",
    [
        # records_per_shard dropped from the ">= 1" list
        ("data.records_per_shard=0", r"'data.records_per_shard' must be >= 1, got 0"),
        # limit 0 would load no prompt at all (prompts[:0])
        ("data.limit=0", r"'data.limit' must be >= 1 or null, got 0"),
        # top_p=0 keeps no token to sample from
        ("data.top_p=0", r"need temperature >= 0 and 0 < top_p <= 1, got 0.0, 0.0"),
        # there is no EAGLE-2 recipe
        ("heads.version=2", r"'heads.version' must be 1 or 3, got 2"),
        # every example held out leaves nothing to train on
        ("training.eval_fraction=1", r"0 <= eval_fraction < 1"),
        # a negative LoRA rank
        ("heads.lora_r=-1", r"lora_r >= 0"),
        # self_instruct writing zero prompts
        ("self_instruct.num_prompts=0", r"need self_instruct.num_prompts, examples_per_prompt"),
    ],
)
def test_boundary_values_are_refused_up_front(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, [override])


def test_boundary_values_just_inside_load():
    recipe = load_recipe(
        None,
        [
            "data.records_per_shard=1",
            "data.limit=1",
            "data.top_p=1",
            "heads.version=1",
            "training.eval_fraction=0",
            "heads.lora_r=0",
            "self_instruct.num_prompts=1",
        ],
    )
    assert recipe.data.limit == 1 and recipe.heads.version == 1


def test_an_empty_recipe_or_an_empty_section_is_the_defaults(tmp_path):
    # an empty (or all-comments) file is the defaults, not "got NoneType"
    assert load_recipe(write(tmp_path, "# every key left at its default\n")) == load_recipe(None)
    # a section whose keys are all commented out is that section's defaults
    recipe = load_recipe(write(tmp_path, "data:\n  # limit: 5\nmodel:\n"))
    assert recipe == load_recipe(None)
    # ... and an override can still set a key in it
    recipe = load_recipe(write(tmp_path, "data:\n"), ["data.limit=3"])
    assert recipe.data.limit == 3


def test_errors_say_whether_command_line_overrides_took_part(tmp_path):
    # the location names the overrides only when there were some
    # a cross-field (__post_init__) error is prefixed with the recipe's location too
    path = write(tmp_path, "data:\n  batch_size: 0\n")
    with pytest.raises(RecipeError) as plain:
        load_recipe(path)
    assert str(plain.value).startswith(f"{path}: ")
    assert "command-line overrides" not in str(plain.value)
    with pytest.raises(RecipeError) as overridden:
        load_recipe(path, ["data.limit=2"])
    assert str(overridden.value).startswith(f"{path} (with command-line overrides): ")


def test_a_read_only_folder_is_not_writable(tmp_path, monkeypatch):
    # the check asks for write (and search) permission, not read; the stand-in os.access
    # answers per mode, as for a non-root user on a r-x folder
    locked = tmp_path / "readonly"
    locked.mkdir()
    access = os.access

    def fake_access(p, mode):
        if Path(p) == locked:
            return not mode & os.W_OK
        return access(p, mode)

    monkeypatch.setattr(os, "access", fake_access)
    with pytest.raises(RecipeError, match=f"{locked} is not writable by this user"):
        check_writable("output.dir", locked / "out")
    check_writable("output.dir", tmp_path / "elsewhere")  # a writable parent passes


def test_a_typo_further_off_still_gets_a_suggestion():
    # difflib's default cutoff (0.6) suggests the key for a truncated name
    with pytest.raises(
        RecipeError, match=r"unknown key 'data.max_new'. Did you mean 'max_new_tokens'\?"
    ):
        load_recipe(None, ["data.max_new=10"])


def test_a_mapping_for_a_list_field_is_refused_not_read_as_its_keys():
    # a dict is not silently turned into the list of its keys
    with pytest.raises(RecipeError, match=r"'data.sources' expects list\[str\], got dict"):
        load_recipe(None, ["data.sources={a.jsonl: 1}"])


def test_a_bool_for_an_int_field_is_a_type_error():
    # bool is an int subclass in Python; `batch_size: true` is not a batch size of 1
    with pytest.raises(RecipeError, match="'data.batch_size' expects int, got bool True"):
        load_recipe(None, ["data.batch_size=true"])
    with pytest.raises(RecipeError, match=r"'data.limit' expects int \| None, got bool False"):
        load_recipe(None, ["data.limit=false"])


def test_an_overflowing_exponent_is_not_an_infinite_float():
    # 1e999 reads as inf; a learning rate of inf passes "> 0"
    with pytest.raises(RecipeError, match="'training.learning_rate' expects float"):
        load_recipe(None, ["training.learning_rate=1e999"])


def test_an_upper_case_exponent_reads_as_a_number():
    # YAML 1.1 leaves 3E-4 a string too
    recipe = load_recipe(None, ["training.learning_rate=3E-4", "training.max_steps=2E3"])
    assert recipe.training.learning_rate == 3e-4 and recipe.training.max_steps == 2000


def test_a_tilde_is_null_for_a_text_field_too():
    # `~` is YAML's null; for a folder it would make a folder named "~"
    with pytest.raises(RecipeError, match="'data.output_dir' cannot be null"):
        load_recipe(None, ["data.output_dir=~"])
    with pytest.raises(RecipeError, match="'output.dir' cannot be null"):
        load_recipe(None, ["output.dir= ~ "])


def test_a_text_override_is_kept_verbatim_even_with_an_equals_sign_and_spaces():
    # spaces kept, and split at the first '=' only
    recipe = load_recipe(None, ["data.system_prompt=  Reply with x=1 or y=2.  "])
    assert recipe.data.system_prompt == "  Reply with x=1 or y=2.  "
    recipe = load_recipe(None, ["model.name_or_path=org/model=v2"])
    assert recipe.model.name_or_path == "org/model=v2"


@pytest.mark.parametrize(
    "override",
    [
        "training.learning_rate=.nan",
        "training.learning_rate=.inf",
        "training.max_grad_norm=.nan",
        "data.temperature=.nan",
        "training.loss_decay=.nan",
    ],
)
def test_non_finite_floats_are_refused(override):
    with pytest.raises(RecipeError, match="expects a finite float"):
        load_recipe(None, [override])


def test_non_finite_floats_in_a_recipe_file_are_refused(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("training:\n  learning_rate: .nan\n")
    with pytest.raises(
        RecipeError, match="'training.learning_rate' expects a finite float, got nan"
    ):
        load_recipe(path)
