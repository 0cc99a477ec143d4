"""headstart heads: Medusa heads and EAGLE draft layers for a frozen base model."""

from heads.base import default_aux_layer_ids, load_base, load_base_config, read_hidden_states
from heads.checkpoint import load_heads
from heads.eagle import EagleDraft
from heads.eagle_config import EagleConfig
from heads.medusa import MedusaConfig, MedusaHeads

__all__ = [
    "EagleConfig",
    "EagleDraft",
    "MedusaConfig",
    "MedusaHeads",
    "default_aux_layer_ids",
    "load_base",
    "load_base_config",
    "load_heads",
    "read_hidden_states",
]
