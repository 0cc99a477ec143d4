"""EAGLE draft layers: one decoder layer that autoregresses on the base's features.

- EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", arXiv:2401.15077): input at position t is fc([embed(x_{t+1}), f_t]) (2H -> H),
  one Llama decoder layer without input_layernorm predicts the feature f_{t+1}; the base's
  embeddings and lm_head are shared. Saved as a plain 1-layer Llama (`fc.weight`, `layers.0.*`).
- EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
  via Training-Time Test", arXiv:2503.01840): the first input fuses three base layers,
  fc([a_low, a_mid, a_high]) (3H -> H); the "midlayer" attends over
  [input_layernorm(embed(x)), hidden_norm(h)] (2H); its own final norm and lm_head cover a
  reduced draft vocabulary, mapped back with `d2t` (target = draft + d2t[draft]). Saved in the
  `LlamaForCausalLMEagle3` layout that vLLM and SGLang load.

Both are built from transformers' own Llama blocks (attention, MLP, RMSNorm, rotary embedding),
so the base's head_dim, GQA, rope_theta / rope_scaling and max positions carry over.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from heads.base import base_signature, default_aux_layer_ids
from heads.checkpoint import PretrainedHeads
from heads.config import HEADSTART_FORMAT, HeadsConfig, renamed_keys


def engine_aux_ids(aux_layer_ids) -> dict[str, Any]:
    """The config.json keys of EAGLE-3 aux layer ids (headstart's meaning: the state entering
    layer i, transformers' hidden_states[i]) as each engine reads them: vLLM the top-level key in
    that meaning; SGLang (which captures before layer i + 1) and SpecForge `eagle_config`'s, as
    the output of layer i: i - 1 there (-1: the embeddings, which SGLang cannot capture)."""
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
        return [int(i) for i in top]
    nested = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not nested:
        return None
    written_in = data.get("headstart_format", HEADSTART_FORMAT)  # from_dict checks its type
    shift = 0 if isinstance(written_in, int) and written_in < 2 else 1
    return [int(i) + shift for i in nested]


def engine_refusal(config: EagleConfig, engine: str) -> str | None:
    """Why `engine` ("vllm" or "sglang") would not compute this draft as headstart does, or None
    when it would (the export refuses, the model card says so)."""
    if config.version == 1:
        if engine == "vllm" and config.fc_bias:
            return (
                "vLLM's EAGLE-1 fc has no bias and would drop this layer's (EAGLE's reference "
                "trains one): serve it with SGLang (--to sglang) or headstart"
            )
        return None
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
    if engine == "sglang" and min(ids) < 1:
        return (
            f"aux layer ids {ids}: SGLang does not capture the embeddings (id 0, the state "
            "entering layer 0): serve the draft with vLLM"
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
    # EAGLE-1's fc with a bias, as the EAGLE reference trains it (its config key "bias");
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
            rms_norm_eps=base_config.rms_norm_eps,
            rope_parameters=dict(base_config.rope_parameters),
            max_position_embeddings=base_config.max_position_embeddings,
            vocab_size=base_config.vocab_size,
            draft_vocab_size=(draft_vocab_size or min(32000, base_config.vocab_size))
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
        d["headstart_format"] = HEADSTART_FORMAT  # what is written now, whatever was read
        return d

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], base_num_hidden_layers: int | None = None
    ) -> EagleConfig:
        """From an engine config.json; `base_num_hidden_layers` supplies the default aux layers
        of third-party EAGLE-3 folders that name neither them nor their base."""
        data = renamed_keys(data)
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
            rope.setdefault("rope_theta", data.get("rope_theta", 10000.0))
            data["rope_parameters"] = rope
        if "head_dim" not in data or data["head_dim"] is None:
            data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if is_v3:
            data["aux_layer_ids"] = read_aux_ids(data)
            data.setdefault("target_hidden_size", data["hidden_size"])
            # no reduced vocabulary named: the engines draft over the whole one
            if data.get("draft_vocab_size") is None:
                data["draft_vocab_size"] = data["vocab_size"]
            layers = data.get("base_hidden_layers") or base_num_hidden_layers
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
        else:
            data["draft_vocab_size"] = data["vocab_size"]
            data.pop("aux_layer_ids", None)
            data["fc_bias"] = bool(data.pop("bias", False))
        return super().from_dict(data)


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [input_layernorm(embed), hidden_norm(h)] (2H), then MLP.

    Tensor names follow the engines: `input_layernorm`, `hidden_norm`, `self_attn.{q,k,v,o}_proj`,
    `post_attention_layernorm`, `mlp.{gate,up,down}_proj`.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        H = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        # q/k/v read the concatenated 2H input; transformers' attention only uses their outputs.
        attn = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * H, old.out_features, bias=old.bias is not None))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)

    def forward(
        self, inputs_embeds, hidden, position_embeddings, attention_mask, cache
    ) -> torch.Tensor:
        residual = hidden
        x = torch.cat(
            [self.input_layernorm(inputs_embeds), self.hidden_norm(hidden)], dim=-1
        )  # (B,T,2H)
        x, _ = self.self_attn(
            x, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache
        )
        x = residual + x
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleDraft(PretrainedHeads):
    """An EAGLE draft layer (version 1 or 3), step-wise with its own KV cache.

    Inputs at position t: the base's embedding of token x_{t+1} and a hidden state at t (the base's
    feature for EAGLE-1, the fused aux layers or the draft's own previous output for EAGLE-3).
    `forward` returns the draft's hidden state (B,T,H); `compute_logits` turns it into logits over
    the draft vocabulary (EAGLE-1: the base lm_head, pass it in; EAGLE-3: own norm + lm_head).
    """

    def __init__(self, config: EagleConfig, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        config.validate()
        self.config = config
        llama = config.llama_config(attn_implementation)
        self.llama_config = llama
        H = config.hidden_size
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        if config.version == 1:
            self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
            layer = LlamaDecoderLayer(llama, layer_idx=0)
            del layer.input_layernorm  # EAGLE-1 feeds the fused input to attention unnormalised
            layer.input_layernorm = nn.Identity()
            self.layers = nn.ModuleList([layer])
        else:
            self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=False)
            self.midlayer = Eagle3Layer(llama)
            self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            Vd = config.draft_vocab_size
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[:Vd] = True
            self.register_buffer("t2d", t2d)
        self._init_weights(llama.initializer_range)

    def _init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @torch.no_grad()
    def init_from_base(self, base: nn.Module, layer: int | None = None) -> list[str]:
        """EAGLE-3: start from the base's top layers instead of at random. The fc passes the
        highest fused state through; the midlayer is a copy of base decoder `layer` (default:
        the last, whose output the norm and lm_head read) reading it, the half of q/k/v that
        reads the token embedding (and its norm) staying as built; the final norm and lm_head
        are the base's (its rows of the draft vocabulary: call `set_vocab_map` first). EAGLE-1
        layers are left as built.

        Returns the names of the tensors left as built because the base has none of their
        shape (none for Llama-like bases)."""
        if self.config.version != 3:
            return []
        decoder = base.get_decoder()
        H = self.config.hidden_size
        source = decoder.layers[-1 if layer is None else layer]
        theirs = source.state_dict()
        theirs["hidden_norm.weight"] = theirs.pop("input_layernorm.weight", None)
        left = []
        for name, ours in self.midlayer.state_dict(keep_vars=True).items():
            if name.startswith("input_layernorm"):  # the token embedding's: stays as built
                continue
            tensor = theirs.get(name)
            if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") and name.endswith("weight"):
                ours = ours[:, H:]  # the half that reads the fused state
            if tensor is None or tensor.shape != ours.shape:
                left.append(f"midlayer.{name}")
            else:
                ours.copy_(tensor)
        if self.config.target_hidden_size == H:
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * H :].copy_(torch.eye(H))
        else:
            left.append("fc.weight")
        norm = decoder.norm.state_dict().get("weight")
        if norm is not None and norm.shape == self.norm.weight.shape:
            self.norm.weight.copy_(norm)
        else:
            left.append("norm.weight")
        weight = base.get_output_embeddings().weight
        ids = self.to_base_ids(torch.arange(len(self.d2t), device=self.d2t.device))
        self.lm_head.weight.copy_(weight[ids.to(weight.device)])
        return left

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for step-wise drafting."""
        return DynamicCache(config=self.llama_config)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: (B,T,3H) concatenated aux layers, in any dtype -> (B,T,H) in the draft's."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """inputs_embeds (B,T,H), hidden (B,T,H), position_ids (B,T) -> draft hidden (B,T,H).

        `attention_mask` is a 4D additive float mask (B,1,T,past+T); None means causal. The
        inputs may come in the base's dtype: they are cast to the draft's (e.g. bf16 heads on an
        fp32 base).
        """
        dtype = self.fc.weight.dtype
        inputs_embeds, hidden = inputs_embeds.to(dtype), hidden.to(dtype)
        B, T, _ = inputs_embeds.shape
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = causal_mask(past, T, inputs_embeds.dtype, inputs_embeds.device).expand(
                B, 1, T, past + T
            )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        if self.config.version == 1:
            x = self.fc(torch.cat([inputs_embeds, hidden], dim=-1))  # (B,T,2H) -> (B,T,H)
            return self.layers[0](
                x,
                attention_mask=attention_mask,
                position_embeddings=position_embeddings,
                cache=cache,
            )
        return self.midlayer(inputs_embeds, hidden, position_embeddings, attention_mask, cache)

    def compute_logits(
        self, hidden: torch.Tensor, base_lm_head: nn.Module | None = None
    ) -> torch.Tensor:
        """(B,T,H) -> (B,T,V_draft): EAGLE-1 through the base lm_head, EAGLE-3 its own."""
        if self.config.version == 1:
            if base_lm_head is None:
                raise ValueError("EAGLE-1 shares the base lm_head: pass base.lm_head")
            return base_lm_head(hidden.to(base_lm_head.weight.dtype))
        return self.lm_head(self.norm(hidden))

    def to_base_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices to base token ids (EAGLE-3: draft + d2t[draft])."""
        if self.config.version == 1:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def set_vocab_map(self, draft_to_base: torch.Tensor) -> None:
        """EAGLE-3: set d2t / t2d from the sorted base ids kept in the draft vocabulary."""
        ids = torch.as_tensor(draft_to_base, dtype=torch.long)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} base ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True
        check_vocab_map(self.d2t, self.t2d)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise unless d2t / t2d describe one strictly increasing set of base ids."""
    target = d2t + torch.arange(d2t.numel(), device=d2t.device)
    if d2t.numel() > 1 and not bool((target[1:] > target[:-1]).all()):
        raise ValueError(
            "inconsistent d2t: draft->target ids (draft + d2t[draft]) must be strictly increasing"
        )
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(
            f"inconsistent t2d: marks {int(t2d.sum())} tokens but the draft vocabulary has {d2t.numel()}"
        )
    if target.numel() and (
        int(target.min()) < 0 or int(target.max()) >= t2d.numel() or not bool(t2d[target].all())
    ):
        raise ValueError("inconsistent d2t / t2d: d2t maps to base ids that t2d does not mark")


def causal_mask(past: int, T: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask (1,1,T,past+T): each new token sees the past and itself/earlier."""
    q = torch.arange(T, device=device).unsqueeze(1) + past
    k = torch.arange(past + T, device=device).unsqueeze(0)
    return torch.zeros(T, past + T, dtype=dtype, device=device).masked_fill(
        k > q, torch.finfo(dtype).min
    )[None, None]
