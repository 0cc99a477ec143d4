"""Training checkpoints: atomic `accelerator.save_state` snapshots, resume, and the NaN guard.

A checkpoint is `OUTPUT/checkpoints/step-XXXXXXXX/`: accelerate's state (heads, optimizer,
scheduler, RNG) plus `trainer_state.json` (step, epoch, batch within the epoch, metrics) and the
resolved recipe. It is written under a temporary name and renamed when complete, so a run killed
mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from array import array
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator, PartialState
from transformers.integrations import is_deepspeed_zero3_enabled

from heads.config import same_base
from heads.placement import default_dtype
from train.config import RecipeError, dotted_items, recipe_to_dict, save_recipe
from train.feature_cache import cache_base_dtype, weights_fingerprint
from train.features import VOCAB_FILE, save_draft_vocabulary

STATE_NAME = "trainer_state.json"
# How the held-out answers were chosen (train.features.split_held_out), recorded in each
# checkpoint: a run resumed under another way would train on answers it measured before.
HELD_OUT_SPLIT = (
    "prompt-hash-2"  # 2 (2026-12-05): the prompt tokenised alone, see train.features._prompt_key
)
# What a resumed run must share with its checkpoint: the base, the heads (and those it started
# from), the data, the order of the batches and the loss. Anything else (epochs, max_steps,
# learning rate, logging, eval and save steps, where the data folder lies) may change between a
# run and its resumption, and the run says what did.
RESUME_FIXED = (
    "heads",
    "data.chat_template",
    "data.system_prompt",
    "training.mode",
    "training.micro_batch_size",
    "training.gradient_accumulation_steps",
    "training.max_length",
    "training.eval_fraction",
    "training.text_corpus",
    "training.text_max_tokens",
    "training.seed",
    "training.init_heads",
    "training.loss_decay",
    "training.soft_labels",
)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints (not one a kill cut short), oldest first."""
    done = [p for p in checkpoints_dir(output_dir).glob("step-*") if (p / STATE_NAME).is_file()]
    return sorted(done, key=checkpoint_step)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder `step-XXXXXXXX`."""
    return int(path.name.split("-")[1])


def save_checkpoint(
    accelerator, output_dir: str | Path, recipe, state: dict, keep_last: int
) -> Path:
    """Snapshot everything needed to resume exactly (call on every process)."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state['step']:08d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        # Made before any process writes: under DeepSpeed, another rank's RNG state may come
        # before the first process has created the folder.
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every process has written its part before the rename
    if accelerator.is_main_process:
        state = {
            **state,
            "num_processes": accelerator.num_processes,
            "held_out_split": HELD_OUT_SPLIT,
        }
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=2))
        save_recipe(recipe, tmp / "recipe.yaml")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        done = sorted(
            (p for p in root.glob("step-*") if (p / STATE_NAME).is_file()), key=lambda p: p.name
        )
        for old in done[: max(len(done) - keep_last, 0)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path, optimizer=None, scheduler=None) -> dict:
    """Restore accelerate's state from `path`; returns its trainer state.

    The optimizer's saved state brings back its learning rates and weight decay, and the
    scheduler's its base rates. The recipe's, which may change between a run and its
    resumption (they are not in `RESUME_FIXED`), are put back over them: each group's rate as
    the schedule (stretched to a new length, or not) gives it at the step resumed. Otherwise a
    new learning rate would be recorded in the run's recipe but never used, and a finished run
    given more steps would take its first one at the old schedule's end value.
    """
    built = optimizer.param_groups if optimizer is not None else []
    recipe = [(g.get("initial_lr", g["lr"]), g["weight_decay"]) for g in built]
    accelerator.load_state(str(path))
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds it
    lambdas = getattr(inner, "lr_lambdas", None)  # None: DeepSpeed's own scheduler
    if recipe and lambdas is not None:
        groups = optimizer.param_groups  # loading the state replaced the group dicts
        for group, (lr, decay), factor in zip(groups, recipe, lambdas):
            group["initial_lr"], group["weight_decay"] = lr, decay
            group["lr"] = lr * factor(inner.last_epoch)
        inner.base_lrs = [lr for lr, _ in recipe]
        # get_last_lr(), which the log reads: this step's rate, as scheduler.step() sets it
        inner._last_lr = [group["lr"] for group in groups]
    return json.loads((path / STATE_NAME).read_text())


def resumed_line(path: Path, step: int, total: int) -> str:
    """What a trainer says on resuming; a run already past this recipe's steps (a smaller
    training.max_steps or fewer epochs now) is refused: its heads are not this recipe's."""
    if step > total:
        raise ValueError(
            f"the run in {path.parent.parent} is at step {step} ({path.name}), past this "
            f"recipe's {total} steps: raise training.max_steps or training.epochs to go on, give "
            "another output.dir for a shorter run, or training.resume=never to replace this one "
            "(its checkpoints are removed)"
        )
    return f"resumed from {path} at step {step}"


def check_same_run(path: Path, recipe, processes: int) -> list[str]:
    """Compare `recipe` and the process count with those that wrote checkpoint `path`; returns
    the settings that changed and may (`key: old there, new now`), for the run to say.

    Raises:
        RecipeError: they differ on a `RESUME_FIXED` key or in processes: resuming would not
            continue that run.
    """
    state = json.loads((path / STATE_NAME).read_text())
    saved_processes = state.get("num_processes")
    saved_file = path / "recipe.yaml"
    saved = yaml.safe_load(saved_file.read_text()) if saved_file.is_file() else None
    now = recipe_to_dict(recipe)
    diffs = []
    # A key the saved recipe lacks came with a later headstart: not a difference of the run.
    for key in RESUME_FIXED if saved is not None else ():
        was, new = _lookup(saved, key), _lookup(now, key)
        if isinstance(new, dict):  # a whole section: name the fields that differ
            was = was if isinstance(was, dict) else {}
            diffs += [
                f"{key}.{k}: {was[k]!r} there, {v!r} now"
                for k, v in new.items()
                if k in was and was[k] != v
            ]
        elif was is not _MISSING and was != new:
            diffs.append(f"{key}: {was!r} there, {new!r} now")
    if saved is not None:  # the same base, however it is named: a Hub id, an alias, a path
        was, new = _lookup(saved, "model.name_or_path"), recipe.model.name_or_path
        if was is not _MISSING and not same_base(was, new):
            diffs.append(f"model.name_or_path: {was!r} there, {new!r} now")
    if saved_processes is not None and saved_processes != processes:
        diffs.append(f"processes: {saved_processes} there, {processes} now")
    if state.get("data") and state["data"] != data_fingerprint(recipe.data.output_dir):
        diffs.append(
            f"the answers in data.output_dir={recipe.data.output_dir!r} are not those it trained "
            "on (other shards or sizes)"
        )
    if diffs:
        raise RecipeError(
            f"the checkpoint {path} belongs to another run ({'; '.join(diffs)}). Rerun with its "
            "values to continue it, or start afresh with training.resume=never (it overwrites "
            "this output) or another output.dir."
        )
    if saved is None:
        return []
    return [
        f"{key}: {was!r} there, {new!r} now"
        for key, new in dotted_items(now)
        if key not in ("training.resume", "model.name_or_path")
        and (was := _lookup(saved, key)) is not _MISSING
        and was != new
    ]


_MISSING = object()


def base_identity(base, ckpt: Path | None) -> dict:
    """What each checkpoint records of the base as loaded (before DeepSpeed may cast it): its
    dtype and its weights fingerprint (None under ZeRO-3, where each process holds a shard),
    checked against those of the checkpoint `ckpt` the run resumes (a base re-exported,
    fine-tuned or merged under its old name, or loaded in another dtype); a checkpoint from
    before the held-out split was recorded is said. Call on every process.

    Raises:
        RecipeError: the fingerprints differ.
    """
    now = str(base.dtype).removeprefix("torch.")
    if is_deepspeed_zero3_enabled():
        return {"base_weights": None, "base_dtype": now}
    fingerprint = weights_fingerprint(base)
    state = json.loads((ckpt / STATE_NAME).read_text()) if ckpt is not None else {}
    was = state.get("base_weights")
    if was and was != fingerprint:
        dtype = state.get("base_dtype")
        if dtype and dtype != now:
            raise RecipeError(
                f"the checkpoint {ckpt} trained with the base in {dtype}, loaded in {now} now: "
                f"resume with model.dtype={dtype}, or start afresh with training.resume=never "
                "(it overwrites this output) or another output.dir."
            )
        raise RecipeError(
            f"the checkpoint {ckpt} trained on other weights of the base than those loaded now "
            f"(fingerprint {was} there, {fingerprint} now: re-exported, fine-tuned or merged "
            "since?). Resume with the base it trained on, or start afresh with "
            "training.resume=never (it overwrites this output) or another output.dir."
        )
    older = ckpt is not None and state.get("held_out_split") != HELD_OUT_SPLIT
    if older and PartialState().is_main_process:
        print(
            f"warning: the checkpoint {ckpt} was written by an earlier headstart, which chose "
            "its held-out answers another way: resumed, the run trains on some answers it "
            "measured before, so its held-out figures read high. training.resume=never starts "
            "afresh.",
            file=sys.stderr,
        )
    return {"base_weights": fingerprint, "base_dtype": now}


def built_on_dtype(
    ckpt: Path | None, feature_cache: str | None, device: torch.device
) -> str | None:
    """The base dtype of what a training run builds on: the checkpoint `ckpt` it resumes (one
    written before the dtype was recorded: its recipe's model.dtype, else load_base's default on
    `device`), else an existing `feature_cache`; None for a fresh run.

    Raises:
        FeatureCacheError: the cache's features.json is damaged.
    """
    if ckpt is None:
        return cache_base_dtype(feature_cache) if feature_cache else None
    recorded = json.loads((ckpt / STATE_NAME).read_text()).get("base_dtype")
    if recorded:
        return recorded
    saved = ckpt / "recipe.yaml"
    recipe = yaml.safe_load(saved.read_text()) if saved.is_file() else None
    dtype = (recipe or {}).get("model", {}).get("dtype", "auto")
    return str(default_dtype(device)).removeprefix("torch.") if dtype == "auto" else dtype


def data_fingerprint(output_dir: str | Path) -> str:
    """The distilled shards' names and sizes, hashed: the same answers wherever the folder lies,
    and another fingerprint once distill adds answers or the folder holds other ones."""
    shards = sorted(Path(output_dir).glob("*.jsonl"))
    listing = "\n".join(f"{p.name} {p.stat().st_size}" for p in shards)
    return hashlib.sha1(listing.encode()).hexdigest()[:16]


def examples_fingerprint(train: list[dict], held_out: list[dict]) -> str:
    """The token ids and target masks of a run's examples, in order, hashed: what it trains on
    and measures, however it was made (distilled answers, a text corpus, a tokenizer)."""
    digest = hashlib.sha1()
    for part in (train, held_out):
        digest.update(f"{len(part)};".encode())
        for example in part:
            digest.update(array("l", example["input_ids"]).tobytes())
            digest.update(bytes(example["loss_mask"]))
    return digest.hexdigest()[:16]


def check_same_examples(ckpt: Path | None, fingerprint: str) -> None:
    """The examples loaded now against those the checkpoint `ckpt` trained on (before any
    feature is computed); checkpoints from before this was recorded pass.

    Raises:
        RecipeError: they differ, so resuming would train some answers twice and skip others.
    """
    was = json.loads((ckpt / STATE_NAME).read_text()).get("examples") if ckpt else None
    if was and was != fingerprint:
        raise RecipeError(
            f"the checkpoint {ckpt} trained on other examples than those loaded now (answers "
            "added to or removed from data.output_dir, or another training.text_corpus "
            "content, since it started): resuming would train some twice and skip others. "
            "Rerun with the data it trained on, or start afresh with training.resume=never (it "
            "overwrites this output) or another output.dir."
        )


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part, _MISSING) if isinstance(tree, dict) else _MISSING
    return tree


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """`resume`: "auto" (latest checkpoint if any), "never", or a checkpoint folder."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / STATE_NAME).is_file():
        raise FileNotFoundError(
            f"training.resume={resume!r} is not a checkpoint folder (no {STATE_NAME})"
        )
    return path


def run_folder(ckpt: Path | None) -> Path | None:
    """The output folder of the run that wrote `ckpt` (OUTPUT/checkpoints/step-N), resolved;
    None for a checkpoint kept elsewhere, or none."""
    if ckpt is None:
        return None
    ckpt = ckpt.resolve()  # "step-00000010" given from inside checkpoints/, or a link to it
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def of_this_folder(ckpt: Path, output_dir: str | Path) -> bool:
    """Whether `ckpt` is one of `output_dir`'s own checkpoints."""
    return run_folder(ckpt) == Path(output_dir).resolve()


def check_branch(ckpt: Path, output_dir: str | Path) -> None:
    """`training.resume=PATH` of another folder's checkpoint goes on from it in `output_dir` as
    a new run there; refused while `output_dir` holds checkpoints, which that run would mix with
    its own (its rotation would remove its own, resume=auto would take theirs)."""
    if of_this_folder(ckpt, output_dir):
        return
    held = complete_checkpoints(output_dir)
    if held:
        raise RecipeError(
            f"training.resume={ckpt} is another folder's checkpoint, and output.dir="
            f"{output_dir} holds checkpoints already (latest {held[-1].name}): "
            "training.resume=auto goes on from those; to go on from this one, give a new "
            f"output.dir (or remove {checkpoints_dir(output_dir)})"
        )


def check_finite(loss: float, step: int, output_dir: str | Path, what: str = "loss") -> None:
    """Stop on a NaN / infinite loss (or `what` else: the gradients' norm), naming the
    checkpoint to go on from (which is kept).

    A loss is checked before its update, so no checkpoint holds a NaN; but one saved just
    before the step that diverged holds the weights that step started from, which may be what
    diverged (a learning rate far too high leaves them huge, not NaN): then the one before it
    is named too, or a fresh start.
    """
    if math.isfinite(loss):
        return
    done = complete_checkpoints(output_dir)
    if not done:
        then = "rerun (no checkpoint was written yet)"
    else:
        then = f"rerun: resume=auto goes on from the last checkpoint, {done[-1]}"
        if checkpoint_step(done[-1]) == step - 1:  # the weights this step started from
            earlier = (
                f"training.resume={done[-2]}, the one before"
                if len(done) > 1
                else "training.resume=never, afresh"
            )
            then += (
                f" (the weights step {step} started from: should they diverge again, rerun with "
                f"{earlier})"
            )
    raise TrainingDiverged(
        f"{what} is {loss} at step {step}; training stopped. Lower training.learning_rate or raise "
        f"training.warmup_steps (a resumed run takes the new values), then {then}."
    )


def clear_later_checkpoints(output_dir: str | Path, ckpt: Path, accelerator: Accelerator) -> None:
    """A run resumed from an earlier checkpoint than its latest (`training.resume=PATH`) goes
    on from there: the later checkpoints, of the continuation it replaces, are removed (as its
    metrics.jsonl lines past that step are), or a kill would resume one of them and keeping the
    last checkpoints could remove the one resumed from."""
    step = checkpoint_step(ckpt) if ckpt.name.startswith("step-") else None
    root = checkpoints_dir(output_dir)
    if not accelerator.is_main_process or step is None:
        accelerator.wait_for_everyone()
        return
    for path in root.glob(".tmp-step-*"):  # a save a kill cut short, which no save may redo
        shutil.rmtree(path)
    later = [p for p in root.glob("step-*") if checkpoint_step(p) > step]
    for path in later:
        shutil.rmtree(path)
    if later:
        print(
            f"resuming from {ckpt.name}: removed the {len(later)} later checkpoint(s) of the "
            "run it replaces"
        )
    accelerator.wait_for_everyone()


def clear_earlier_run(
    output_dir: str | Path, accelerator: Accelerator, ckpt: Path | None = None
) -> None:
    """A run that starts afresh (training.resume=never over an earlier run's output), or from
    another folder's checkpoint `ckpt`, removes that run's checkpoints, which would otherwise
    outnumber its own in keep_last_checkpoints and be resumed after a kill, and its draft
    vocabulary, which came from that run's data. Going on from `ckpt`, its metrics.jsonl takes
    the lines of the run that wrote it (those past its step go in `MetricsLog`)."""
    if accelerator.is_main_process:
        output = Path(output_dir)
        old = sorted(checkpoints_dir(output).glob("*step-*"))  # and .tmp-step-* of a kill
        for path in old:
            shutil.rmtree(path)
        removed = [f"{len(old)} checkpoint(s)"] if old else []
        vocab = output / VOCAB_FILE
        if vocab.is_file():
            vocab.unlink()
            removed.append(vocab.name)
        if ckpt is not None:
            metrics = output / "metrics.jsonl"
            source = run_folder(ckpt)
            if source is not None and (source / metrics.name).is_file():
                output.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / metrics.name, metrics)
            elif metrics.is_file():
                metrics.unlink()
        if removed:
            start = "starting afresh" if ckpt is None else f"going on from {ckpt}"
            print(f"{start} in {output}: removed the earlier run's {' and '.join(removed)}")
    accelerator.wait_for_everyone()


def begin_run(recipe, ckpt: Path | None, accelerator: Accelerator, vocab=None) -> None:
    """Called once every input is checked (base, data, heads, the checkpoint's state), before
    the first write: a run refused for bad input or stopped before leaves the earlier run's
    files as they were. Starting afresh removes the earlier run's checkpoints and draft
    vocabulary; resuming an earlier checkpoint than the latest removes those of the
    continuation it replaces; going on from another folder's checkpoint starts this folder
    afresh from it. `vocab`: the draft vocabulary this run built from its data (or read with
    its checkpoint), written for a resumed run to read."""
    if ckpt is None or not of_this_folder(ckpt, recipe.output.dir):
        clear_earlier_run(recipe.output.dir, accelerator, ckpt)
    else:
        clear_later_checkpoints(recipe.output.dir, ckpt, accelerator)
    written = (Path(recipe.output.dir) / VOCAB_FILE).is_file()  # the file a resumed run read
    if vocab is not None and accelerator.is_main_process and not written:
        save_draft_vocabulary(recipe.output.dir, vocab)
    accelerator.wait_for_everyone()
