"""What every heads config shares: the base it was trained on and the headstart format version.

Heads configs are dataclasses whose `to_dict()` is the engine's config.json (vLLM / SGLang read
it as is); the extra `base_*` and `headstart_format` keys are ignored by the engines and let
`load_heads` refuse heads trained for another base.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# 2 (2026-12-03): EAGLE-3's eagle_config.eagle_aux_hidden_state_layer_ids in SGLang's meaning (the
# output of layer i), the top-level key in vLLM's (the state entering layer i); format 1 wrote
# both in vLLM's. EAGLE-1 no longer writes "bias" (the engines read it as an attention bias).
HEADSTART_FORMAT = 2


_SIMPLE = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "None": (type(None),),
}


def _json_types(annotation: str) -> tuple[type, ...]:
    """The JSON value types a field's annotation (a string, e.g. "int | list[int] | None")
    admits; () where it names a type this check does not know (no check)."""
    types: tuple[type, ...] = ()
    for part in annotation.split("|"):
        name = part.strip().split("[")[0]
        kinds = _SIMPLE.get(name) or {"list": (list,), "dict": (dict,)}.get(name)
        if kinds is None:
            return ()
        types += kinds
    return types


RENAMED_KEYS = {"base_num_hidden_layers": "base_hidden_layers"}  # old name -> new


def renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict with the keys of older headstart folders under their new names."""
    data = dict(data)
    for old, new in RENAMED_KEYS.items():
        if old in data:
            value = data.pop(old)
            data.setdefault(new, value)
    return data


# a GGUF file's quantisation suffix: "SmolLM2-135M-Instruct.Q4_1", "llama-3-8b-instruct-q4_k_m"
_QUANT_SUFFIX = re.compile(r"[.-](i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def same_base(a: str, b: str) -> bool:
    """Whether two spellings name the same base: an alias, a Hub id, a folder or a GGUF file of
    one name (`smollm2-135m-instruct`, `HuggingFaceTB/SmolLM2-135M-Instruct`,
    `/models/SmolLM2-135M-Instruct`, `SmolLM2-135M-Instruct.Q4_1.gguf`)."""

    def name(spelling: str) -> str:
        last = Path(str(spelling)).name.lower().removesuffix(".gguf")
        return _QUANT_SUFFIX.sub("", last)

    return name(a) == name(b)


@dataclass
class HeadsConfig:
    """Base-model facts recorded with every heads checkpoint (a mismatch is an error)."""

    base_model_name_or_path: str = ""
    base_hidden_size: int = 0
    base_vocab_size: int = 0
    # Not "base_num_hidden_layers": vLLM's MedusaConfig moves every key holding "num" and
    # "layers" into num_hidden_layers (its residual blocks per head). Folders written before
    # the rename are read under their old key.
    base_hidden_layers: int = 0
    headstart_format: int = HEADSTART_FORMAT
    # The system prompt and chat template (its text) of the answers the heads learned from, when
    # the training recipe set them (null: the source's system turns, the tokenizer's template):
    # the heads draft best under the same, and a folder from the Hub has no recipe beside it.
    training_system_prompt: str | None = None
    training_chat_template: str | None = None
    # The GGUF file the base was read from (dequantised) when training, e.g. the embedded model's
    # Q4_1: the heads learned its hidden states, which full-precision weights only approach.
    training_base_gguf: str | None = None

    def validate(self) -> None:
        if self.headstart_format > HEADSTART_FORMAT:
            raise ValueError(
                f"heads written by a newer headstart (format {self.headstart_format} > "
                f"{HEADSTART_FORMAT}); upgrade headstart to load them"
            )

    def check_base(self, base_config) -> None:
        """Raise if `base_config` is not the kind of base these heads were trained on."""
        ours = {
            "hidden_size": self.base_hidden_size,
            "vocab_size": self.base_vocab_size,
            "num_hidden_layers": self.base_hidden_layers,
        }
        for key, expected in ours.items():
            got = getattr(base_config, key)
            if expected and got != expected:
                trained_on = (
                    f"base '{self.base_model_name_or_path}'"
                    if self.base_model_name_or_path
                    else "a base"
                )
                raise ValueError(
                    f"these heads were trained on {trained_on} with "
                    f"{key}={expected}, but the given base '{getattr(base_config, 'name_or_path', '?')}' "
                    f"has {key}={got}; load the heads with the base they were trained for"
                )
        recorded = self.base_model_name_or_path
        given = str(getattr(base_config, "name_or_path", "") or "")
        # Medusa-2 heads are served on their base with an adapter merged, saved under any name:
        # their probe of the adapted weights tells (heads/lora.py)
        merged_elsewhere = bool(getattr(self, "base_lora", ""))
        mismatched = recorded and given and not merged_elsewhere and not same_base(recorded, given)
        # said once per heads and base: load_heads checks, then the generator built on them
        if mismatched and getattr(self, "_warned_for", None) != given:
            self._warned_for = given
            warnings.warn(
                f"these heads were trained on '{recorded}' and the given base is '{given}', of the "
                "same sizes: heads seldom draft well for another model (the output stays the "
                "given base's own, only slower); load them with the base they were trained for, "
                "unless it is that model under another name",
                stacklevel=3,
            )

    def to_dict(self) -> dict[str, Any]:
        # the format written now, whatever the folder read was written in
        d = {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("training_")}
        return {**d, **self.training_keys(), "headstart_format": HEADSTART_FORMAT}

    def training_keys(self) -> dict[str, str]:
        """config.json's keys on what the heads learned under: only those a run set."""
        keys = {
            "training_system_prompt": self.training_system_prompt,
            "training_chat_template": self.training_chat_template,
            "training_base_gguf": self.training_base_gguf,
        }
        return {k: v for k, v in keys.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build from a config.json dict; keys this class does not know are ignored (engines
        add their own), a key of the wrong type is an error."""
        data = renamed_keys(data)
        cls.check_types(data)
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in kinds})

    @classmethod
    def check_types(cls, data: dict[str, Any]) -> None:
        """A ValueError naming the first key of `data` whose value has the wrong type."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, value in data.items():
            allowed = _json_types(kinds.get(key, "Any"))
            wrong = (
                not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed
            )
            if allowed and wrong:
                raise ValueError(
                    f"config.json: {key} is {value!r}, expected {kinds[key]}; is this a heads folder "
                    "written by another tool, or edited by hand?"
                )

    def save(self, folder: str | Path) -> None:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
