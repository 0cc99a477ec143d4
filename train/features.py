"""Training data for the heads: token examples, held-out split, batches, and base features.

Examples come from the self-distilled conversations (`scripts/distill.py`, assistant-only loss
masks) and, optionally, a plain-text corpus (every token is a target; the base's own
distribution is the soft label, so no generation is needed). The base's features are computed
inside the step ("online") or once before training and kept ("offline"): on a CPU the base
forward is most of a step, so offline mode makes every epoch after the first far cheaper.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import PartialState
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from heads.base import logits_scaling, output_logits
from train.corpus import as_conversation, corpus_chunks
from train.data import build_examples, conversation_examples, pad_batch, read_distilled
from train.distilled import distilled_otherwise, selected_otherwise

Example = dict[str, list[int]]


def load_examples(recipe, tokenizer) -> tuple[list[Example], list[Example]]:
    """Tokenised examples of a recipe: (distilled conversations, text corpus)."""
    # Answers cut at max_new_tokens are kept: their tokens are still the base's own (but not
    # the end-of-turn marker the template adds after them).
    records = read_distilled(recipe.data.output_dir)
    if not records:
        raise ValueError(
            f"{recipe.data.output_dir}: its .jsonl shards hold no answers; run scripts/distill.py "
            "with this recipe (it resumes a killed run) or point data.output_dir at its answers"
        )
    said = PartialState().is_main_process  # notes once, not once per process
    if said and (notes := distilled_otherwise(recipe.data.output_dir, recipe, tokenizer)):
        # Heads learn to draft what the base wrote under that template: allowed (data from
        # elsewhere is a choice), but said, since it is mostly a recipe mix-up.
        warnings.warn(
            f"{recipe.data.output_dir} was distilled with {'; '.join(notes)}. The heads will "
            "draft best for the answers as distilled: set the recipe's model, data.chat_template "
            "and data.system_prompt as distill had them, unless this is meant.",
            stacklevel=2,
        )
    if said and (keys := selected_otherwise(recipe.data.output_dir, recipe)):
        print(
            f"note: training reads all {len(records)} conversations in {recipe.data.output_dir}; "
            f"{', '.join(keys)} choose what scripts/distill.py answers, not what training reads "
            "(train on fewer with training.max_steps, or distill into another data.output_dir)",
            file=sys.stderr,
        )
    # Per conversation: one may give an example per answer (`conversation_examples`), so the
    # examples' count says nothing of the conversations left out.
    per_record = [tokenize_answers([record], tokenizer, recipe) for record in records]
    distilled = [example for examples in per_record for example in examples]
    if cut := sum(not examples for examples in per_record):
        message = (
            f"{cut} of the {len(records)} conversations in {recipe.data.output_dir} have no "
            f"answer token within training.max_length={recipe.training.max_length}"
        )
        if not distilled:
            raise ValueError(f"{message}: no training examples; raise training.max_length")
        if said:
            print(f"note: {message}: left out", file=sys.stderr)
    return distilled, corpus_examples(recipe, tokenizer)


def tokenize_answers(records, tokenizer, recipe) -> list[Example]:
    """Distilled (conversation, finished) records (`read_distilled`) as the recipe tokenises them
    (its chat template, system prompt and training.max_length; a cut answer's end-of-turn marker
    is no target); a conversation with no answer token within max_length is dropped."""
    return build_examples(
        [messages for messages, _ in records],
        tokenizer,
        chat_template=recipe.data.chat_template,
        system_prompt=recipe.data.system_prompt,
        max_length=recipe.training.max_length,
        finished=[finished for _, finished in records],
    )


def corpus_examples(recipe, tokenizer) -> list[Example]:
    """`training.text_corpus` chunks as assistant turns (plain text without a chat template),
    tokenised in their shuffled order until `training.text_max_tokens` targets are taken."""
    data, training = recipe.data, recipe.training
    templated = bool(data.chat_template or tokenizer.chat_template)
    examples: list[Example] = []
    total = 0
    for chunk in corpus_chunks(training.text_corpus, training.seed):
        if training.text_max_tokens and total >= training.text_max_tokens:
            break
        if templated:
            [example] = conversation_examples(
                as_conversation(chunk),
                tokenizer,
                chat_template=data.chat_template,
                system_prompt=data.system_prompt,
                max_length=training.max_length,
            )
        else:  # every token is a target
            ids = tokenizer(chunk[1], add_special_tokens=False)["input_ids"][: training.max_length]
            example = {"input_ids": ids, "loss_mask": [1] * len(ids), "labels": ids}
        if any(example["loss_mask"]):
            examples.append(example)
            total += sum(example["loss_mask"])
    return examples


def split_held_out(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, held out): whole prompts in the order of a seeded hash of their tokens, those that
    fit in `fraction` of the examples (a prompt with more answers than that is passed over; at
    least one prompt when fraction > 0 and there are two), so that

    - the answers to one prompt (`data.num_samples` > 1, or a prompt asked twice) fall on the
      same side: no held-out prompt was trained on;
    - when the data grows (distill extended with more sources) an example keeps its side, but
      for the few whose hash lies near the cut: heads trained before and after are measured on
      nearly the same held-out answers, not on what one of them trained on (a shuffle of the
      new count would move most of them).
    """
    if fraction <= 0 or len(examples) < 2:
        return list(examples), []
    n_eval = min(max(1, int(len(examples) * fraction)), len(examples) - 1)
    groups: dict[bytes, list[int]] = {}
    for i, example in enumerate(examples):
        groups.setdefault(_prompt_key(example, seed), []).append(i)
    held: set[int] = set()
    order = sorted(groups)  # the seeded hash order
    for key in order:
        if len(held) + len(groups[key]) <= n_eval:
            held.update(groups[key])
    if not held and len(groups) > 1:  # every prompt has more answers than n_eval: the smallest
        held.update(groups[min(order, key=lambda k: len(groups[k]))])
    return (
        [e for i, e in enumerate(examples) if i not in held],
        [e for i, e in enumerate(examples) if i in held],
    )


def _prompt_key(example: Example, seed: int) -> bytes:
    """A seeded hash of an example's prompt tokens (`prompt_ids`; else, for examples made
    without them, its tokens before the first target)."""
    prompt = example.get("prompt_ids")
    if prompt is None:
        mask = example["loss_mask"]
        prompt = example["input_ids"][: mask.index(1) if 1 in mask else len(mask)]
    data = f"{seed}:" + ",".join(map(str, prompt))
    return hashlib.blake2b(data.encode(), digest_size=16).digest()


class ExampleDataset(Dataset):
    """Examples, each optionally with precomputed base features (offline mode)."""

    def __init__(
        self, examples: Sequence[Example], features: list[dict[str, torch.Tensor]] | None = None
    ):
        self.examples, self.features = list(examples), features

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        return i


def collate(
    dataset: ExampleDataset, indices: list[int], pad_token_id: int, device
) -> dict[str, torch.Tensor]:
    """A right-padded batch (B,T) of examples, with their cached features padded alike."""
    batch = pad_batch([dataset.examples[i] for i in indices], pad_token_id)
    if dataset.features is not None:
        T = batch["input_ids"].shape[1]
        feats = [dataset.features[i] for i in indices]  # read once each (a cache reads disk)
        # Only what every example has: a cache filled before "top" existed and extended since
        for key in [k for k in feats[0] if all(k in f for f in feats[1:])]:
            rows = [f[key] for f in feats]  # (T_i, D) each, or (T_i,) for "top"
            padded = rows[0].new_zeros((len(rows), T, *rows[0].shape[1:]))
            for b, r in enumerate(rows):
                padded[b, : r.shape[0]] = r
            batch[key] = padded
    return {k: v.to(device) for k, v in batch.items()}


VOCAB_FILE = "draft_vocab.safetensors"


def draft_vocabulary(
    examples: Sequence[Example], size: int, vocab_size: int, kept: str | Path | None = None
) -> torch.Tensor:
    """The reduced draft vocabulary of a run: built from the training targets, and kept in
    OUTPUT/draft_vocab.safetensors (`save_draft_vocabulary`, once the run begins). A resumed run
    reads it from `kept`, the folder of the run that wrote its checkpoint, rather than rebuild
    it (rebuilt where that folder has none: the same data builds the same). A fresh run never
    reads an earlier run's."""
    from safetensors.torch import load_file

    path = Path(kept) / VOCAB_FILE if kept is not None else None
    if path is not None and path.is_file():
        try:
            ids = load_file(path)["token_ids"]
        except Exception as e:  # safetensors' own error type for a damaged file
            raise ValueError(
                f"{path} cannot be read ({e}): delete it and rerun (the same data rebuilds it)"
            ) from e
        if ids.numel() != size:
            raise ValueError(
                f"{path} holds {ids.numel()} tokens but the recipe asks for {size}; use a new output.dir"
            )
        return ids
    return frequent_tokens(examples, size, vocab_size)


def save_draft_vocabulary(output_dir: str | Path, ids: torch.Tensor) -> None:
    """Write a run's draft vocabulary where a resumed run reads it (a kill mid-write leaves no
    half file behind)."""
    from heads.checkpoint import write_safetensors

    path = Path(output_dir) / VOCAB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write_safetensors({"token_ids": ids.contiguous()}, tmp)
    tmp.replace(path)


def frequent_tokens(examples: Sequence[Example], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target tokens (ties by id), sorted: a reduced draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        ids = torch.tensor(e["input_ids"])[torch.tensor(e["loss_mask"], dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)
    # A tiny tie-break toward low ids keeps the choice deterministic.
    keep = torch.sort(counts.double() - torch.arange(vocab_size) * 1e-9, descending=True).indices[
        :size
    ]
    return torch.sort(keep).values


@torch.no_grad()
def base_features(
    base,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    aux_layer_ids: Sequence[int] = (),
    greedy: bool = False,
) -> dict[str, torch.Tensor]:
    """One forward of the frozen base: {"hidden": last hidden (B,T,H), "aux": (B,T,3H),
    "top": (B,T)}.

    "hidden" is the final-norm output the lm_head reads (EAGLE's feature); "aux" concatenates the
    hidden states entering `aux_layer_ids` (EAGLE-3), present only when asked for; "top", with
    `greedy`, is the base's greedy next token at each position (`greedy_tokens`).
    """
    inner = base.get_base_model().model if hasattr(base, "get_base_model") else base.model
    out = inner(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(aux_layer_ids)
    )
    feats = {"hidden": out.last_hidden_state}
    if aux_layer_ids:
        feats["aux"] = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
    if greedy:
        feats["top"] = greedy_tokens(base, out.last_hidden_state)
    return feats


@torch.no_grad()
def greedy_tokens(base, hidden: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """The base's greedy token (argmax of its full lm_head) for hidden states (..., H).

    Offline training computes it once with the features: a step then needs the base's logits on
    the draft vocabulary only, not the full lm_head, which on a CPU cost more than the heads'
    whole forward (SmolLM2: 49k rows against the heads' 8k)."""
    lm_head = base.get_output_embeddings()
    flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head.weight.dtype)
    top = [lm_head(flat[i : i + rows]).argmax(-1) for i in range(0, flat.shape[0], rows)]
    return (
        torch.cat(top).view(hidden.shape[:-1])
        if top
        else flat.new_zeros(hidden.shape[:-1], dtype=torch.long)
    )


@torch.no_grad()
def base_targets(
    base,
    hidden: torch.Tensor,
    draft_ids: torch.Tensor | None,
    top: torch.Tensor | None = None,
    *,
    logits: bool = True,
    full: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """For hidden rows (n, H): the base's logits on the draft vocabulary (n, V_draft) (None
    without `logits`), its greedy tokens (n,), and its logits on the whole vocabulary with `full`
    (else None); logits in the lm_head's dtype.

    `draft_ids` are the base ids of a reduced draft vocabulary (None: the whole vocabulary). When
    the greedy tokens are given (`top`, from the features) and `full` is not asked, only the
    draft vocabulary's rows of the lm_head are computed, or none without `logits`. That slices
    the lm_head's weight directly: fine because "top" exists only in offline mode, which
    prepare_data refuses under DeepSpeed ZeRO-3 (a partitioned weight would need gathering).
    """
    lm_head, scaling = base.get_output_embeddings(), logits_scaling(base) or (lambda x: x)
    h = hidden.to(lm_head.weight.dtype)
    if top is not None and not full and not logits:
        return None, top, None
    if top is not None and draft_ids is not None and not full:
        bias = None if lm_head.bias is None else lm_head.bias[draft_ids]
        return scaling(F.linear(h, lm_head.weight[draft_ids], bias)), top, None
    whole = output_logits(base, h)  # (n, V), as the base's forward returns them
    top = whole.argmax(-1) if top is None else top
    kept = None if not logits else whole if draft_ids is None else whole[:, draft_ids]
    return kept, top, whole if full else None


@torch.no_grad()
def feature_batches(
    base,
    examples: Sequence[Example],
    aux_layer_ids: Sequence[int],
    batch_size: int,
    pad_token_id: int,
    desc: str = "base features",
    disable_progress: bool = False,
):
    """Yield (example indices, their features {"hidden": (B,T,H), "aux": (B,T,3H), "top": (B,T)})
    for every example, shortest first (little padding), with a progress bar in tokens."""
    device = next(base.parameters()).device
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    tokens = sum(len(e["input_ids"]) for e in examples)
    with tqdm(total=tokens, unit="tok", desc=desc, disable=disable_progress or not examples) as bar:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = pad_batch([examples[i] for i in idx], pad_token_id)
            yield (
                idx,
                base_features(
                    base,
                    batch["input_ids"].to(device),
                    batch["attention_mask"].to(device),
                    aux_layer_ids,
                    greedy=True,
                ),
            )
            bar.update(sum(len(examples[i]["input_ids"]) for i in idx))


def precompute_features(
    base,
    examples: Sequence[Example],
    aux_layer_ids: Sequence[int],
    batch_size: int,
    pad_token_id: int,
    disable_progress: bool = False,
):
    """Offline mode: the base's features for every example, computed once (kept on the CPU in
    the base's dtype; ~2.3 KB per token for H=576 in fp32, x4 with EAGLE-3's aux layers; and
    the base's greedy token at each position)."""
    features: list[dict[str, torch.Tensor] | None] = [None] * len(examples)
    batches = feature_batches(
        base,
        examples,
        aux_layer_ids,
        batch_size,
        pad_token_id,
        disable_progress=disable_progress,
    )
    for idx, feats in batches:
        for b, i in enumerate(idx):
            n = len(examples[i]["input_ids"])
            features[i] = {k: v[b, :n].to("cpu") for k, v in feats.items()}  # (T_i, D)
    return features
