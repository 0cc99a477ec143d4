"""What the decode loop needs of a base, checked when a generator is built: a base whose tree
forward would not be its own computation is refused, and generation_config settings that HF
`generate` applies and the verifier does not are said."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from heads.base import input_device, logits_scaling


def check_base_takes_trees(base: PreTrainedModel) -> None:
    """Refuse a base whose verification forward would not be the base's own computation.

    A tree verifies in one forward with a 4D additive mask and per-node positions, and the
    cache keeps the accepted rows by absolute position: that needs sdpa or eager attention and
    full attention in every layer (a sliding-window layer keeps only its last keys).
    """
    if hasattr(base, "peft_config") and hasattr(base, "merge_and_unload"):
        raise ValueError(
            f"the base is a peft {type(base).__name__} (an adapter not merged): the generator "
            "runs the base's decoder itself; merge the adapter first, base = "
            "base.merge_and_unload()"
        )
    if not isinstance(getattr(base, "model", None), nn.Module):
        raise ValueError(
            f"{type(base).__name__} has no .model decoder: the generator runs Llama-style "
            "causal LMs (Llama, Mistral, Qwen2, SmolLM, ...: a base whose decoder is `.model`)"
        )
    attn = getattr(base.config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        raise ValueError(
            f"the base runs attn_implementation={attn!r}, which does not take the 4D tree "
            "masks that verify a draft in one forward: load it with attn_implementation='sdpa' "
            "(load_base's default) or 'eager'"
        )
    other = windowed_cache_layers(base.config)
    if other:
        raise ValueError(
            f"{not_full_attention(other)}: tree verification keeps and crops the KV cache by "
            "position, which needs full attention in every layer, so headstart's generator "
            "cannot decode this base. Heads trained for it still export (scripts/export.py) "
            "for an engine that serves it; to decode with headstart, choose a base with full "
            "attention"
        )


def not_full_attention(kinds: list[str]) -> str:
    """What `windowed_cache_layers`' kinds are, in words."""
    what = (
        "sliding-window attention narrower than the context, as in Mistral v0.1 or Gemma-2/3"
        if all("Sliding" in kind for kind in kinds)
        else "layers other than full attention: a sliding window, or Mamba, convolution or "
        "linear-attention layers"
    )
    return f"the base has {', '.join(kinds)} cache layers ({what})"


def windowed_cache_layers(config) -> list[str]:
    """The kinds of cache layers narrower than the context that a model of `config` builds
    (sliding-window attention): their caches cannot be cropped back to an accepted prefix. A
    window as wide as the context never applies (the loop stops within the context)."""
    context = config.max_position_embeddings
    return sorted(
        {
            type(layer).__name__
            for layer in DynamicCache(config=config).layers
            if type(layer) is not DynamicLayer and getattr(layer, "sliding_window", 0) < context
        }
    )


# Bases whose HF `generate` computes the whole sequence again (no cache) at the step whose cache
# first holds `config.original_max_position_embeddings` tokens, whatever their rope (for
# longrope: so that every cached token has the long factors): transformers' Phi-3 family
# overrides `prepare_inputs_for_generation` to do so.
RECOMPUTE_AT_ORIGINAL_CONTEXT = ("phi3", "phimoe", "phi4_multimodal")


@dataclass(frozen=True)
class PositionRules:
    """Where a base's HF `generate`, one token a step, computes otherwise than one forward of a
    tree would: trees must not reach a position of `crossings` from below (plain steps cross
    it), and at `recompute_at` cached tokens the whole sequence is computed again."""

    crossings: tuple[int, ...] = ()
    recompute_at: int | None = None


def position_rules(config) -> PositionRules:
    """The base's `PositionRules`: a longrope base (Phi-3.5-mini, Phi-4-mini) switches to its
    long factors at `original_max_position_embeddings`, and the Phi-3 family recomputes there.

    transformers picks a forward's longrope factors from its last position alone: long for every
    token of it once that position reaches the switch. HF `generate` feeds one token a step, so
    a token's factors follow its own position; a tree forward that reaches the switch from below
    would rotate its first tokens, the root always kept, with the long ones.
    """
    crossings, recompute_at = set(), None
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = params or {}
    per_layer_type = [p for p in params.values() if isinstance(p, dict)]
    for p in [params, *per_layer_type]:
        if p.get("rope_type", p.get("type")) == "longrope":
            switch = p.get("original_max_position_embeddings")
            crossings.add(int(switch or config.original_max_position_embeddings))
    original = getattr(config, "original_max_position_embeddings", None)
    if getattr(config, "model_type", None) in RECOMPUTE_AT_ORIGINAL_CONTEXT and original:
        recompute_at = int(original)
        crossings.add(recompute_at)  # a tree must not jump over it
    return PositionRules(tuple(sorted(crossings)), recompute_at)


# What a base's generation_config may set that makes HF `generate` change the logits before it
# chooses a token, with the values that change nothing. The verifier reads the base's own logits.
_LOGITS_SETTINGS = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "bad_words_ids": (None, []),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "sequence_bias": (None, {}),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
}


def plain_generation_config(base: PreTrainedModel) -> GenerationConfig:
    """The base's generation_config without its logits settings."""
    plain = copy.deepcopy(getattr(base, "generation_config", None) or GenerationConfig())
    for name in _LOGITS_SETTINGS:
        setattr(plain, name, None)
    return plain


@contextmanager
def plain_generation(
    base: PreTrainedModel, plain: GenerationConfig | None = None
) -> Iterator[None]:
    """Within it, HF `generate` on `base` chooses from the base's own logits, as the verifier
    does (what distill generates and bench compares against): the base's generation_config is
    `plain` (default: `plain_generation_config(base)`) for the while. (Given to `generate`
    instead, such a config would be filled from the base's own where it holds None.)"""
    kept = base.generation_config
    base.generation_config = plain or plain_generation_config(base)
    try:
        yield
    finally:
        base.generation_config = kept


def warn_unapplied_logits_settings(base: PreTrainedModel) -> None:
    """Say which of the base's generation_config settings `base.generate()` applies and the
    generator does not (Qwen2.5-Instruct's repetition_penalty 1.05, for one)."""
    config = getattr(base, "generation_config", None)
    found = {
        name: getattr(config, name)
        for name, neutral in _LOGITS_SETTINGS.items()
        if getattr(config, name, None) not in neutral
    }
    if found:
        settings = ", ".join(f"{k}={v!r}" for k, v in found.items())
        warnings.warn(
            f"the base's generation_config sets {settings}, which HF generate applies to the "
            "logits: the generator verifies the base's own logits, so its output is the base's "
            "greedy (or sampled) output without them and may differ from base.generate()'s. "
            "Compare against base.generate() within inference.plain_generation(base).",
            stacklevel=3,
        )


def base_logits(base: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """The base's logits from its decoder's last hidden states, as its own forward computes
    them: the output embeddings, then the scaling that `heads.base.logits_scaling` knows
    (Granite's, Cohere's, Gemma-2's soft-cap and others) applies after them; checked
    against the base's forward on one token, so that a base that changes its logits another way
    is refused, not sampled from another distribution.

    Raises:
        ValueError: the base's forward computes other logits.
    """
    head, scaling = base.get_output_embeddings(), logits_scaling(base)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        # on the states' device, where a dispatched base keeps its lm_head on another one
        out = head(hidden)
        return (scaling(out) if scaling else out).to(hidden.device)

    token = getattr(base.config, "bos_token_id", None)
    token = token if isinstance(token, int) else 0
    ids = torch.tensor([[token]], device=input_device(base))  # as generate feeds
    with torch.no_grad():
        want = base(input_ids=ids).logits[0, -1]
        got = logits(base.model(input_ids=ids).last_hidden_state[0, -1]).to(want.device)
    # the same computation, but perhaps by another kernel (one row against a batch of one): as
    # far apart as a few roundings of the logits' dtype, where a scaling is far more
    eps = max(torch.finfo(want.dtype).eps, torch.finfo(got.dtype).eps)  # one may be upcast
    tolerance = max(1e-3, 4 * eps) * float(want.float().abs().max())
    if float((got.float() - want.float()).abs().max()) > tolerance:
        raise ValueError(
            f"the {type(base).__name__} base computes its logits otherwise than its output "
            "embeddings do (a scaling or soft-capping after the lm_head that headstart does not "
            "know): the verifier would not sample the base's own distribution"
        )
    return logits
