"""What a training run writes besides its checkpoints: metrics.jsonl (`MetricsLog`) and, at its
end, the heads folder (`save_final`), with what the heads learned under in their config (the system
prompt, chat template and GGUF base: `record_training_setup`) and, when the recipe asks, its push
to the Hub."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator

from heads.base import gguf_file_name
from heads.checkpoint import as_new_file
from heads.hub import HubPushError, push_folder
from heads.lora import LORA_FOLDER, lora_probe
from train.config import Recipe, save_recipe
from train.data import resolve_chat_template
from train.run import gather_for_reading


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf for a blank one or one torn by a kill mid-write."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


class MetricsLog:
    """metrics.jsonl on the main process (one line per log) + accelerate trackers."""

    def __init__(self, recipe: Recipe, accelerator: Accelerator, start_step: int = 0) -> None:
        self.accelerator = accelerator
        self.path = Path(recipe.output.dir) / "metrics.jsonl"
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                # Lines past `start_step` come from a run killed after its last checkpoint: this
                # run logs those steps again. A fresh run (start_step 0) starts a new file.
                kept = [
                    line
                    for line in self.path.read_text().splitlines(keepends=True)
                    if _logged_step(line) <= start_step
                ]
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(kept))
                tmp.replace(self.path)

    def log(self, metrics: dict, step: int) -> None:
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.accelerator.log(metrics, step=step)


def record_training_setup(config, recipe: Recipe) -> None:
    """The system prompt and chat template (its text, read as the data is) that the recipe sets,
    and the GGUF file its base is read from, in the heads' config: said to their users, as a Hub
    folder has no recipe beside it."""
    template = recipe.data.chat_template
    config.training_system_prompt = recipe.data.system_prompt
    config.training_chat_template = resolve_chat_template(None, template) if template else None
    config.training_base_gguf = gguf_file_name(recipe.model.name_or_path)


def save_final(
    recipe: Recipe, heads, accelerator: Accelerator, metrics: dict, base=None
) -> Path | None:
    """Write the heads in the native format to OUTPUT/heads and push them when hub.repo_id is set.

    Medusa-2 (`base` a peft model): the heads read the LoRA-adapted base, so its adapter goes
    with them, to OUTPUT/heads/lora, and their config records it (`base_lora`, with a probe that
    tells `load_heads` whether the base it is given has it merged); serve with
    `PeftModel.from_pretrained(base, "OUTPUT/heads", subfolder="lora").merge_and_unload()`.
    """
    lora = base is not None and hasattr(base, "peft_config")
    probe = lora_probe(base, gather=gather_for_reading) if lora else None  # on every process
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return None
    heads = accelerator.unwrap_model(heads)
    folder = Path(recipe.output.dir) / "heads"
    if lora:  # the adapter first: the heads' config names it, and saving them checks it is there
        heads.config.base_lora, heads.config.base_lora_probe = LORA_FOLDER, probe
        base.save_pretrained(folder / LORA_FOLDER)
        for weights in (folder / LORA_FOLDER).glob("*.safetensors"):  # peft's are owner-only
            as_new_file(weights)
    elif (folder / LORA_FOLDER).is_dir():  # an earlier Medusa-2 run's, in this dir
        shutil.rmtree(folder / LORA_FOLDER)
    heads.save_pretrained(folder, dtype=getattr(torch, recipe.output.heads_dtype))
    save_recipe(recipe, Path(recipe.output.dir) / "recipe.yaml")
    (folder / "training_metrics.json").write_text(json.dumps(metrics, indent=2))
    accelerator.print(f"heads saved to {folder}")
    if lora:
        accelerator.print(f"Medusa-2 LoRA adapter saved to {folder / LORA_FOLDER}")
    if recipe.hub.repo_id:  # the folder as written: its dtype, card and training metrics
        try:
            url = push_folder(folder, recipe.hub.repo_id, private=recipe.hub.private)
        except HubPushError as e:
            private = ", private=True" if recipe.hub.private else ""  # as the run was to push
            raise SystemExit(
                f"error: {e}\nThe heads are saved in {folder}; push them again with: python -c "
                f"\"from heads.hub import push_folder; push_folder('{folder}', "
                f"'{recipe.hub.repo_id}'{private})\""
            ) from e
        accelerator.print(f"pushed to {url}")
    return folder
