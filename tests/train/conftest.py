"""Fixtures of the recipe smoke tests: a tiny Llama that knows a synthetic task, and its data.

The task: every answer cycles through the letters "a b c d e f g h" from a different start, so
each answer token fixes all the following ones. The tiny random Llama (2 layers, H=64) gets the
embedded SmolLM2 tokenizer (V=49152) and an lm_head fitted to the task (row y = the centred mean
of the final hidden states that precede y), so the base predicts the next letter and its soft
labels carry the pattern the heads must learn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_llama
from train.data import build_examples, load_distilled, pad_batch

LETTERS = list("abcdefgh")
SYSTEM_PROMPT = "Be brief."  # shorter than SmolLM2's default system turn: shorter examples
N_RECORDS = 40


@dataclass(frozen=True)
class TinyTask:
    base_dir: Path  # save_pretrained folder: the tiny Llama and the SmolLM2 tokenizer
    data_dir: Path  # distilled ShareGPT shards (data.output_dir)

    def overrides(self, output_dir: Path) -> list[str]:
        """`key=value` overrides that point a tiny recipe at this task and `output_dir`."""
        return [
            f"model.name_or_path={self.base_dir}",
            f"data.output_dir={self.data_dir}",
            f"data.system_prompt={SYSTEM_PROMPT}",
            f"output.dir={output_dir}",
        ]


def letters_answer(start: int, n: int = 24) -> str:
    return " ".join(LETTERS[(start + j) % len(LETTERS)] for j in range(n))


def write_distilled(folder: Path) -> Path:
    """ShareGPT records as scripts/distill.py writes them (one shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "shard-r000-00000.jsonl", "w", encoding="utf-8") as f:
        for i in range(N_RECORDS):
            record = {
                "id": f"letters-{i:03d}",
                "conversations": [
                    {"from": "human", "value": f"Recite the letters from '{LETTERS[i % 8]}'."},
                    {"from": "gpt", "value": letters_answer(i % len(LETTERS))},
                ],
                "finished": True,
                "source": "synthetic",
            }
            f.write(json.dumps(record) + "\n")
    return folder


@torch.no_grad()
def fit_lm_head(base, examples: list[dict], pad_token_id: int, scale: float = 3.0) -> None:
    """Point the lm_head rows of the answer tokens at the hidden states that precede them."""
    batch = pad_batch(examples, pad_token_id)
    hidden = base.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state  # (B,T,H)
    target = batch["loss_mask"][:, 1:].bool()  # (B,T-1): the next token is an answer token
    h, y = hidden[:, :-1][target], batch["input_ids"][:, 1:][target]  # (n,H), (n,)
    centre = h.mean(0)
    for token in y.unique():
        direction = h[y == token].mean(0) - centre
        base.lm_head.weight[token] = scale * direction / direction.norm()


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory, smollm2_tokenizer) -> TinyTask:
    root = tmp_path_factory.mktemp("tiny-task")
    tokenizer = smollm2_tokenizer
    data_dir = write_distilled(root / "distilled")
    examples = build_examples(
        load_distilled(data_dir), tokenizer, system_prompt=SYSTEM_PROMPT, max_length=256
    )
    base = make_tiny_llama(
        0,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    fit_lm_head(base, examples, tokenizer.pad_token_id)
    base_dir = root / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    return TinyTask(base_dir=base_dir, data_dir=data_dir)
