"""What both recipes do around their loop: command line, accelerator, base, data and held-out
evaluation (the steps and optimizer: train/steps.py; checkpoints and resume: train/checkpoint.py;
metrics.jsonl, the final save and push: train/outputs.py). The loop itself stays in
train/medusa.py and train/eagle.py."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    InitProcessGroupKwargs,
    gather_object,
    parse_flag_from_env,
    set_seed,
)
from transformers.integrations import is_deepspeed_zero3_enabled

from heads import load_base
from heads.checkpoint import resolve_folder
from heads.export import missing_folders
from heads.hub import push_refused
from inference.base_checks import base_logits, not_full_attention, windowed_cache_layers
from train.checkpoint import (
    TrainingDiverged,
    built_on_dtype,
    check_branch,
    check_same_examples,
    check_same_run,
    data_fingerprint,
    examples_fingerprint,
    resolve_resume,
)
from train.config import Recipe, check_writable, load_recipe, refuse_other_run
from train.feature_cache import FeatureCache, FeatureCacheError, fill_cache
from train.features import (
    ExampleDataset,
    collate,
    load_examples,
    precompute_features,
    split_held_out,
)
from train.lock import lock_output, release_output_locks, remove_unused
from train.losses import ratio_means
from train.precision import resolve_mixed_precision, training_base_dtype
from train.zero import fill_deepspeed_config


@contextmanager
def stop_on_bad_input(errors: tuple[type[Exception], ...] = (FileNotFoundError, ValueError)):
    """Recipe, file, model and heads errors end the run with their message (exit 2), no
    traceback (RecipeError is a ValueError)."""
    try:
        yield
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run_training(training_function, argv: list[str] | None, kind: str) -> None:
    """A training script's command line: a diverged loss ends with its message (exit 1); a run
    refused for bad input (exit 2) leaves no output folder it made behind."""
    recipe = parse_args(argv, kind)
    if int(os.environ.get("RANK", "0")) > 0:  # every process checks alike: the first one says
        warnings.filterwarnings("ignore", category=UserWarning)
        transformers.utils.logging.disable_progress_bar()
    made = missing_folders(recipe.output.dir)  # what a refusal leaves removed
    try:
        training_function(recipe)
    except SystemExit as e:
        if e.code == 2 and int(os.environ.get("RANK", "0")) == 0:  # refused for bad input
            release_output_locks()
            remove_unused(made)
        raise
    except TrainingDiverged as e:  # raised on every process (the loss is reduced first)
        if PartialState().is_main_process:
            print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: what is saved stays (checkpoints are written whole)
        if PartialState().is_main_process:
            print(
                f"\ninterrupted: the checkpoints in {recipe.output.dir} are kept; the same "
                "command resumes from the last one",
                file=sys.stderr,
            )
        raise SystemExit(130) from None
    finally:
        release_output_locks()


def usage(kind: str) -> str:
    """The training scripts' help: the command, what it does, and every recipe key."""
    import dataclasses
    import textwrap

    what = {"medusa": "Medusa heads", "eagle": "an EAGLE draft layer"}[kind]
    about = textwrap.fill(
        f"Train {what} for a base (frozen, but for Medusa-2's heads.lora_r > 0) on "
        "self-distilled answers (scripts/distill.py), as the "
        "recipe (recipes/*.yaml) says; each key=value overrides one of its settings, e.g. "
        "training.max_steps=100 data.limit=64. Rerunning the same command resumes from the "
        "last checkpoint (training.resume=auto; never: afresh; a checkpoint folder: from "
        "there). Plain `python` runs one process; accelerate launch runs several.",
        width=90,
    )
    default = Recipe()
    sections = "\n".join(
        textwrap.fill(
            f"{f.name}: " + ", ".join(g.name for g in dataclasses.fields(getattr(default, f.name))),
            width=90,
            initial_indent="  ",
            subsequent_indent="    ",
        )
        for f in dataclasses.fields(default)
    )
    return (
        f"usage: accelerate launch train/{kind}.py RECIPE.yaml [section.key=value ...]\n\n"
        f"{about}\n\nRecipe sections and their keys (defaults and meanings: train/config.py):"
        f"\n{sections}"
    )


def parse_args(argv: list[str] | None, default_type: str) -> Recipe:
    """`RECIPE.yaml [key=value ...]` -> a validated recipe (errors exit with the message)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(default_type), file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    with stop_on_bad_input():
        recipe = load_recipe(argv[0], argv[1:])
        if recipe.heads.type != default_type:
            kind = recipe.heads.type
            raise ValueError(f"heads.type={kind!r}: run train/{kind}.py for this recipe")
        if recipe.heads.lora_r > 0 and recipe.training.mode == "offline":  # Medusa-2
            raise ValueError("heads.lora_r > 0 adapts the base, so it needs training.mode=online")
        if recipe.training.init_heads:  # a missing folder or an offline Hub id: before the base
            resolve_folder(recipe.training.init_heads)
        if recipe.hub.repo_id and (why := push_refused()):  # not after the whole run
            raise ValueError(
                f"hub.repo_id={recipe.hub.repo_id}: {why}; or leave hub.repo_id out and push "
                "OUTPUT/heads later with heads.hub.push_folder"
            )
    return recipe


def find_resume(recipe: Recipe, accelerator: Accelerator) -> Path | None:
    """The checkpoint this run continues (`training.resume`), checked against the recipe before
    any work: another base, heads, data or batch order exits with the difference. An earlier
    run's files are removed only in `begin_run`, once every input has loaded."""
    with stop_on_bad_input():
        check_writable("output.dir", recipe.output.dir)
        refuse_other_run("output.dir", recipe.output.dir, "training")
        if accelerator.is_main_process:  # its workers write beside it
            Path(recipe.output.dir).mkdir(parents=True, exist_ok=True)  # locked from the start
            lock_output("output.dir", recipe.output.dir)
        ckpt = resolve_resume(recipe.training.resume, recipe.output.dir)
        if ckpt is not None:
            check_branch(ckpt, recipe.output.dir)
            changed = check_same_run(ckpt, recipe, accelerator.num_processes)
            if changed:
                accelerator.print(
                    f"resuming {ckpt} with settings changed since: {'; '.join(changed)}"
                )
    return ckpt


def one_process_note(processes: int) -> str:
    """Said after "on 1 process" where `accelerate launch --num_processes N` started one (as it
    does on a machine without a GPU unless told --multi_gpu); empty otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = os.environ.get("MASTER_ADDR") and "ACCELERATE_USE_CPU" in os.environ
    if processes == 1 and world == 1 and launched:
        return (
            ": if accelerate launch was asked for several, it started one; several on a machine "
            "without a GPU need --multi_gpu --num_processes N (--cpu starts one)"
        )
    return ""


def make_accelerator(recipe: Recipe) -> Accelerator:
    log_with = None if recipe.logging.report_to == "none" else recipe.logging.report_to
    packages = {"wandb": ("wandb",), "tensorboard": ("tensorboard", "tensorboardX")}
    if log_with is not None and not any(importlib.util.find_spec(p) for p in packages[log_with]):
        # accelerate would only warn and log nothing, found out after the run.
        extra = "'headstart[wandb]'" if log_with == "wandb" else "tensorboard"
        print(
            f"error: logging.report_to={log_with} needs the {log_with} package: "
            f"pip install {extra}, or logging.report_to=none (metrics.jsonl is written either way)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if log_with == "wandb":
        os.environ.setdefault(
            "WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        # Untested here, and on CPUs accelerate would fall back to plain DDP without a word.
        raise SystemExit(
            "error: the recipes do not run under FSDP; shard a large base with DeepSpeed ZeRO-3 "
            "instead (accelerate launch --config_file recipes/accelerate/zero3-8gpu.yaml ...)"
        )
    # Several processes (torchrun, `accelerate launch --multi_gpu`) on a machine without a GPU:
    # accelerate joins them with gloo only when told cpu=True; otherwise each trains alone.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu_only = world > 1 and not torch.cuda.is_available()
    # DeepSpeed on CPUs (its CPU accelerator talks gloo): cpu=True would silently drop DeepSpeed
    # for plain DDP, and without a backend accelerate would join a single process.
    deepspeed_on_cpu = cpu_only and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    on_gpu = torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")
    precision, why = resolve_mixed_precision(recipe.training.mixed_precision, on_gpu)
    accelerator = Accelerator(
        gradient_accumulation_steps=recipe.training.gradient_accumulation_steps,
        mixed_precision=precision,
        log_with=log_with,
        project_dir=recipe.output.dir,
        cpu=cpu_only and not deepspeed_on_cpu,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else None,
        # epoch_batches already gives each process its own batches and count_steps counts
        # optimizer steps: the prepared scheduler must step once per step, not once per process.
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    if world > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"{world} processes were launched but accelerate joined {accelerator.num_processes}: "
            "each would train alone and overwrite the others' files"
        )
    processes = accelerator.num_processes
    joined = f"training on {processes} process{'es' if processes > 1 else ''}"
    accelerator.print(joined + one_process_note(processes))
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None:
        for note in fill_deepspeed_config(deepspeed.deepspeed_config, recipe):
            accelerator.print(note)
    if recipe.training.mixed_precision == "auto":
        accelerator.print(f"mixed precision: {precision} ({why})")
    if log_with:
        accelerator.init_trackers(recipe.logging.project, config=_flat(recipe))
    set_seed(recipe.training.seed)
    return accelerator


def _flat(recipe: Recipe) -> dict:
    from train.config import dotted_items, recipe_to_dict

    return {
        k: v
        for k, v in dotted_items(recipe_to_dict(recipe))
        if isinstance(v, int | float | str | bool)
    }


def base_dtype_for_training(
    recipe: Recipe, accelerator: Accelerator, ckpt: Path | None
) -> str | None:
    """The trainers' base dtype (`training_base_dtype`) for the recipe and what this run builds
    on, the checkpoint `ckpt` it resumes or an existing feature cache; says why under "auto"."""
    with stop_on_bad_input((FeatureCacheError,)):  # a damaged features.json
        earlier = built_on_dtype(ckpt, recipe.training.feature_cache, accelerator.device)
    name, why = training_base_dtype(
        recipe.model.dtype,
        accelerator.mixed_precision,
        recipe.training.mode,
        accelerator.device,
        earlier,
    )
    if name and recipe.model.dtype == "auto":
        accelerator.print(f"base dtype: {name} ({why})")
    return name


def load_frozen_base(recipe: Recipe, accelerator: Accelerator, dtype: str | None = None):
    """(base, tokenizer), frozen, in `dtype` (a torch dtype's name), else the recipe's
    `model.dtype` as load_base takes it ("auto": fp32 on a CPU, bf16 on a GPU, as decoding
    runs). The trainers pass `base_dtype_for_training`'s."""
    dtype = dtype or recipe.model.dtype
    # ZeRO-3 partitions the weights inside from_pretrained (zero.Init, a collective): every
    # process must load at once, and the partitioned weights cannot be prepacked for the CPU.
    zero3 = is_deepspeed_zero3_enabled()
    # Otherwise the first process converts / downloads once, then the others read its files.
    with (
        nullcontext() if zero3 else accelerator.main_process_first(),
        stop_on_bad_input((FileNotFoundError,)),  # no such folder or Hub id
    ):
        base, tokenizer = load_base(
            recipe.model.name_or_path,
            dtype=dtype,
            device=accelerator.device,
            attn_implementation=recipe.model.attn_implementation,
            prepack=False if zero3 else None,
        )
    size, vocab = recipe.heads.draft_vocab_size, base.config.vocab_size
    if size is not None and size > vocab:  # before any data or feature work
        print(
            f"error: heads.draft_vocab_size={size} is more than the base's vocabulary ({vocab} "
            f"tokens): give at most {vocab}, or null for the default",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if not zero3:  # the heads learn the base's own logits: a transform after the lm_head must
        with stop_on_bad_input((ValueError,)):  # be known (partitioned, it cannot be called alone)
            base_logits(base)
    windowed = windowed_cache_layers(base.config)
    if windowed:  # said before hours of training, not first when decoding is refused
        accelerator.print(
            f"note: {not_full_attention(windowed)}: headstart's generator cannot decode it "
            "(tree verification needs full attention in every layer); the heads train and "
            "export (scripts/export.py) for an engine that serves this base"
        )
    return base, tokenizer


def gather_for_reading(*params: torch.nn.Parameter):
    """Whole parameters to read under ZeRO-3 (where each process holds a shard); else a no-op."""
    if not is_deepspeed_zero3_enabled():
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def prepare_data(
    recipe: Recipe,
    base,
    tokenizer,
    accelerator: Accelerator,
    aux_layer_ids=(),
    ckpt: Path | None = None,
):
    """(train dataset, held-out dataset, what each checkpoint records of them); offline mode
    attaches the base's features. A run resuming `ckpt` on other examples exits first."""
    folder = data_fingerprint(recipe.data.output_dir)  # as loaded, not as it is at a later save
    with stop_on_bad_input():  # no distilled answers yet, a malformed shard, no chat template
        distilled, text = load_examples(recipe, tokenizer)
    # Held out from the distilled answers only: acceptance is measured on what the base writes.
    train, held_out = split_held_out(distilled, recipe.training.eval_fraction, recipe.training.seed)
    train += text
    identity = {"data": folder, "examples": examples_fingerprint(train, held_out)}
    if accelerator.num_processes > 1 and len(set(gather_object([identity["examples"]]))) > 1:
        # every process stops here together, where one stopping alone would hang the others
        print(
            f"error: the processes loaded different examples from {recipe.data.output_dir} "
            "(was distill still writing there?): rerun once the data is complete",
            file=sys.stderr,
        )
        raise SystemExit(2)
    with stop_on_bad_input():
        check_same_examples(ckpt, identity["examples"])
    accelerator.print(
        f"examples: {len(train)} train ({len(text)} from the text corpus), {len(held_out)} held "
        f"out; {sum(sum(e['loss_mask']) for e in train)} train target tokens"
    )
    train_ds, eval_ds = ExampleDataset(train), ExampleDataset(held_out)
    if recipe.training.mode == "offline" and is_deepspeed_zero3_enabled():
        print(
            "error: training.mode=offline runs the base before DeepSpeed has gathered its "
            "ZeRO-3 partitions; use training.mode=online under ZeRO-3",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if recipe.training.feature_cache:  # on disk, bf16, shared by runs on the same data
        cache = recipe.training.feature_cache
        try:
            fill_cache(
                base,
                train + held_out,
                aux_layer_ids,
                cache,
                base_name=recipe.model.name_or_path,
                batch_size=recipe.training.micro_batch_size,
                pad_token_id=tokenizer.pad_token_id,
                accelerator=accelerator,
            )
        except FeatureCacheError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        names = ("hidden", "aux", "top") if aux_layer_ids else ("hidden", "top")
        for ds in (train_ds, eval_ds):
            ds.features = FeatureCache(cache, ds.examples, base.dtype, names)
        old = train_ds.features.lacks_greedy_tokens()
        if old:
            accelerator.print(
                f"note: {old} examples in {cache} were cached without the base's greedy tokens "
                "(an older cache): each step computes the base's whole lm_head for them; delete "
                "the folder to cache them again, with the tokens"
            )
    elif recipe.training.mode == "offline":
        if accelerator.num_processes > 1:
            accelerator.print(
                f"note: each of the {accelerator.num_processes} processes computes the base's "
                "features for every example; training.feature_cache=DIR computes them once, "
                "in shares"
            )
        for ds in (train_ds, eval_ds):
            ds.features = precompute_features(
                base,
                ds.examples,
                aux_layer_ids,
                recipe.training.micro_batch_size,
                tokenizer.pad_token_id,
                disable_progress=not accelerator.is_main_process,
            )
    return train_ds, eval_ds, identity


class Trainee(torch.nn.Module):
    """The module a recipe trains: the base and its heads. Checkpoints hold only what trains
    (heads, LoRA adapters) and the heads' buffers, never the frozen base. Its forward returns
    (loss, metrics), each metric a (sum, number) pair (`train.losses.count`)."""

    def train(self, mode: bool = True):
        """`mode` for the heads; a frozen base stays in eval mode (no dropout in its features),
        while Medusa-2's LoRA-adapted base follows `mode`."""
        super().train(mode)
        if not any(p.requires_grad for p in self.base.parameters()):
            self.base.eval()
        return self

    def _kept(self) -> set[str]:
        keep = {n for n, p in self.named_parameters() if p.requires_grad}
        return keep | {f"heads.{n}" for n, _ in self.heads.named_buffers()}

    def state_dict(self, *args, **kwargs):
        full = super().state_dict(*args, **kwargs)
        keep = self._kept()
        for name in [n for n in full if n not in keep]:
            del full[name]
        return full

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        kept = self._kept()
        missing = [k for k in result.missing_keys if k in kept]  # the frozen base is not saved
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"checkpoint does not match the heads: missing {missing}, unexpected {result.unexpected_keys}"
            )
        return type(result)(missing, result.unexpected_keys)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, dataset, recipe: Recipe, pad_id: int, device
) -> dict[str, float]:
    """Held-out loss and metrics over the whole split, as training weighs the loss: each of the
    trainee's (sum, number) pairs is summed over the batches and divided once, so that every
    target token (or row) weighs the same whatever the batch size."""
    model.eval()
    sums: dict[str, tuple[float, int]] = {}
    bs = recipe.training.micro_batch_size
    for start in range(0, len(dataset), bs):
        batch = collate(dataset, list(range(start, min(start + bs, len(dataset)))), pad_id, device)
        loss, metrics = model(batch, norm=1.0)  # the sum over the batch's target tokens
        targets = int(batch["loss_mask"][:, 1:].sum())  # a first token is no row's target
        for key, (num, den) in {"loss": (float(loss), targets), **metrics}.items():
            total, number = sums.get(key, (0.0, 0))
            sums[key] = (total + num, number + den)
    model.train()
    return {f"eval/{k}": v for k, v in ratio_means(sums).items()}


def assert_trainable(model: torch.nn.Module, expected: int, accelerator: Accelerator) -> None:
    """Print and check the trainable parameter count (only heads, and LoRA in Medusa-2)."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(f"trainable parameters: {n:,}")
    if n != expected:
        raise RuntimeError(
            f"{n} trainable parameters, expected {expected}: the base must stay frozen"
        )
