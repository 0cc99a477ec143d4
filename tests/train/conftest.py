"""Fixtures of the recipe smoke tests: a tiny Llama that knows a synthetic task, and its data.

The task: every answer cycles through the letters "a b c d e f g h" from a different start, so
each answer token fixes all the following ones. The tiny random Llama (2 layers, H=64) gets the
embedded SmolLM2 tokenizer (V=49152) and an lm_head fitted to the task (row y = the centred mean
of the final hidden states that precede y), so the base predicts the next letter and its soft
labels carry the pattern the heads must learn. `medusa_run` and `eagle3_run` train the tiny
recipes on it once per session (test_recipes.py checks the runs, test_eval_heads.py scores them).
"""

from __future__ import annotations

import io
import json
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import train.eagle
import train.medusa
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
                    # Numbered: each record is its own prompt (the held-out split goes by prompt)
                    {
                        "from": "human",
                        "value": f"Recite the letters from '{LETTERS[i % 8]}' ({i}).",
                    },
                    {"from": "gpt", "value": letters_answer(i % len(LETTERS))},
                ],
                "finished": True,
                "source": "synthetic",
            }
            f.write(json.dumps(record) + "\n")
    return folder


def letter_prompt(tokenizer, letter: str) -> torch.Tensor:
    """(1, T) ids of a tiny-task question, as the answers were distilled."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Recite the letters from '{letter}'."},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


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


ROOT = Path(__file__).parents[2]
TINY_MEDUSA = ROOT / "recipes" / "tiny-medusa.yaml"
TINY_EAGLE = ROOT / "recipes" / "tiny-eagle.yaml"

# Medusa: 12 steps over two epochs (9 steps each): checkpoints at 2, 4, ..., 12 and a held-out
# evaluation after every step, so a resume can start mid-epoch and learning shows step by step.
MEDUSA_RUN = [
    "training.epochs=2",
    "training.max_steps=12",
    "training.learning_rate=0.02",
    "training.eval_every_steps=1",
]
# EAGLE-3 starts from a random lm_head and first learns the letters' marginal: 18 steps (two
# epochs) of a 2-step unroll at a steady rate to learn the pattern itself.
EAGLE3_RUN = [
    "heads.ttt_steps=2",
    "training.epochs=2",
    "training.max_steps=18",
    "training.learning_rate=0.01",
    "training.warmup_steps=0",
    "training.eval_every_steps=1",
]


@contextmanager
def watching(module):
    """Keep the base that `module`'s recipe loads (to check it afterwards)."""
    seen = {}
    real = module.load_frozen_base

    def load(recipe, accelerator, dtype=None):
        seen["base"], tokenizer = real(recipe, accelerator, dtype)
        return seen["base"], tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "load_frozen_base", load)
        yield seen


def run(module, recipe: Path, task, out: Path, *overrides: str):
    """Run a recipe in-process; returns the base it trained against."""
    with watching(module) as seen:
        module.main([str(recipe), *task.overrides(out), *overrides])
    return seen["base"]


def load_tiny_base(task):
    from heads import load_base

    return load_base(str(task.base_dir), device="cpu")[0]


def captured_run(name: str, module, recipe: Path, task, tmp_path_factory, overrides):
    """A recipe run in a fresh folder: (output dir, base it trained against, stdout)."""
    out = tmp_path_factory.mktemp(name) / "out"
    with redirect_stdout(io.StringIO()) as printed:
        base = run(module, recipe, task, out, *overrides)
    return out, base, printed.getvalue()


@pytest.fixture(scope="session")
def medusa_run(tiny_task, tmp_path_factory):
    """The uninterrupted Medusa run."""
    return captured_run(
        "medusa", train.medusa, TINY_MEDUSA, tiny_task, tmp_path_factory, MEDUSA_RUN
    )


@pytest.fixture(scope="session")
def eagle3_run(tiny_task, tmp_path_factory):
    """The EAGLE-3 run."""
    return captured_run("eagle3", train.eagle, TINY_EAGLE, tiny_task, tmp_path_factory, EAGLE3_RUN)


@pytest.fixture(scope="session")
def eagle1_run(tiny_task, tmp_path_factory):
    """An EAGLE-1 run as long as the EAGLE-3 one."""
    overrides = [*EAGLE3_RUN, "heads.version=1"]
    return captured_run("eagle1", train.eagle, TINY_EAGLE, tiny_task, tmp_path_factory, overrides)


@pytest.fixture(scope="session")
def medusa2_run(tiny_task, tmp_path_factory):
    """A Medusa-2 run (heads and a LoRA adapter on the base) as long as the Medusa one."""
    overrides = [*MEDUSA_RUN, "heads.lora_r=4", "training.learning_rate=0.005"]
    return captured_run(
        "medusa2", train.medusa, TINY_MEDUSA, tiny_task, tmp_path_factory, overrides
    )
