"""The EAGLE draft layer's config: config.json in the layout vLLM and SGLang read (each engine's
aux layer ids in its own meaning), read back from theirs and other trainers', and what each
engine cannot serve as headstart computes it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import LlamaConfig

from heads.base import base_signature, default_aux_layer_ids
from heads.config import HEADSTART_FORMAT, HeadsConfig, renamed_keys


def engine_aux_ids(aux_layer_ids) -> dict[str, Any]:
    """The config.json keys of EAGLE-3 aux layer ids (headstart's meaning: the state entering
    layer i, transformers' hidden_states[i]) as each engine reads them: vLLM the top-level key in
    that meaning; SGLang (which captures before layer i + 1) and SpecForge `eagle_config`'s, as
    the output of layer i: i - 1 there (-1: the embeddings, which SGLang does not capture)."""
    ids = [int(i) for i in aux_layer_ids]
    return {
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]},
    }


def read_aux_ids(data: dict[str, Any]) -> list[int] | None:
    """EAGLE-3 aux layer ids of a config.json in headstart's meaning (`engine_aux_ids`): the
    top-level key as it is; else `eagle_config`'s plus one (SGLang's and SpecForge's meaning),
    except in headstart folders of format 1, which wrote it in headstart's. None: neither."""
    top = data.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return _layer_ids(top, "eagle_aux_hidden_state_layer_ids")
    nested = data.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise ValueError(f"config.json: eagle_config is {nested!r}, expected an object")
    nested = nested.get("eagle_aux_hidden_state_layer_ids")
    if not nested:
        return None
    written_in = data.get("headstart_format", HEADSTART_FORMAT)  # from_dict checks its type
    shift = 0 if isinstance(written_in, int) and written_in < 2 else 1
    return [i + shift for i in _layer_ids(nested, "eagle_config.eagle_aux_hidden_state_layer_ids")]


def _layer_ids(ids: Any, key: str) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError(f"config.json: {key} is {ids!r}, expected a list of layer numbers")
    return list(ids)


def engine_refusal(config: EagleConfig, engine: str) -> str | None:
    """Why `engine` ("vllm" or "sglang") would not compute this draft as headstart does, or None
    when it would (the export refuses, the model card says so)."""
    if config.version == 1:
        # Each engine drops, without a word, the biases its layer lacks.
        lacks = {
            "vllm": "vLLM's EAGLE-1 fc has no bias" if config.fc_bias else None,  # EAGLE's has
            "sglang": "SGLang's EAGLE-1 layer has no MLP biases" if config.mlp_bias else None,
        }
        if lacks[engine] is None:
            return None
        other, other_engine = (
            ("sglang", "SGLang (--to sglang)") if engine == "vllm" else ("vllm", "vLLM")
        )
        serve = (
            "headstart (neither engine has all of its biases)"
            if lacks[other]
            else f"{other_engine} or headstart"
        )
        return f"{lacks[engine]} and would drop this draft's: serve it with {serve}"
    ids = list(config.aux_layer_ids)
    if not in_engine_order(ids):
        return (
            f"aux layer ids {ids}: vLLM and SGLang collect the base's states in layer order, "
            "each layer once, so their fc would read them in another order (or fewer of them): "
            "train the draft with ascending, distinct heads.aux_layer_ids"
        )
    biased = [name for name in ("attention_bias", "mlp_bias") if getattr(config, name)]
    if engine == "sglang" and biased:
        return (
            f"SGLang's EAGLE-3 layer has no attention or MLP biases, and this draft has "
            f"{' and '.join(biased)} (from its base): serve it with vLLM"
        )
    if min(ids) < 1:  # their Llama adds the residual stream, which is None before layer 0
        return (
            f"aux layer ids {ids}: SGLang does not capture the embeddings (id 0, the state "
            "entering layer 0: its base forward fails on it), nor did vLLM's Llama until "
            "recently: serve the draft with headstart, or train it with heads.aux_layer_ids of "
            "1 or more"
        )
    return None


def in_engine_order(aux_layer_ids, distinct: bool = True) -> bool:
    """Whether EAGLE-3 aux layer ids are as vLLM and SGLang collect the base's states: in layer
    order, and (`distinct`) each layer once; headstart fuses them as listed."""
    ids = list(aux_layer_ids)
    return ids == sorted(ids) and (not distinct or len(set(ids)) == len(ids))


@dataclass
class EagleConfig(HeadsConfig):
    """EAGLE draft layer configuration (version 1 or 3).

    The Llama fields mirror the base's (the draft layer has the base's width, heads and rope).
    `vocab_size` is the base vocabulary; `draft_vocab_size` (EAGLE-3 only) the reduced one;
    `aux_layer_ids` the base layers whose *entering* hidden states are fused (EAGLE-3 only).
    """

    version: int = 3
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    max_position_embeddings: int = 8192
    vocab_size: int = 128256
    draft_vocab_size: int = 32000
    target_hidden_size: int = 4096
    aux_layer_ids: list[int] = field(default_factory=lambda: [2, 16, 29])
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # EAGLE-1's fc with a bias, as the EAGLE reference trains it (known from the tensors;
    # format 1 also wrote "bias": true, which the engines read as an attention bias);
    # headstart's and vLLM's have none
    fc_bias: bool = False

    @classmethod
    def from_base(
        cls,
        base_config,
        version: int = 3,
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        **kwargs,
    ) -> EagleConfig:
        """Size a draft layer for a base config. EAGLE-3's default draft vocabulary is
        min(32000, V) (EAGLE-3's choice for Llama-3's 128k vocabulary)."""
        if version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {version}")
        H = base_config.hidden_size
        L = base_config.num_hidden_layers
        # a base of under 3 layers has no 3 distinct ones: it repeats one, which headstart serves
        ids = list(aux_layer_ids or [])
        if not in_engine_order(ids, distinct=L >= 3):
            raise ValueError(
                f"aux_layer_ids {ids}: give them in ascending order, each once, as vLLM and "
                "SGLang collect the base's states (in layer order, each layer once)"
            )
        return cls(
            version=version,
            hidden_size=H,
            intermediate_size=base_config.intermediate_size,
            num_attention_heads=base_config.num_attention_heads,
            num_key_value_heads=base_config.num_key_value_heads,
            head_dim=getattr(base_config, "head_dim", None) or H // base_config.num_attention_heads,
            rms_norm_eps=norm_eps(base_config),
            rope_parameters=draft_rope_parameters(base_config),
            max_position_embeddings=base_config.max_position_embeddings,
            vocab_size=base_config.vocab_size,
            draft_vocab_size=(
                min(32000, base_config.vocab_size) if draft_vocab_size is None else draft_vocab_size
            )
            if version == 3
            else base_config.vocab_size,
            target_hidden_size=H,
            aux_layer_ids=list(aux_layer_ids or default_aux_layer_ids(L)),
            attention_bias=getattr(base_config, "attention_bias", False),
            mlp_bias=getattr(base_config, "mlp_bias", False),
            bos_token_id=base_config.bos_token_id,
            eos_token_id=base_config.eos_token_id,
            headstart_format=HEADSTART_FORMAT,
            **base_signature(base_config),
            **kwargs,
        )

    def validate(self) -> None:
        super().validate()
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {self.version}")
        if self.version == 3:
            if len(self.aux_layer_ids) != 3:
                raise ValueError(
                    f"EAGLE-3 fuses three base layers, got aux_layer_ids={self.aux_layer_ids}"
                )
            if self.base_hidden_layers and not all(
                0 <= i < self.base_hidden_layers for i in self.aux_layer_ids
            ):
                raise ValueError(
                    f"aux_layer_ids {self.aux_layer_ids} must lie in [0, {self.base_hidden_layers})"
                )
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise ValueError(
                    f"draft_vocab_size={self.draft_vocab_size} must be in (0, {self.vocab_size}]"
                )

    def check_base(self, base_config) -> None:
        """Also: the aux layers must be the base's (other trainers' folders record no layer
        count, so `validate` cannot tell)."""
        super().check_base(base_config)
        layers = base_config.num_hidden_layers
        if self.version == 3 and not all(0 <= i < layers for i in self.aux_layer_ids):
            raise ValueError(
                f"this EAGLE-3 draft fuses the states entering base layers {self.aux_layer_ids}, "
                f"but the given base '{getattr(base_config, 'name_or_path', '?')}' has {layers} "
                "layers; load the draft with the base it was trained for"
            )

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        """The LlamaConfig of the draft layer's transformers building blocks."""
        config = LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
        )
        config._attn_implementation = attn_implementation
        return config

    def to_dict(self) -> dict[str, Any]:
        """config.json in the engines' layout (plus headstart's base record)."""
        rope = dict(self.rope_parameters)
        d = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLMEagle3"]
            if self.version == 3
            else ["LlamaForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": rope.get("rope_theta", 10000.0),
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        # An EAGLE-1 fc bias is not named: vLLM's and SGLang's Llama layers read a "bias" key
        # as an attention bias (and would build q/k/v/o biases the file lacks); the loader
        # takes it from the tensors.
        if self.version == 3:
            d["draft_vocab_size"] = self.draft_vocab_size
            d["target_hidden_size"] = self.target_hidden_size
            d.update(engine_aux_ids(self.aux_layer_ids))
        for key in (
            "base_model_name_or_path",
            "base_hidden_size",
            "base_vocab_size",
            "base_hidden_layers",
        ):
            d[key] = getattr(self, key)
        d.update(self.training_keys())
        d["headstart_format"] = HEADSTART_FORMAT  # what is written now, whatever was read
        return d

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], base_num_hidden_layers: int | None = None
    ) -> EagleConfig:
        """From an engine config.json; `base_num_hidden_layers` supplies the default aux layers
        of third-party EAGLE-3 folders that name neither them nor their base."""
        data = renamed_keys(data)
        for key in ("head_dim", "draft_vocab_size", "target_hidden_size"):
            if key in data and data[key] is None:  # null, as some trainers write: filled below
                del data[key]
        cls.check_types(data)  # before anything below computes with them
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in data]
        if missing:
            raise ValueError(
                f"config.json lacks {', '.join(missing)}: not an EAGLE draft's config (is this a "
                "heads folder written by another tool, or edited by hand?)"
            )
        is_v3 = any("Eagle3" in a for a in data.get("architectures") or [])
        data["version"] = 3 if is_v3 else 1
        # variants some trainers write (and some engines build) that this layer does not compute
        variants = [k for k in ("norm_before_residual", "norm_before_fc") if data.get(k)]
        if variants:
            raise ValueError(
                f"this EAGLE draft sets {', '.join(variants)}: a variant headstart does not "
                "build; loaded as the plain layer it would draft wrongly"
            )
        if "rope_parameters" not in data:
            rope = dict(data.get("rope_scaling") or {"rope_type": "default"})
            theta = data.get("rope_theta")
            if theta is not None and (
                not isinstance(theta, (int, float)) or isinstance(theta, bool)
            ):
                raise ValueError(f"config.json: rope_theta is {theta!r}, expected a number")
            rope.setdefault("rope_theta", 10000.0 if theta is None else theta)
            data["rope_parameters"] = rope
        if "head_dim" not in data:
            data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        # EAGLE's own EAGLE-1 configs (transformers 4.28's) have no grouped heads: as transformers
        # and the engines read them, one key / value head per query head
        data.setdefault("num_key_value_heads", data["num_attention_heads"])
        layers = data.get("base_hidden_layers") or base_num_hidden_layers
        if is_v3:
            data["aux_layer_ids"] = read_aux_ids(data)
            data.setdefault("target_hidden_size", data["hidden_size"])
            # no reduced vocabulary named: the engines draft over the whole one
            if data.get("draft_vocab_size") is None:
                data["draft_vocab_size"] = data["vocab_size"]
            if data["aux_layer_ids"] is None:
                if not layers:
                    raise ValueError(
                        "this EAGLE-3 config names neither eagle_config.eagle_aux_hidden_state_layer_ids "
                        "nor its base's layer count: load it with base=... to use the default layers"
                    )
                data["aux_layer_ids"] = list(default_aux_layer_ids(layers))
            elif data.get("headstart_format") == 1 and layers:
                lowered = [i - 1 for i in default_aux_layer_ids(layers)]
                if data["aux_layer_ids"] == lowered:
                    warnings.warn(
                        f"aux layer ids {lowered}: the default layers minus one, as a `--to "
                        "sglang` export of headstart format 1 wrote them; if this folder is one, "
                        "load the folder it was exported from (it drafts one layer off)",
                        stacklevel=2,
                    )
        else:  # unused by EAGLE-1, set as from_base sets them
            data["draft_vocab_size"] = data["vocab_size"]
            data["target_hidden_size"] = data["hidden_size"]
            data.pop("aux_layer_ids", None)
            if layers:
                data["aux_layer_ids"] = list(default_aux_layer_ids(layers))
            data["fc_bias"] = bool(data.pop("bias", False))
        return super().from_dict(data)


def norm_eps(base_config) -> float:
    """The epsilon of the base's norms, whatever its config calls it: the draft's RMSNorms take it
    (LayerNorm families such as Cohere and StableLM name it layer_norm_eps, StarCoder2
    norm_epsilon)."""
    for key in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps"):
        eps = getattr(base_config, key, None)
        if eps is not None:
            return float(eps)
    return EagleConfig.rms_norm_eps


def draft_rope_parameters(base_config) -> dict:
    """The rope of the draft's Llama layer: the base's, or where a Llama layer cannot compute
    it as given, the nearest it can. Of rope parameters per layer type (Gemma 3), those of full
    attention. A Llama layer rotates the whole head: with a partial rotary factor (Phi-4-mini)
    the draft rotates every dimension at the base's theta (transformers' Llama layer would
    break on longrope's per-dimension factors, and an engine reading the factor would compute
    another draft than the one trained)."""
    rope = dict(getattr(base_config, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    partial = rope.pop("partial_rotary_factor", None)
    partial = partial or getattr(base_config, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        return {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    return rope
