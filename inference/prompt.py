"""The prompt as the decode loop takes it: one sequence of token ids, or a clear error.

`generate(**tokenizer(text, return_tensors="pt"))` works as with HF: the attention mask is taken
and must cover every token (one sequence, no padding).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from inference.arguments import integral


def prompt_tensor(input_ids) -> torch.Tensor:
    """The prompt's token ids as a tensor, or a clear error for text or a tokenizer's dict."""
    texts = isinstance(input_ids, (list, tuple)) and any(isinstance(t, str) for t in input_ids)
    if isinstance(input_ids, str) or texts:
        raise TypeError(
            "input_ids is text: tokenize it first, e.g. tokenizer.apply_chat_template(messages, "
            "add_generation_prompt=True, return_tensors='pt', return_dict=True)['input_ids']"
        )
    if isinstance(input_ids, Mapping):  # a tokenizer's BatchEncoding
        raise TypeError(
            "input_ids is a tokenizer's output dict: pass its ['input_ids'] (or unpack it: "
            "generate(**inputs))"
        )
    return torch.as_tensor(input_ids)


def prompt_ids(input_ids, attention_mask=None) -> torch.Tensor:
    """The one prompt of `input_ids` ((1, T) or (T,)) as a 1-D tensor.

    Refuses a batch of several, an empty prompt, and an attention mask that is not all ones
    (padding: speculative decoding here runs one sequence at a time, which needs none).
    """
    ids = prompt_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"batch size {ids.shape[0]}: speculative decoding here runs one sequence at a "
                "time; call generate per prompt (or use HF generate for batched decoding)"
            )
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be (1, T) or (T,), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if not integral(ids):
        raise TypeError(
            f"input_ids are {ids.dtype}: token ids are integers (torch.long), as the tokenizer "
            "gives them"
        )
    ids = ids.long()  # the embedding takes long or int ids only (not uint8, int16)
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        shape = tuple(mask.shape)
        if mask.dim() == 2 and shape[0] == 1:
            mask = mask[0]
        if mask.dim() != 1 or mask.numel() != ids.numel():
            raise ValueError(
                f"attention_mask has shape {shape} for {ids.numel()} prompt tokens: give the "
                "mask of this prompt, (1, T) or (T,), or none"
            )
        if not bool((mask == 1).all()):
            raise ValueError(
                "attention_mask masks some prompt tokens (padding): one sequence needs no "
                "padding; pass the prompt without its pad positions, e.g. "
                "input_ids[attention_mask.bool()]"
            )
    return ids
