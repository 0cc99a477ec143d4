"""Training: recipes (config), prompt sources, self-distilled data and loss masks."""

from train.config import DataConfig, ModelConfig, Recipe, RecipeError, load_recipe, save_recipe
from train.data import (
    ChatTemplateError,
    build_examples,
    load_distilled,
    pad_batch,
    read_distilled,
    render_conversation,
    tokenize_conversation,
)
from train.prompts import Prompt, PromptSourceError, embedded_prompts, load_prompts

__all__ = [
    "ChatTemplateError",
    "DataConfig",
    "ModelConfig",
    "Prompt",
    "PromptSourceError",
    "Recipe",
    "RecipeError",
    "build_examples",
    "embedded_prompts",
    "load_distilled",
    "load_prompts",
    "load_recipe",
    "pad_batch",
    "read_distilled",
    "render_conversation",
    "save_recipe",
    "tokenize_conversation",
]
