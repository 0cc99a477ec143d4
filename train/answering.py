"""How the base answers in self-distillation: the ids that end an answer, and the generation
backends (batched HF `generate` into a static KV cache, or vLLM), each a `Generate`: prompt
token ids in, one (answer ids, finished) per prompt out."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch
from transformers import StaticCache

from inference.base_checks import plain_generation, plain_generation_config
from train.config import Recipe
from train.data import turn_end_token_id
from train.distilled import DistillError

logger = logging.getLogger("distill")

# One answer per prompt row: (new token ids without the end-of-turn token, finished).
Generate = Callable[[list[list[int]]], list[tuple[list[int], bool]]]
# New tokens per generate call of the batched transformers backend on a CPU: rows whose answer
# ended leave the batch between calls (2 cores, one process: +7-10% tokens/s over one call per
# batch; chunks of 8 gained less). docs/distill.md has the figures.
CHUNK_TOKENS = 16


def eos_token_ids(tokenizer, generation_config, template: str | None = None) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS, the model's generation EOS ids and,
    given the chat template, the token it closes an assistant turn with (a base whose
    generation_config leaves that token out would otherwise answer the user's next turn too)."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(generation_config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list) else [extra])
    try:
        turn_end = turn_end_token_id(tokenizer, template) if template is not None else None
    except Exception as e:  # a probe: a template that wants a system turn, say, may refuse it
        logger.warning("the chat template's end-of-turn token was not found (%s)", e)
        turn_end = None
    if turn_end is not None and turn_end not in ids:
        logger.warning(
            "the chat template closes a turn with %r (id %d), which is not among the base's EOS "
            "ids %s: answers end there too (HF generate on this base would not stop there)",
            tokenizer.convert_ids_to_tokens(turn_end),
            turn_end,
            sorted(i for i in ids if i is not None),
        )
        ids.add(turn_end)
    return sorted(i for i in ids if i is not None)


def split_answer(new_tokens: list[int], eos_ids: list[int]) -> tuple[list[int], bool]:
    """Cut generated ids at the first end-of-turn id: (answer ids, whether one was produced)."""
    for i, token in enumerate(new_tokens):
        if token in eos_ids:
            return new_tokens[:i], True
    return new_tokens, False


CACHE_BUCKET = 256  # a compiled static-cache step is compiled again for each cache length


def static_cache_length(needed: int, compiled: bool) -> int:
    """The static cache's length for a batch that needs `needed` positions: rounded up to a
    multiple of CACHE_BUCKET where transformers compiles the step (a GPU), so that batches of
    other prompt lengths share a few compiled graphs (torch.compile stops compiling after 8
    shapes and runs the rest uncompiled)."""
    return -(-needed // CACHE_BUCKET) * CACHE_BUCKET if compiled else needed


def transformers_generator(
    model,
    tokenizer,
    recipe: Recipe,
    eos_ids: list[int],
    static_cache: bool = True,
    chunk_tokens: int = CHUNK_TOKENS,
) -> Generate:
    """Batched HF generate: left padding, KV cache, sampling when temperature > 0.

    With the static cache on a CPU, generation runs `chunk_tokens` new tokens at a time and the
    rows whose answer has ended leave the batch, and the cache, between chunks: otherwise every
    row runs until the batch's longest answer ends. `chunk_tokens=0` generates in one call, as
    does a GPU (where transformers compiles the static-cache step, and a batch that shrinks
    would recompile it). static_cache=False gives HF's default (dynamic) cache in one call, as
    plain `generate` uses."""
    data = recipe.data
    sample = data.temperature > 0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    device = next(model.parameters()).device
    # Explicit sampling values and no logits settings (repetition penalty, a minimum length,
    # ...), so that a checkpoint's generation_config.json cannot change the distribution the
    # heads are trained on: the base's own, which the verifier accepts from.
    sampling = dict(temperature=data.temperature, top_p=data.top_p, top_k=0) if sample else {}
    plain = plain_generation_config(model)
    settings = dict(
        do_sample=sample,
        **sampling,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        use_cache=True,
        cache_implementation=None,  # the cache is passed in
    )
    chunked = static_cache and chunk_tokens > 0 and device.type == "cpu"
    chunk = chunk_tokens if chunked else data.max_new_tokens
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)

    @torch.no_grad()
    def generate(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        B, T = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T), left padded
        attention_mask = torch.zeros((B, T), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, T - len(p) :] = torch.tensor(p)
            attention_mask[i, T - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # A growing cache re-copies itself every step: costly for a batch.
        length = static_cache_length(T + data.max_new_tokens, compiled=device.type != "cpu")
        cache = StaticCache(model.config, length) if static_cache else None
        rows = list(range(B))  # the prompt of each batch row
        answers: list[tuple[list[int], bool]] = [([], False)] * B
        produced = 0
        while rows:
            n = min(chunk, data.max_new_tokens - produced)
            with plain_generation(model, plain):
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    cache=cache,
                    max_new_tokens=n,
                    **settings,
                )  # (b, length + <= n): stops early when every row has ended
            new = out[:, input_ids.shape[1] :]
            produced += new.shape[1]
            ended = torch.isin(new, eos).any(dim=1) | (produced >= data.max_new_tokens)
            for i in ended.nonzero()[:, 0].tolist():
                answers[rows[i]] = split_answer(out[i, T:].tolist(), eos_ids)
            keep = (~ended).nonzero()[:, 0]  # (b',) rows still answering
            if cache is not None and 0 < keep.numel() < len(rows):
                cache.reorder_cache(keep)
            rows = [rows[i] for i in keep.tolist()]
            input_ids = out[keep]
            attention_mask = torch.cat([attention_mask, torch.ones_like(new)], dim=1)[keep]
        return answers

    return generate


def attention_heads(model_path: str) -> tuple[int, int] | None:
    """The base's query and key / value heads, from its config (None where it cannot be read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError):  # vLLM reads it its own way and says what fails
        return None
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    return heads, getattr(config, "num_key_value_heads", None) or heads


def tensor_parallel_size(gpus: int, head_counts: tuple[int, int] | None) -> int:
    """The most of `gpus` that vLLM can split a base of `head_counts` (query, key / value) over: a
    size that divides the query heads, and the key / value heads or is a multiple of them
    (Qwen2.5-7B's 28 and 4 on 8 GPUs: 4)."""
    most = max(gpus, 1)
    if not head_counts:
        return most
    query, kv = head_counts
    size = max(d for d in range(1, most + 1) if query % d == 0 and (kv % d == 0 or d % kv == 0))
    if size < most:
        logger.warning(
            "vLLM splits the base over %d of the %d GPUs: tensor parallelism must divide its %d "
            "attention heads (and its %d key / value heads, or be a multiple of them)",
            size,
            most,
            query,
            kv,
        )
    return size


def vllm_generator(
    model_path: str,
    recipe: Recipe,
    eos_ids: list[int],
    seed: int | None = None,
    head_counts: tuple[int, int] | None = None,
) -> Generate:
    """vLLM offline engine; tensor-parallel over the visible GPUs (run it as one process), or
    as many of them as the base's `head_counts` (`attention_heads`) allow; sampling seeded with `seed`
    (default: data.seed)."""
    from vllm import LLM, SamplingParams

    data = recipe.data
    dtype = "auto" if recipe.model.dtype == "auto" else recipe.model.dtype
    llm = LLM(
        model=model_path,
        dtype=dtype,
        seed=data.seed if seed is None else seed,
        max_model_len=data.max_length,
        tensor_parallel_size=tensor_parallel_size(torch.cuda.device_count(), head_counts),
    )
    params = SamplingParams(
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=-1,
        max_tokens=data.max_new_tokens,
        stop_token_ids=eos_ids,
    )

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [split_answer(list(o.outputs[0].token_ids), eos_ids) for o in outs]

    return generate


def use_vllm(recipe: Recipe) -> bool:
    backend = recipe.data.backend
    available = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
    if backend == "vllm" and not available:
        raise DistillError("data.backend=vllm but vLLM is not installed or no GPU is visible")
    return backend == "vllm" or (backend == "auto" and available)
