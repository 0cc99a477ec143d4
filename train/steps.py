"""The optimizer steps of a run: which examples each takes on each process, the divisor of its
loss, how many there are, and the optimizer and learning-rate schedule that take them."""

from __future__ import annotations

import math
import random
import sys

import torch
from accelerate import Accelerator
from transformers import get_cosine_schedule_with_warmup

from train.checkpoint import check_finite
from train.config import Recipe


def epoch_batches(
    n_examples: int, recipe: Recipe, epoch: int, accelerator: Accelerator
) -> list[list[int]]:
    """This process's batches of example indices for `epoch`: a permutation seeded by
    (seed, epoch), split across processes, every process getting the same number of batches, a
    whole number of optimizer steps (so a checkpoint always falls on a step boundary)."""
    order = list(range(n_examples))
    random.Random(recipe.training.seed * 100003 + epoch).shuffle(order)
    mb, world = recipe.training.micro_batch_size, accelerator.num_processes
    per_step = mb * world * recipe.training.gradient_accumulation_steps
    usable = max(len(order) // per_step, 1) * per_step
    order = (order * math.ceil(usable / len(order)))[:usable]
    mine = order[accelerator.process_index :: world]
    return [mine[i : i + mb] for i in range(0, len(mine), mb)]


def step_norms(
    dataset, batches: list[list[int]], recipe: Recipe, accelerator: Accelerator
) -> list[float]:
    """Each micro-batch's loss divisor: the mean target-token count of the micro-batches of its
    optimizer step, over every process. A trainee divides its loss sum by it; accelerate's mean
    over the accumulated micro-batches and DDP's over processes then give the step's loss per
    target token, each token weighing the same (a mean per micro-batch weighs the tokens of a
    batch of short answers more, the more so the smaller the micro-batches)."""
    gas = recipe.training.gradient_accumulation_steps
    # A trainee's targets: the rows whose next token is one (a first token has no row before it)
    counts = [sum(sum(dataset.examples[i]["loss_mask"][1:]) for i in batch) for batch in batches]
    per_step = torch.tensor(counts, dtype=torch.long, device=accelerator.device)
    per_step = accelerator.reduce(per_step.view(-1, gas).sum(1), "sum").tolist()  # every process's
    return [max(n / (gas * accelerator.num_processes), 1.0) for n in per_step for _ in range(gas)]


def make_optimizer(recipe: Recipe, param_groups, steps_total: int):
    optimizer = torch.optim.AdamW(
        param_groups, lr=recipe.training.learning_rate, weight_decay=recipe.training.weight_decay
    )
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, recipe.training.warmup_steps, steps_total
    )
    return optimizer, scheduler


def count_steps(n_examples: int, recipe: Recipe, accelerator: Accelerator) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps)."""
    batches = len(epoch_batches(n_examples, recipe, 0, accelerator))
    per_epoch = batches // recipe.training.gradient_accumulation_steps
    total = per_epoch * recipe.training.epochs
    if recipe.training.max_steps is not None:  # as HF's Trainer: it overrides epochs
        total = recipe.training.max_steps
    if recipe.training.warmup_steps >= total:
        accelerator.print(
            f"warning: training.warmup_steps={recipe.training.warmup_steps} is not under the "
            f"run's {total} optimizer steps: the learning rate never leaves its warm-up (give "
            "more data or epochs, or fewer warm-up steps)",
            file=sys.stderr,
        )
    return per_epoch, total


def clip_gradients(
    accelerator: Accelerator, model: torch.nn.Module, recipe: Recipe, step: int
) -> None:
    """Clip the gradients to `training.max_grad_norm` before the update of optimizer step
    `step`, and stop as a NaN loss does where their norm is not finite: a finite loss's backward
    can still overflow, and the update would write NaN into the heads and their next checkpoint.
    Under fp16 the grad scaler skips such a step itself. DeepSpeed clips and steps in its engine,
    within `accelerator.backward`: its norm is of the update just made, and the run stops before
    a checkpoint holds it."""
    norm = accelerator.clip_grad_norm_(model.parameters(), recipe.training.max_grad_norm)
    if norm is not None and accelerator.mixed_precision != "fp16":
        check_finite(float(norm), step, recipe.output.dir, "the gradients' norm")
