"""`generate`'s arguments, checked and normalised before any work: a clear error for each
value it cannot take, and HF's defaults where it has them."""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch


def check_generation_arguments(
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    acceptance: str,
    stop_strings: str | Sequence[str] | None,
    tokenizer,
    seed=None,
) -> tuple[int, list[str] | None]:
    """Raise for a value `generate` cannot take; return max_new_tokens as an int (numpy's and
    torch's integers too) and stop_strings as a list (one string, as HF takes it)."""
    if acceptance not in ("lossless", "typical"):
        raise ValueError("acceptance must be 'lossless' (exact) or 'typical' (Medusa's, lossy)")
    if isinstance(stop_strings, str):  # one string, as HF takes it
        stop_strings = [stop_strings]
    if stop_strings is not None:  # a list, tuple, set or other iterable of strings
        given = stop_strings
        iterable = isinstance(given, Iterable) and not isinstance(given, (bytes, Mapping))
        stop_strings = list(given) if iterable else []
        if not iterable or not all(isinstance(s, str) for s in stop_strings):
            raise TypeError(f"stop_strings must be a string or a list of them, got {given!r}")
    if stop_strings and not all(stop_strings):
        raise ValueError("stop_strings holds an empty string, which matches anywhere: leave it out")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer= to decode the generated text")
    if stop_strings and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(
            f"tokenizer={tokenizer!r} has no decode(): pass the base's tokenizer object (as "
            "load_base or AutoTokenizer.from_pretrained return it) to read stop_strings"
        )
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)  # numpy's and torch's integers too
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    reals = (temperature, top_p)
    if not all(isinstance(x, numbers.Real) for x in reals) or (
        not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool)
    ):
        raise TypeError(
            f"temperature and top_p must be numbers and top_k an int; got "
            f"temperature={temperature!r}, top_k={top_k!r}, top_p={top_p!r}"
        )
    if seed is not None and (not _is_index(seed) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int, or None for a fresh draw each call; got {seed!r}")
    if seed is not None and not -(2**63) <= operator.index(seed) < 2**64:  # torch.Generator's
        raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
    if not all(map(math.isfinite, reals)) or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"need temperature >= 0 (0: greedy), top_k >= 0 (0: off) and 0 < top_p <= 1 "
            f"(1: off); got temperature={temperature}, top_k={top_k}, top_p={top_p}"
        )
    if acceptance == "typical" and temperature > 0 and (top_k or top_p < 1):
        raise ValueError(
            "acceptance='typical' accepts from the temperature-scaled distribution, without "
            "top_k / top_p: leave them off (top_k=0, top_p=1), or use lossless acceptance"
        )
    return max_new_tokens, stop_strings


_NOT_APPLIED = (
    "not applied: the verifier keeps the base's own distribution (temperature, top_k and top_p "
    "only), so that the output is the base's, token for token"
)
_NO_RECORDS = (
    "the output is a GenerationOutput (sequences, accepted_lengths, tree_sizes, timings, "
    "finished); scores, logits and hidden states are not kept"
)
# HF `generate` arguments that the generator does not take, and what to do instead
HF_INSTEAD = {
    "do_sample": "sampling is temperature > 0 (with top_k, top_p); temperature=0.0, the "
    "default, is greedy",
    "num_beams": "the verifier decodes one sequence, greedy or sampled: no beam search",
    "num_return_sequences": "one sequence a call: call it again (with another seed to sample "
    "another)",
    "max_length": "give max_new_tokens (new tokens, the prompt not counted)",
    "pad_token_id": "one sequence needs no padding: leave it out",
    "generation_config": "give its settings as arguments (max_new_tokens, temperature, top_k, "
    "top_p, eos_token_id, stop_strings)",
    "stopping_criteria": "give eos_token_id or stop_strings (with tokenizer=)",
    "use_cache": "the generator always decodes with a cache",
    "assistant_model": "the drafter is the generator's: SpeculativeGenerator(base, draft_model)",
    "prompt_lookup_num_tokens": "the drafter is the generator's: SpeculativeGenerator(base, "
    "None) drafts by n-gram lookup",
    **dict.fromkeys(
        (
            "repetition_penalty",
            "no_repeat_ngram_size",
            "min_new_tokens",
            "min_length",
            "bad_words_ids",
            "suppress_tokens",
            "sequence_bias",
            "logits_processor",
            "typical_p",
            "min_p",
            "epsilon_cutoff",
            "eta_cutoff",
        ),
        _NOT_APPLIED,
    ),
    **dict.fromkeys(
        (
            "return_dict_in_generate",
            "output_scores",
            "output_logits",
            "output_attentions",
            "output_hidden_states",
        ),
        _NO_RECORDS,
    ),
}


def refuse_other_arguments(kwargs: Mapping, where: str) -> None:
    """Raise TypeError for keyword arguments `where` does not take, saying what to do instead
    of those HF `generate` takes."""
    if not kwargs:
        return
    name = next(iter(kwargs))
    if name in HF_INSTEAD:
        raise TypeError(f"{where}() takes no {name!r} (HF generate's): {HF_INSTEAD[name]}")
    raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


def _is_index(value) -> bool:
    """An integer as Python reads one: an int, a numpy integer, a one-element integer tensor."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def integral(t: torch.Tensor) -> bool:
    """Whether a tensor holds integers (token ids), not floats, complex numbers or bools."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def check_token_ids(ids: torch.Tensor, base) -> None:
    """A prompt's ids must index the base's embeddings (another model's tokenizer gives ids
    past them, which would fail deep in the forward as an IndexError)."""
    vocab = base.get_input_embeddings().num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"input_ids hold the token id {low if low < 0 else high}, outside the base's "
            f"{vocab} embeddings: tokenize with the base's own tokenizer"
        )


def eos_ids(base, eos_token_id) -> set[int]:
    """The EOS ids to stop at: `eos_token_id` as given (an int, a list or set of them, or a
    tensor / numpy value of either), else HF's default."""
    if eos_token_id is None:  # HF's: the generation config's, else the model config's
        gen_cfg = getattr(base, "generation_config", None)
        holder = gen_cfg if gen_cfg is not None else base.config
        eos_token_id = getattr(holder, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    # an int, a list or set of them, or a tensor / numpy value of either
    if isinstance(eos_token_id, (set, frozenset)):
        eos_token_id = sorted(eos_token_id)
    try:
        eos = torch.as_tensor(eos_token_id)
    except (TypeError, ValueError, RuntimeError):
        eos = None
    if eos is None or eos.numel() and not integral(eos):  # [] is no EOS at all
        raise TypeError(
            f"eos_token_id must be a token id (an int), a list of them or None, got {eos_token_id!r}"
        )
    return {int(t) for t in eos.reshape(-1).tolist()}


def warn_pad_in_prompt(base, ids: torch.Tensor, attention_mask, eos: set[int]) -> None:
    """HF `generate`, given no attention_mask, masks the pad token wherever the prompt holds it
    (unless it is an EOS token); the generator attends to every token it is given: say so."""
    gen_cfg = getattr(base, "generation_config", None)
    pad = getattr(gen_cfg if gen_cfg is not None else base.config, "pad_token_id", None)
    if attention_mask is not None or not isinstance(pad, int) or pad in eos:
        return
    where = (ids == pad).nonzero().flatten().tolist()
    if where:
        warnings.warn(
            f"the prompt holds the pad token ({pad}) at positions {where[:8]}: the generator "
            "reads them as tokens, where HF generate without an attention_mask would mask them; "
            "leave the padding out of the prompt",
            stacklevel=4,
        )
