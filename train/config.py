"""Recipe schema: dataclasses whose fields are the YAML keys, every default in one place.

A recipe is a YAML file with one mapping per section (`model:`, `data:`, ...). `load_recipe` reads
it, applies `key=value` overrides from the command line and checks every key and value against the
dataclasses below by walking their type hints (train/typed_config.py), so adding a section is
adding a dataclass and one field on `Recipe`. Unknown keys and wrong types are errors that name the field, the valid keys and
the expected type.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from heads.eagle_config import in_engine_order
from train.typed_config import RecipeError, apply_override, build


@dataclass
class ModelConfig:
    """The frozen base model."""

    # "smollm2-135m-instruct" (embedded, offline), a Hugging Face Hub id, a folder or a .gguf.
    name_or_path: str = "smollm2-135m-instruct"
    # "auto": bf16 on a CUDA device, fp32 on CPU, except bf16 on a CPU that computes it for
    # sampled answers (distill) and offline features under bf16 autocast (train.precision).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"

    def __post_init__(self) -> None:
        if not self.name_or_path.strip():
            raise RecipeError(
                "'model.name_or_path' is empty: give the base (the embedded "
                "'smollm2-135m-instruct', a Hub id, a folder or a .gguf)"
            )


@dataclass
class DataConfig:
    """Prompts and self-distillation (`scripts/distill.py`), and tokenisation for training."""

    # Each: "embedded" (the offline default set), "embedded:CAT[,CAT]", "embedded:all" (it and
    # the extra categories), a .jsonl / .json file, a folder of .jsonl shards, or
    # "hf:ORG/NAME[:CONFIG]:SPLIT" (Hugging Face datasets).
    sources: list[str] = field(default_factory=lambda: ["embedded"])
    limit: int | None = None  # prompts kept, in the order of a seeded hash; None keeps all
    max_new_tokens: int = 512  # per assistant turn
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    num_samples: int = 1  # answers per prompt; more than one needs temperature > 0
    system_prompt: str | None = None  # None: the source's system turn, else the template default
    chat_template: str | None = None  # Jinja string or path to a .jinja file; None: tokenizer's
    batch_size: int = 64  # prompts per generate call (64 ran 1.17x the rate of 32 on 2 CPU cores)
    max_length: int = 2048  # tokens of a whole conversation (prompt + answers)
    output_dir: str = "runs/distill"
    records_per_shard: int = 256  # a shard (one answer per record) is written atomically this often
    on_error: Literal["skip", "stop"] = "skip"  # malformed prompt records
    seed: int = 0
    backend: Literal["auto", "transformers", "vllm"] = "auto"  # auto: vLLM when importable + CUDA

    def __post_init__(self) -> None:
        refuse_file("data.output_dir", self.output_dir)
        positive = (
            "max_new_tokens",
            "num_samples",
            "batch_size",
            "max_length",
            "records_per_shard",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise RecipeError(f"'data.{name}' must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise RecipeError(f"'data.limit' must be >= 1 or null, got {self.limit}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise RecipeError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}"
            )
        if self.num_samples > 1 and self.temperature == 0:
            raise RecipeError(
                f"'data.num_samples' = {self.num_samples} needs 'data.temperature' > 0 "
                "(greedy decoding gives the same answer every time)"
            )
        if not self.sources:
            raise RecipeError("'data.sources' is empty; give at least one prompt source")


@dataclass
class SelfInstructConfig:
    """New prompts written by the base itself (`scripts/self_instruct.py`). `method` "list":
    shown a numbered list of example requests of one category, it continues the list with a new
    one; "magpie": shown its chat template up to where a user's message begins (and nothing
    else), it writes the user's message (Magpie, Xu et al. 2024)."""

    method: Literal["list", "magpie"] = "list"
    seed_sources: list[str] = field(default_factory=lambda: ["embedded"])  # the examples shown
    num_prompts: int = 1000  # new prompts to write (a rerun with more continues)
    examples_per_prompt: int = 5
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 64  # a request longer than this is dropped (magpie: ~96 keeps more)
    max_similarity: float = 0.7  # word-set Jaccard above this to a kept prompt: a near duplicate
    output: str = "runs/self-instruct/prompts.jsonl"  # a prompt source for data.sources
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.seed_sources:
            raise RecipeError(
                "self_instruct.seed_sources is empty: name the prompts shown as examples, e.g. "
                "[embedded] (the default) or a .jsonl file"
            )
        if self.num_prompts < 1 or self.examples_per_prompt < 1 or self.max_new_tokens < 1:
            raise RecipeError(
                "need self_instruct.num_prompts, examples_per_prompt, max_new_tokens >= 1"
            )
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or not 0 < self.max_similarity <= 1:
            raise RecipeError(
                "need self_instruct.temperature > 0, 0 < top_p <= 1, 0 < max_similarity <= 1"
            )


@dataclass
class HeadsSpec:
    """The draft heads to train (`type` picks the recipe: train/medusa.py or train/eagle.py)."""

    type: Literal["medusa", "eagle"] = "medusa"
    # Medusa (Cai et al. 2024)
    num_heads: int = 4  # head k predicts token t+k+2
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = False  # share the base's frozen lm_head (vLLM original_lm_head)
    fc_bias: bool = True
    # Medusa-2: LoRA on the base (peft) with a KL term to the original base; lora_r 0 = Medusa-1
    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    kl_weight: float = 1.0
    heads_lr_multiplier: float = 4.0  # heads' learning rate / the LoRA's
    heads_loss_warmup_steps: int = 0  # ramp of the heads' loss weight from 0 to 1
    # EAGLE (Li et al. 2024, 2025)
    version: int = 3  # 1 or 3
    draft_vocab_size: int | None = None  # EAGLE-3 reduced vocabulary; None: min(32000, V)
    aux_layer_ids: list[int] | None = None  # None: heads.default_aux_layer_ids (2, L//2, L-3)
    ttt_steps: int = 7  # EAGLE-3 training-time test unroll
    init_from_base: bool = True  # EAGLE-3: start from the base's top layer, norm, lm_head
    feature_loss_weight: float = 1.0  # EAGLE-1 SmoothL1 on the next feature
    token_loss_weight: float = 0.1  # EAGLE-1 soft CE on the next token
    feature_noise: float = 0.2  # EAGLE-1 uniform noise U(-a/2, a/2) on the input features

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0 or self.ttt_steps < 1 or self.lora_r < 0:
            raise RecipeError(
                "need heads.num_heads >= 1, num_layers >= 0, ttt_steps >= 1, lora_r >= 0"
            )
        if self.version not in (1, 3):
            raise RecipeError(f"'heads.version' must be 1 or 3, got {self.version}")
        if not (
            self.lora_alpha > 0 and 0 <= self.lora_dropout < 1 and self.heads_lr_multiplier > 0
        ):
            raise RecipeError(
                "need heads.lora_alpha > 0, 0 <= lora_dropout < 1 and heads_lr_multiplier > 0; "
                f"got {self.lora_alpha}, {self.lora_dropout} and {self.heads_lr_multiplier}"
            )
        for name in (  # a loss weight below 0 trains the heads away from its target
            "kl_weight",
            "heads_loss_warmup_steps",
            "feature_loss_weight",
            "token_loss_weight",
            "feature_noise",
        ):
            if getattr(self, name) < 0:
                raise RecipeError(f"need heads.{name} >= 0, got {getattr(self, name)}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise RecipeError(
                f"need heads.draft_vocab_size >= 1 (the draft's most frequent tokens), or null "
                f"for the default; got {self.draft_vocab_size}"
            )
        ids = self.aux_layer_ids
        if ids is not None and not in_engine_order(ids, distinct=False):  # the base's size decides
            raise RecipeError(
                f"'heads.aux_layer_ids' {list(ids)}: give them in ascending order, e.g. "
                "[2, 15, 27]: vLLM and SGLang collect the base's states in layer order and "
                "would feed the draft's fc in another order than training did"
            )

    def unused_eagle_settings(self) -> list[str]:
        """`key=value` of the settings this EAGLE version does not read that differ from their
        defaults (EAGLE-3's for an EAGLE-1 layer, and the reverse): said, not dropped unsaid."""
        only = {  # by the version that does not read them
            1: ("draft_vocab_size", "aux_layer_ids", "ttt_steps", "init_from_base"),
            3: ("feature_loss_weight", "token_loss_weight", "feature_noise"),
        }[self.version]
        default = HeadsSpec()
        return [
            f"heads.{k}={getattr(self, k)}" for k in only if getattr(self, k) != getattr(default, k)
        ]


@dataclass
class TrainingConfig:
    """The optimisation loop (accelerate does the distributed work)."""

    mode: Literal["online", "offline"] = "online"  # offline: base features computed once, kept
    # offline mode: a folder for the features as bf16 safetensors shards, reused by later runs
    # on the same data (train/feature_cache.py); None keeps them in memory for this run only
    feature_cache: str | None = None
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps, over as many epochs as they take; None: epochs
    micro_batch_size: int = 8  # examples per process per forward
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    loss_decay: float = 0.8  # weight decay^k of head / TTT step k
    soft_labels: bool = True  # the base's distribution as target instead of its token
    max_length: int = 2048  # tokens per example (longer ones are truncated)
    # Teacher-forced text beside the distilled answers (train/corpus.py): "embedded" (offline
    # Python and package docs) or .txt/.md files and folders; every token is a target.
    text_corpus: list[str] = field(default_factory=list)
    text_max_tokens: int = 0  # cap on the corpus' target tokens; 0: all of it
    eval_fraction: float = 0.05  # held-out examples for accuracy / simulated acceptance
    eval_every_steps: int = 0  # 0: at the end of every epoch
    save_every_steps: int = 0  # 0: at the end of every epoch
    keep_last_checkpoints: int = 2
    resume: str = "auto"  # "auto", "never", or a checkpoint folder
    # Start from trained heads (a folder or Hub repo id with this recipe's heads shape) instead
    # of a fresh init: fine-tune them on this data; their draft vocabulary is kept
    init_heads: str | None = None
    # "auto": bf16 where the hardware computes it (a GPU, a CPU with AVX512-BF16 or AMX), else no
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] = "no"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.feature_cache:
            refuse_file("training.feature_cache", self.feature_cache)
        if self.epochs < 1 or self.micro_batch_size < 1 or self.gradient_accumulation_steps < 1:
            raise RecipeError(
                "need training.epochs, micro_batch_size, gradient_accumulation_steps >= 1"
            )
        if self.learning_rate <= 0 or not 0 <= self.eval_fraction < 1:
            raise RecipeError("need training.learning_rate > 0 and 0 <= eval_fraction < 1")
        if self.feature_cache and self.mode != "offline":
            raise RecipeError("training.feature_cache needs training.mode=offline")
        if self.keep_last_checkpoints < 1:
            raise RecipeError(
                "need training.keep_last_checkpoints >= 1 (the checkpoint just written is kept)"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise RecipeError("need training.max_steps >= 1, or null to let epochs decide")
        for name in ("warmup_steps", "eval_every_steps", "save_every_steps", "text_max_tokens"):
            if getattr(self, name) < 0:
                raise RecipeError(f"need training.{name} >= 0 (0: {_ZERO_MEANS[name]})")
        if self.loss_decay < 0:
            raise RecipeError(
                f"need training.loss_decay >= 0 (head / TTT step k's loss weighs loss_decay^k; "
                f"0: the first alone); got {self.loss_decay}"
            )
        if self.max_length < 2 or self.max_grad_norm <= 0 or self.weight_decay < 0:
            raise RecipeError(
                "need training.max_length >= 2, max_grad_norm > 0 and weight_decay >= 0"
            )


_ZERO_MEANS = {
    "warmup_steps": "no warmup",
    "eval_every_steps": "at the end of every epoch",
    "save_every_steps": "at the end of every epoch",
    "text_max_tokens": "all of the text corpus",
}


@dataclass
class OutputConfig:
    dir: str = "runs/heads"  # checkpoints/, heads/ (the final heads folder), metrics.jsonl
    heads_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # of the saved heads

    def __post_init__(self) -> None:
        refuse_file("output.dir", self.dir)


@dataclass
class HubConfig:
    repo_id: str | None = None  # push the final heads here (needs a Hub token)
    private: bool = False


@dataclass
class LoggingConfig:
    report_to: Literal["none", "wandb", "tensorboard"] = "none"  # wandb runs offline without a key
    project: str = "headstart"
    log_every_steps: int = 10

    def __post_init__(self) -> None:
        if self.log_every_steps < 1:
            raise RecipeError(f"need logging.log_every_steps >= 1, got {self.log_every_steps}")


@dataclass
class Recipe:
    """A whole recipe: the base, the data (and self-instruct prompts), the heads, training,
    output, Hub and logging."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    self_instruct: SelfInstructConfig = field(default_factory=SelfInstructConfig)
    heads: HeadsSpec = field(default_factory=HeadsSpec)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        # training reads every *.jsonl of data.output_dir, and would read its own metrics.jsonl
        if Path(self.output.dir).resolve() == Path(self.data.output_dir).resolve():
            raise RecipeError(
                f"output.dir and data.output_dir are both {self.output.dir}: training writes its "
                "metrics.jsonl and checkpoints beside the answers it reads; give output.dir "
                "another folder"
            )


def refuse_file(key: str, folder: str) -> None:
    """An output folder of the recipe must be named (`key=` would mean the working directory)
    and not be an existing file (checked before any work)."""
    if not folder.strip():
        raise RecipeError(f"'{key}' is empty: give a folder (new or of an earlier run)")
    if Path(folder).is_file():
        raise RecipeError(f"'{key}' is {folder}, a file: give a folder (new or of an earlier run)")


def refuse_other_run(key: str, folder: str | Path, writer: str) -> None:
    """`writer` ("distill" or "training") may not write into the other's folder: training reads
    every *.jsonl of a distill folder (its metrics.jsonl among them, were it there), and each
    keeps its own files beside what it reads there."""
    from train.distilled import MANIFEST

    other, marks = (
        ("training run", ("metrics.jsonl", "checkpoints"))
        if writer == "distill"
        else ("distill run", (MANIFEST,))
    )
    path = Path(folder)
    if found := [m for m in marks if (path / m).exists()]:
        raise RecipeError(
            f"'{key}' is {folder}, a {other}'s folder (it holds {found[0]}): {writer} would "
            "write its files beside that run's; give another folder"
        )


def check_writable(key: str, folder: str | Path) -> None:
    """A folder the run writes must be one this user can make or write: said before the base
    and the data load, not in a traceback after."""
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(
            f"'{key}' is {folder}, but {existing} is not writable by this user: give a folder "
            "you can write"
        )


def load_recipe(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `key=value` overrides and validate it against `Recipe`.

    Args:
        path: a YAML file; None starts from the defaults.
        overrides: `section.key=value` (or `key=value` when the key names one field of one
            section); values are parsed as YAML scalars or flow collections (`[a, b]`).

    Raises:
        RecipeError: unknown key (the message lists the section's valid keys), wrong type
            (field, expected type and the value got), or a malformed override.
    """
    raw: dict[str, Any] = {}
    where = "recipe" if path is None else str(path)
    if path is not None:
        if Path(path).is_dir():
            raise RecipeError(f"{where} is a folder: give a recipe file (recipes/*.yaml)")
        if not Path(path).exists():
            shipped = Path(__file__).parents[1] / "recipes"
            names = ", ".join(sorted(p.name for p in shipped.glob("*.yaml")))
            hint = f" (the shipped ones, in recipes/: {names})" if names else ""
            raise RecipeError(f"recipe {where} not found{hint}")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise RecipeError(f"{where}: not a YAML recipe (not UTF-8 text: {e})") from e
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{where}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise RecipeError(
                f"{where}: a recipe is a mapping of sections, got {type(raw).__name__}"
            )
    for item in overrides:
        apply_override(Recipe, raw, item)
    if overrides:
        where += " (with command-line overrides)"
    return build(Recipe, raw, "", where)


def recipe_to_dict(recipe: Any) -> dict[str, Any]:
    """The recipe (or one section) as plain YAML-ready data."""
    return dataclasses.asdict(recipe)


def dotted_items(tree: dict[str, Any], prefix: str = ""):
    """(dotted key, value) of every setting of a recipe dict (`recipe_to_dict`'s), sections
    walked into: ("training.learning_rate", 0.001), ..."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from dotted_items(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def save_recipe(recipe: Any, path: str | Path) -> None:
    """Write the resolved recipe (defaults filled in) as YAML."""
    text = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True)
    Path(path).write_text(text, encoding="utf-8")
