"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv:2401.10774).

K heads read the base's last hidden state h_t. The base's own lm_head predicts token t+1; head k
(0-based) predicts token t+k+2. Each head is L residual blocks `x + SiLU(W x + b)` followed by an
lm_head. W starts at zero, so a fresh head's logits equal the base lm_head's exactly.

The module layout and config are vLLM's `MedusaModel` (tensors `blocks.{h}.layers.{l}.weight`,
`lm_heads.{h}.weight`), so a saved folder loads in vLLM as is. With `original_lm_head` the heads
share the base's frozen lm_head, saved once as `lm_head.weight` (what vLLM reads in that mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from heads.base import base_signature
from heads.checkpoint import PretrainedHeads
from heads.config import HEADSTART_FORMAT, HeadsConfig


@dataclass
class MedusaConfig(HeadsConfig):
    """Medusa heads' configuration, serialised as vLLM's `MedusaModel` config.json.

    Attributes:
        hidden_size: the base's hidden size H.
        vocab_size: the base's vocabulary V.
        num_heads: K, the number of heads (head k predicts token t+k+2).
        num_hidden_layers: L, residual blocks per head.
        medusa_fc_bias: whether the residual blocks' linears have a bias (Medusa's reference
            heads do).
        original_lm_head: share the base's frozen lm_head instead of one trainable lm_head
            per head (fewer parameters, ~K*V*H; vLLM `original_lm_head`).
        truncated_vocab_size: a reduced draft vocabulary (the most frequent tokens, `token_map`)
            or None for the full vocabulary.
        base_lora: Medusa-2: the subfolder holding the LoRA adapter trained into the base (the
            heads read the adapted base), "" for Medusa-1; `base_lora_probe` tells a base with
            it merged from one without (heads/lora.py).
    """

    hidden_size: int = 4096
    vocab_size: int = 32000
    num_heads: int = 4
    num_hidden_layers: int = 1
    medusa_fc_bias: bool = True
    original_lm_head: bool = False
    truncated_vocab_size: int | None = None
    base_lora: str = ""
    base_lora_probe: dict | None = None
    model_type: str = "medusa"
    architectures: list[str] = field(default_factory=lambda: ["MedusaModel"])

    @classmethod
    def from_base(
        cls, base_config, num_heads: int = 4, num_layers: int = 1, **kwargs
    ) -> MedusaConfig:
        """Size the heads for a base model's config (`model.config` or `AutoConfig`)."""
        return cls(
            hidden_size=base_config.hidden_size,
            vocab_size=base_config.vocab_size,
            num_heads=num_heads,
            num_hidden_layers=num_layers,
            headstart_format=HEADSTART_FORMAT,
            **base_signature(base_config),
            **kwargs,
        )

    @property
    def draft_vocab_size(self) -> int:
        return self.truncated_vocab_size or self.vocab_size

    def validate(self) -> None:
        super().validate()
        if self.num_heads < 1 or self.num_hidden_layers < 0:
            raise ValueError(
                f"num_heads must be >= 1 and num_hidden_layers >= 0, got {self.num_heads}, {self.num_hidden_layers}"
            )
        if (
            self.truncated_vocab_size is not None
            and not 0 < self.truncated_vocab_size <= self.vocab_size
        ):
            raise ValueError(
                f"truncated_vocab_size={self.truncated_vocab_size} must be in (0, vocab_size={self.vocab_size}]"
            )


class ResidualBlock(nn.Module):
    """L layers of `x <- x + SiLU(W x + b)`, W zero-initialised (so the block starts as identity)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)
        )
        self.act = nn.SiLU()
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if bias:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(PretrainedHeads):
    """K Medusa heads: `forward(hidden (B,T,H)) -> logits (K,B,T,V_draft)`.

    `V_draft` is `truncated_vocab_size` when set (then `token_map[j]` is the base token id of draft
    index j), else the base vocabulary. Call `init_from_base(base)` on fresh heads to copy (own
    heads) or tie (shared heads) the base lm_head; `load_heads` does it for loaded shared heads.
    """

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        H, Vd, K = config.hidden_size, config.draft_vocab_size, config.num_heads
        self.blocks = nn.ModuleList(
            ResidualBlock(H, config.num_hidden_layers, config.medusa_fc_bias) for _ in range(K)
        )
        if config.original_lm_head:
            self.lm_head = nn.Linear(H, Vd, bias=False)
            self.lm_head.requires_grad_(False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(H, Vd, bias=False) for _ in range(K))
        if config.truncated_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(Vd, dtype=torch.long))
        else:
            self.token_map = None

    @torch.no_grad()
    def init_from_base(self, base: nn.Module, token_map: torch.Tensor | None = None) -> MedusaHeads:
        """Start the lm_heads from the base's (copy for own heads, tie for a shared head).

        With a reduced draft vocabulary, `token_map` (V_draft,) gives the base ids to keep.
        """
        weight = base.get_output_embeddings().weight  # (V, H)
        if self.token_map is not None:
            if token_map is None or token_map.numel() != self.config.draft_vocab_size:
                raise ValueError(
                    f"a reduced draft vocabulary needs a token_map of {self.config.draft_vocab_size} ids"
                )
            check_token_map(token_map, self.config.vocab_size)
            self.token_map.copy_(token_map)
            weight = weight[token_map.to(weight.device)]
        if self.config.original_lm_head:
            self.lm_head.weight = (
                weight
                if self.token_map is None
                else nn.Parameter(weight.clone(), requires_grad=False)
            )
        else:
            for head in self.lm_heads:
                head.weight.copy_(weight)
        return self

    def head_lm(self, k: int) -> nn.Linear:
        return self.lm_head if self.config.original_lm_head else self.lm_heads[k]

    def head_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head k's logits (..., V_draft) of the base's hidden states (..., H), in whatever dtypes
        the base, the blocks and the lm_head are (heads loaded in bf16 on an fp32 base, a shared
        lm_head that stays the base's)."""
        lm_head = self.head_lm(k)
        own = next(self.blocks[k].parameters(), lm_head.weight)  # 0 layers: the lm_head's dtype
        x = self.blocks[k](hidden.to(own.dtype))
        # on the heads' device, where a dispatched base keeps a shared lm_head on another one
        return lm_head(x.to(lm_head.weight.dtype)).to(hidden.device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B,T,H) -> logits (K,B,T,V_draft)."""
        return torch.stack([self.head_logits(k, hidden) for k in range(len(self.blocks))])

    def to_base_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices to base token ids (identity for the full vocabulary)."""
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    def state_to_save(self) -> dict[str, torch.Tensor]:
        """The state dict, with a draft vocabulary as large as the base's in token order: vLLM
        reads `token_map` only for a smaller one, so over the whole vocabulary it takes lm_head
        row j for token j. Rows in another order (another trainer's heads) are sorted, which
        drafts the same tokens."""
        state = self.state_dict()
        if self.token_map is None or self.config.draft_vocab_size < self.config.vocab_size:
            return state
        check_token_map(self.token_map, self.config.vocab_size)  # changed in place since?
        order = torch.argsort(self.token_map)  # (V,): the draft index of token j
        for name in [n for n in state if n.startswith(("lm_head.", "lm_heads."))]:
            state[name] = state[name][order.to(state[name].device)]
        state["token_map"] = self.token_map[order]
        return state

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def check_token_map(token_map: torch.Tensor, vocab_size: int, where: str = "token_map") -> None:
    """A reduced vocabulary's map (V_draft,) names base ids, each once (one draft index per
    token: the engines and the drafters map back by it)."""
    ids = token_map.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{where} holds ids outside the base's vocabulary of {vocab_size}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{where} names a token more than once: give each kept token id once")


def engine_medusa_keys(raw: dict) -> dict:
    """A Medusa config.json with the reference repos' `medusa_num_heads` / `medusa_num_layers`
    under the names vLLM reads them as (`num_heads` / `num_hidden_layers`)."""
    data = dict(raw)
    for ours, theirs in (
        ("num_heads", "medusa_num_heads"),
        ("num_hidden_layers", "medusa_num_layers"),
    ):
        if theirs not in data:
            continue
        value = data.pop(theirs)
        if ours in data and data[ours] != value:
            raise ValueError(
                f"config.json: {ours}={data[ours]!r} but {theirs}={value!r}; keep the one the "
                "tensors hold"
            )
        data[ours] = value
    return data


def read_vllm_medusa(
    raw: dict, config: MedusaConfig | None, tensors: dict[str, torch.Tensor], where: str
):
    """(config, tensors) of Medusa heads in vLLM's tensor names, read as vLLM reads them: a
    `medusa_heads.` prefix dropped; a config that names only the reference's keys sized by the
    tensors; lm_heads over the whole vocabulary cut to a `token_map`'s rows. Where the config
    leaves `medusa_fc_bias` out, the tensors say (vLLM would build no bias and drop the file's;
    headstart's exports always name it)."""
    tensors = {name.removeprefix("medusa_heads."): t for name, t in tensors.items()}
    if config is None:
        head = tensors.get("lm_heads.0.weight", tensors.get("lm_head.weight"))
        if head is None or head.dim() != 2:
            raise ValueError(
                f"{where} names medusa_num_heads, but the weights are in neither "
                "Medusa layout: the reference's `{h}.{l}.linear.weight` / `{h}.{L}.weight` or "
                "vLLM's `blocks.{h}.layers.{l}.weight` / `lm_heads.{h}.weight`"
            )
        V, H = int(head.shape[0]), int(head.shape[1])  # V: the draft vocabulary's rows
        if raw.get("truncated_vocab_size"):
            V = int(raw.get("vocab_size") or 0)  # the base's, when the config names it
        sizes = {"vocab_size": V, "hidden_size": H, "base_vocab_size": V, "base_hidden_size": H}
        config = MedusaConfig.from_dict({**sizes, **engine_medusa_keys(raw)})
        config.validate()
    if "medusa_fc_bias" not in raw and config.num_hidden_layers > 0:
        config.medusa_fc_bias = "blocks.0.layers.0.bias" in tensors
    token_map = tensors.get("token_map")
    if config.truncated_vocab_size == config.vocab_size and token_map is None:
        config.truncated_vocab_size = None  # vLLM reads a token_map only below the vocabulary
    if config.truncated_vocab_size and token_map is not None:  # lm_heads over the whole vocabulary
        for name in [n for n in tensors if n.startswith("lm_head")]:
            if tensors[name].shape[0] > token_map.numel():
                tensors[name] = tensors[name][token_map.long()]  # vLLM keeps the mapped rows
    return config, tensors


def read_medusa_lm_head(raw: dict, tensors: dict[str, torch.Tensor], where: str):
    """(MedusaConfig, tensors in headstart's names) from the reference Medusa / TGI layout
    (config `medusa_num_heads`, `medusa_num_layers`; tensors `{h}.{l}.linear.weight/bias`,
    `{h}.{L}.weight`), as FasterDecoding's and TGI's Medusa repos ship it, once in safetensors.
    Sizes come from the tensors; the base is the one the config names."""
    K, L = raw.get("medusa_num_heads"), raw.get("medusa_num_layers", 1)
    if not isinstance(K, int) or not isinstance(L, int) or K < 1 or L < 0:
        raise ValueError(
            f"{where}: medusa_num_heads={K!r}, medusa_num_layers={L!r}: need integers >= 1, >= 0"
        )
    head = tensors.get(f"0.{L}.weight")
    if head is None or head.dim() != 2:
        raise ValueError(
            f"{where}: no tensor 0.{L}.weight (head 0's lm_head after {L} residual layers): "
            "not the Medusa lm_head layout its config.json says"
        )
    vocab, hidden = head.shape
    renamed = {}
    for name, tensor in tensors.items():
        h, rest = name.split(".", 1) if "." in name else (name, "")
        layer, _, kind = rest.partition(".")
        if kind.startswith("linear.") and h.isdigit() and layer.isdigit():
            renamed[f"blocks.{h}.layers.{layer}.{kind.removeprefix('linear.')}"] = tensor
        elif rest == f"{L}.weight" and h.isdigit():
            renamed[f"lm_heads.{h}.weight"] = tensor
        else:
            renamed[name] = tensor  # named as unexpected by the load
    config = MedusaConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=K,
        num_hidden_layers=L,
        medusa_fc_bias=L == 0 or "0.0.linear.bias" in tensors,
        base_model_name_or_path=str(raw.get("base_model_name_or_path") or ""),
        base_hidden_size=hidden,
        base_vocab_size=vocab,
    )
    return config, renamed
