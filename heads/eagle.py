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

from heads.checkpoint import PretrainedHeads
from heads.eagle_config import EagleConfig


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
        are the base's (its rows of the draft vocabulary: call `set_vocab_map` first). A norm
        that scales by 1 + w (Gemma's) is copied as 1 + w; Gemma's MLP input norm is its
        `pre_feedforward_layernorm`. EAGLE-1 layers are left as built.

        Returns notes on what does not carry over (none for Llama-like bases): the draft's
        tensors left as built (the base has none of their shape, or a norm computed otherwise)
        and the base layer's tensors the draft has no place for (Qwen2's q/k/v biases, Qwen3's
        q/k norms, Gemma's post-norms)."""
        if self.config.version != 3:
            return []
        decoder = base.get_decoder()
        H = self.config.hidden_size
        source = decoder.layers[-1 if layer is None else layer]
        theirs = source.state_dict()
        modules = dict(source.named_modules())
        mlp_norm = (
            "pre_feedforward_layernorm"
            if "pre_feedforward_layernorm" in modules
            else "post_attention_layernorm"
        )
        renamed = {"hidden_norm": "input_layernorm", "post_attention_layernorm": mlp_norm}
        left, taken = [], set()
        for name, ours in self.midlayer.state_dict(keep_vars=True).items():
            if name.startswith("input_layernorm"):  # the token embedding's: stays as built
                continue
            module, _, leaf = name.rpartition(".")
            their_name = f"{renamed.get(module, module)}.{leaf}"
            tensor = theirs.get(their_name)
            if module in renamed and tensor is not None:
                tensor = _as_llama_norm(modules[renamed[module]], tensor)
            if module.split(".")[-1] in ("q_proj", "k_proj", "v_proj") and leaf == "weight":
                ours = ours[:, H:]  # the half that reads the fused state
            if tensor is None or tensor.shape != ours.shape:
                left.append(f"midlayer.{name}")
            else:
                ours.copy_(tensor)
                taken.add(their_name)
        if self.config.target_hidden_size == H:
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * H :].copy_(torch.eye(H))
        else:
            left.append("fc.weight")
        norm = decoder.norm.state_dict().get("weight")
        norm = None if norm is None else _as_llama_norm(decoder.norm, norm)
        if norm is not None and norm.shape == self.norm.weight.shape:
            self.norm.weight.copy_(norm)
        else:
            left.append("norm.weight")
        weight = base.get_output_embeddings().weight
        ids = self.to_base_ids(torch.arange(len(self.d2t), device=self.d2t.device))
        self.lm_head.weight.copy_(weight[ids.to(weight.device)])
        kept = ", ".join(left)
        notes = [f"{kept}: none in the base of that shape and kind, left as built"] if left else []
        dropped = [n for n in theirs if n not in taken and n != "input_layernorm.weight"]
        if dropped:
            notes.append(f"the base layer's {', '.join(dropped)}: not in a Llama layer, left out")
        # Granite's layers scale their residual branches and attention scores by config values
        scaled = [
            f"{key} {value}"
            for key in ("residual_multiplier", "attention_multiplier")
            if (value := getattr(base.config, key, None)) is not None
            and value != (self.config.head_dim**-0.5 if key == "attention_multiplier" else 1.0)
        ]
        if scaled:
            notes.append(f"the base layer's {', '.join(scaled)}: not in a Llama layer, left out")
        act = getattr(base.config, "hidden_act", None) or getattr(
            base.config, "hidden_activation", "silu"
        )  # Gemma's name
        if act != self.config.hidden_act and any(n.startswith("mlp.") for n in taken):
            notes.append(
                f"the MLP: copied from the base's, under {self.config.hidden_act} instead of its "
                f"{act} (the engines' Llama draft layer has silu only)"
            )
        return notes

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
            # on the draft's device, where a dispatched base keeps its lm_head on another one
            return base_lm_head(hidden.to(base_lm_head.weight.dtype)).to(hidden.device)
        return self.lm_head(self.norm(hidden))

    def to_base_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices to base token ids (EAGLE-3: draft + d2t[draft])."""
        if self.config.version == 1:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def set_vocab_map(self, draft_to_base: torch.Tensor) -> None:
        """EAGLE-3: set d2t / t2d from the base ids kept in the draft vocabulary (draft index i is
        base id draft_to_base[i]; headstart passes them sorted)."""
        ids = torch.as_tensor(draft_to_base, dtype=torch.long, device="cpu")
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} base ids, got {ids.numel()}")
        # Checked before anything is set: a refused map leaves the draft's own.
        if ids.unique().numel() != ids.numel():
            raise ValueError("the draft vocabulary's base ids must be distinct: one is repeated")
        # on the CPU, as ids, also under torch.device("cuda") as the default device
        d2t = ids - torch.arange(ids.numel(), device="cpu")
        target_ids(d2t, self.t2d.numel())  # each id in the base vocabulary
        t2d = torch.zeros(self.t2d.shape, dtype=torch.bool, device="cpu")
        t2d[ids] = True
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise unless d2t maps the draft vocabulary one-to-one onto the base ids t2d marks (in any
    order: headstart writes them increasing, vLLM and SGLang read any one-to-one map)."""
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(
            f"inconsistent t2d: marks {int(t2d.sum())} tokens but the draft vocabulary has {d2t.numel()}"
        )
    target = target_ids(d2t, t2d.numel())
    if target.unique().numel() != target.numel() or not bool(t2d[target].all()):
        raise ValueError(
            "inconsistent d2t / t2d: d2t must map the draft tokens to distinct base ids, the ones "
            "t2d marks"
        )


def target_ids(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The base ids d2t maps the draft vocabulary to (draft + d2t[draft]), checked to lie in a
    base vocabulary of `vocab_size`."""
    target = d2t.long() + torch.arange(d2t.numel(), device=d2t.device)
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
        raise ValueError(
            f"inconsistent d2t: draft->target ids (draft + d2t[draft]) run from {int(target.min())} "
            f"to {int(target.max())}, outside the base vocabulary of {vocab_size}"
        )
    return target


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d (the base ids in the draft vocabulary) from d2t, for folders that leave it out: vLLM
    and SGLang never read it."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids(d2t, vocab_size)] = True
    return t2d


def causal_mask(past: int, T: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask (1,1,T,past+T): each new token sees the past and itself/earlier."""
    q = torch.arange(T, device=device).unsqueeze(1) + past
    k = torch.arange(past + T, device=device).unsqueeze(0)
    return torch.zeros(T, past + T, dtype=dtype, device=device).masked_fill(
        k > q, torch.finfo(dtype).min
    )[None, None]


def _as_llama_norm(module: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight that makes a Llama RMSNorm (x / rms(x) * w) compute what the base's norm
    `module` of weight `weight` computes: `weight` itself, 1 + `weight` (Gemma's norms), or
    None for another norm (a probe through the module tells them apart)."""
    if weight.dim() != 1 or weight.is_meta:
        return None
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
    probe = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, weight.numel(), generator=probe, device="cpu").to(weight.device)
    out = module(x.to(weight.dtype)).float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    for candidate in (weight, 1 + weight):
        if torch.allclose(out, normed * candidate.float(), rtol=2e-2, atol=1e-3):
            return candidate
    return None
