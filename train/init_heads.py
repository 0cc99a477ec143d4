"""`training.init_heads`: start a recipe from trained heads, after checking that they are the
heads it builds (type, shape, vocabularies, aux layers) for its base."""

from __future__ import annotations

import warnings

import torch

from heads import EagleConfig
from heads.checkpoint import read_heads_folder, resolve_folder
from train.config import Recipe, RecipeError
from train.run import stop_on_bad_input

# What decides that trained heads are the ones a recipe builds: their shape, their vocabularies
# and the base layers they read (not, say, the eos ids); their base's sizes `check_base` checks.
_SHAPE_FIELDS = (
    "version",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "fc_bias",
    "target_hidden_size",
    "aux_layer_ids",
    "attention_bias",
    "mlp_bias",
    "num_heads",
    "num_hidden_layers",
    "medusa_fc_bias",
    "original_lm_head",
    "truncated_vocab_size",
)


def read_init_heads(recipe: Recipe, config, base) -> tuple[dict[str, torch.Tensor], str]:
    """`training.init_heads`: the tensors of the heads to start from, and where they are, after
    checking that their config.json describes the heads `config` builds (type, shape,
    vocabularies, aux layers) for `base`. Loading them checks each tensor's name and shape."""
    where = recipe.training.init_heads
    with stop_on_bad_input():
        folder = resolve_folder(where)
        theirs, tensors = read_heads_folder(folder, base.config.num_hidden_layers)
        if type(theirs) is not type(config):
            if isinstance(theirs, EagleConfig):
                how = f"train/eagle.py and a recipe of heads.type=eagle, heads.version={theirs.version}"
            else:
                how = "train/medusa.py and a recipe of heads.type=medusa"
            raise RecipeError(
                f"training.init_heads={where} holds {_kind(theirs)}, and this recipe trains "
                f"{_kind(config)}: go on training them with {how}, or leave init_heads out "
                "to start fresh"
            )
        diffs = [
            f"{name}: {_plain(getattr(theirs, name))!r} there, "
            f"{_plain(getattr(config, name))!r} here"
            for name in _SHAPE_FIELDS
            if hasattr(config, name)
            and _plain(getattr(theirs, name)) != _plain(getattr(config, name))
        ]
        if diffs:
            raise RecipeError(
                f"training.init_heads={where} is not the heads this recipe builds "
                f"({'; '.join(diffs)}): set the recipe's model and heads section as those heads "
                "were trained, or leave init_heads out to start fresh"
            )
        theirs.check_base(base.config)
    lora = getattr(theirs, "base_lora", "")
    if lora:  # Medusa-2 heads: they read the base with their adapter, which is not loaded
        now = "a fresh LoRA adapter" if recipe.heads.lora_r > 0 else "no adapter (Medusa-1)"
        warnings.warn(
            f"training.init_heads={where}: these Medusa-2 heads read the base with the LoRA "
            f"adapter in their '{lora}' folder; this run starts them on the base with {now}, "
            "so they relearn that base",
            stacklevel=2,
        )
    return tensors, str(folder)


def _kind(config) -> str:
    """Heads' kind in words: 'Medusa heads', 'an EAGLE-3 draft'."""
    return f"an EAGLE-{config.version} draft" if isinstance(config, EagleConfig) else "Medusa heads"


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
