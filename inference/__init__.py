"""headstart inference: token trees, tree attention, lossless verification, the decode loop."""

from inference.base_checks import plain_generation, plain_generation_config
from inference.draft import Draft, Drafter, Sampling
from inference.drafters.eagle import EagleDrafter
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.model import ModelDrafter
from inference.drafters.ngram import NgramDrafter, NgramTable
from inference.drafters.union import UnionDrafter
from inference.generate import SpeculativeGenerator, make_drafter
from inference.output import GenerationOutput
from inference.tree import PRESETS, Tree, get_preset, tree_from_choices, tree_from_parents

__all__ = [
    "PRESETS",
    "Draft",
    "Drafter",
    "EagleDrafter",
    "GenerationOutput",
    "MedusaDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "NgramTable",
    "Sampling",
    "SpeculativeGenerator",
    "Tree",
    "UnionDrafter",
    "get_preset",
    "make_drafter",
    "plain_generation",
    "plain_generation_config",
    "tree_from_choices",
    "tree_from_parents",
]
