"""Drafters: each proposes a token tree for one verify step (see inference.draft.Drafter).

`make_drafter` picks the drafter for what the caller gives: heads, a draft model, a drafter, a
list of them, or nothing.
"""

from __future__ import annotations

import inspect
import os

from transformers import PreTrainedModel

from inference.draft import Drafter

# generate()'s own arguments: given to the generator's constructor they are a common slip.
GENERATE_ARGS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "eos_token_id",
    "stop_strings",
    "tokenizer",
    "acceptance",
)


def build(drafter_class: type, *args, **options) -> Drafter:
    """`drafter_class(*args, **options)`, with a clear error for options it does not take (its
    constructor's parameters after `args`), naming those it takes, and generate()'s arguments
    where one was meant."""
    params = list(inspect.signature(drafter_class.__init__).parameters)[1 + len(args) :]
    unknown = sorted(set(options) - set(params))
    if not unknown:
        return drafter_class(*args, **options)
    meant = [k for k in unknown if k in GENERATE_ARGS]
    hint = (
        f"; {', '.join(meant)} {'is an argument' if len(meant) == 1 else 'are arguments'} of "
        "gen.generate(...) / gen.stream(...), not of the generator"
        if meant
        else ""
    )
    raise TypeError(
        f"{drafter_class.__name__} takes no option {', '.join(map(repr, unknown))} "
        f"(its options: {', '.join(params) or 'none'}){hint}"
    )


def make_drafter(base: PreTrainedModel, heads_or_drafter, **options) -> Drafter:
    """Wrap heads in the matching drafter; a Drafter passes through; a causal LM becomes a
    draft model; None gives the n-gram drafter; a list or tuple of these gives the union of
    their trees (`UnionDrafter`). `options` go to the drafter (not to a union: configure its
    members as drafter objects)."""
    from heads.base import input_device
    from heads.eagle import EagleDraft
    from heads.medusa import MedusaHeads
    from inference.drafters.eagle import EagleDrafter
    from inference.drafters.medusa import MedusaDrafter
    from inference.drafters.model import ModelDrafter
    from inference.drafters.ngram import NgramDrafter
    from inference.drafters.union import UnionDrafter

    if isinstance(heads_or_drafter, (list, tuple)):
        if options:
            raise ValueError(
                f"options {sorted(options)} are ambiguous for a union of drafters: pass drafter "
                "objects with their settings, e.g. [MedusaDrafter(heads, choices='cpu-8'), "
                "NgramDrafter(num_tokens=4)]"
            )
        return UnionDrafter([make_drafter(base, member) for member in heads_or_drafter])
    if isinstance(heads_or_drafter, UnionDrafter):  # built by the caller: its members as a list's
        for member in heads_or_drafter.drafters:
            make_drafter(base, member)
    # Heads of another base, given as they are or inside their drafter: say so now.
    inner = [getattr(heads_or_drafter, name, None) for name in ("heads", "draft")]
    device = input_device(base)
    for heads in (heads_or_drafter, *inner):  # MedusaDrafter.heads, EagleDrafter.draft
        if isinstance(heads, (MedusaHeads, EagleDraft)):
            heads.config.check_base(base.config)
            where = next(heads.parameters()).device
            if where != device:
                raise ValueError(
                    f"the heads are on {where}, the base takes its inputs on {device}: move "
                    f"them with heads.to('{device}') (load_heads(..., base=base) places them)"
                )
    model = getattr(heads_or_drafter, "model", heads_or_drafter)  # ModelDrafter.model
    if isinstance(model, PreTrainedModel) and input_device(model) != device:
        raise ValueError(  # its ids and the sampling generator live on the base's input device
            f"the draft model takes its inputs on {input_device(model)}, the base on {device}: "
            f"move it with draft.to('{device}') (or load it there)"
        )
    if isinstance(heads_or_drafter, ModelDrafter):
        check_padded_vocab(heads_or_drafter.vocab_size, base, "ModelDrafter(model, ..., ")
    if isinstance(heads_or_drafter, Drafter):
        if options:
            name = type(heads_or_drafter).__name__
            given = ", ".join(f"{k}={v!r}" for k, v in options.items())
            raise TypeError(
                f"options {sorted(options)} given with a drafter object ({name}): build the "
                f"drafter with them instead, {name}(..., {given})"
            )
        return heads_or_drafter
    if heads_or_drafter is None:
        return build(NgramDrafter, **options)
    if isinstance(heads_or_drafter, MedusaHeads):
        return build(MedusaDrafter, heads_or_drafter, **options)
    if isinstance(heads_or_drafter, EagleDraft):
        return build(EagleDrafter, heads_or_drafter, base, **options)
    if isinstance(heads_or_drafter, PreTrainedModel):
        options.setdefault("vocab_size", base.config.vocab_size)  # more rows: refused there
        check_padded_vocab(options["vocab_size"], base, "SpeculativeGenerator(base, model, ..., ")
        return build(ModelDrafter, heads_or_drafter, **options)
    if isinstance(heads_or_drafter, (str, os.PathLike)):
        raise TypeError(
            f"got the path {str(heads_or_drafter)!r}: load the heads first, "
            "heads = load_heads(path, base=base), and pass them"
        )
    if hasattr(heads_or_drafter, "apply_chat_template"):  # a (model, tokenizer) pair's second
        raise TypeError(
            "got a tokenizer where the heads or draft model go: load_base returns a (model, "
            "tokenizer) pair, pass the model alone, e.g. draft, _ = load_base(name)"
        )
    raise TypeError(
        f"expected MedusaHeads, EagleDraft, a draft model or a Drafter, got {type(heads_or_drafter).__name__}"
    )


def check_padded_vocab(vocab_size, base: PreTrainedModel, call: str) -> None:
    """A draft model's logits are padded to `vocab_size` columns (its rows checked against it):
    they must be the base's, whose probabilities the verifier sets beside them."""
    if vocab_size != base.config.vocab_size:
        raise ValueError(
            f"the draft model's logits would be padded to vocab_size={vocab_size} tokens, the "
            f"base has {base.config.vocab_size}: give {call}vocab_size={base.config.vocab_size}) "
            "or leave vocab_size out"
        )
