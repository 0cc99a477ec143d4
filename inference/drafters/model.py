"""A small draft model sharing the base's tokenizer (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling").

A chain (`num_tokens`): greedy (point masses) at temperature 0, otherwise sampled from the draft's
own warped distribution q (the verifier then applies min(1, p/q)). A static tree (`choices`,
Medusa-style paths of ranks, or a preset name; SpecInfer, Miao et al. 2024, drafts token trees
from small models): node `c` holds the rank-`c[-1]` token of the draft's distribution at its
parent, a point mass at any temperature; one forward of the draft model per level, over that
level's nodes that have children, with a tree mask. Its KV cache follows the accepted sequence:
entries past the longest prefix it shares with the sequence are cropped, the missing tokens are
fed, then the draft is made (a tree's entries are cropped again after it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from heads.base import input_device
from inference.acceptance import warp_probs
from inference.base_checks import windowed_cache_layers
from inference.draft import Draft, Drafter, Sampling
from inference.mask import frontier_attention_mask, grouped_kv_attention
from inference.tree import (
    DEFAULT_ACCURACIES,
    StaticTree,
    build_static_tree,
    check_ranks,
    tree_from_parents,
)


class ModelDrafter(Drafter):
    """Chain or static-tree drafter from a small causal LM with the base's vocabulary.

    Args:
        model: the draft model.
        num_tokens: drafted tokens of a chain (the default: 4).
        choices: a static tree instead (paths of ranks such as `[(0,), (1,), (0, 0)]`, or a
            preset name of `inference.tree.PRESETS`); give one of num_tokens and choices.
        vocab_size: the base's vocabulary size, where the draft model's embedding is padded to
            fewer rows of the same tokenizer (Qwen2.5 0.5B-3B: 151,936; 7B-72B: 152,064): its
            logits are padded to it with -inf. None: the draft model's own (make_drafter, and so
            `SpeculativeGenerator(base, small_lm)`, gives the base's).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        num_tokens: int | None = None,
        choices: str | Sequence[Sequence[int]] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if windowed := windowed_cache_layers(model.config):
            raise ValueError(
                f"the draft model has {', '.join(windowed)} cache layers (sliding-window "
                "attention narrower than its context): its cache is cropped back to the "
                "accepted tokens each step, which needs full attention in every layer; draft "
                "with a model without a sliding window"
            )
        own = model.config.vocab_size
        if vocab_size is not None and vocab_size < own:
            raise ValueError(
                f"the draft model's vocabulary ({own} tokens) is larger than the base's "
                f"(vocab_size={vocab_size}): it could propose tokens the base does not have; a "
                "draft model must share the base's tokenizer"
            )
        self.model = model
        self.vocab_size = own if vocab_size is None else vocab_size
        # Positions past its context would index past a table of position embeddings (GPT-2's);
        # a rotary one computes any position (drafting worse there, but still drafting).
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None) is not None
        self.max_positions = None if rotary else model.config.max_position_embeddings
        if num_tokens is None and choices is None:
            num_tokens = 4
        self.configure(num_tokens, choices)
        self.reset()

    def configure(
        self, num_tokens: int | None = None, choices: str | Sequence[Sequence[int]] | None = None
    ) -> None:
        """A chain of `num_tokens` or a static tree (`choices`), not both."""
        if (num_tokens is None) == (choices is None):
            raise ValueError(
                "give a draft model either num_tokens (a chain) or choices (a static tree); got "
                f"num_tokens={num_tokens}, choices={choices!r}"
            )
        self.static: StaticTree | None = None
        if choices is not None:
            if not self._takes_tree_masks():
                raise ValueError(
                    "a draft model's tree needs sdpa or eager attention (4D tree masks); this "
                    f"one runs {self.model.config._attn_implementation!r}: load it with "
                    "attn_implementation='sdpa', or draft a chain (num_tokens)"
                )
            device = input_device(self.model)
            self.static = StaticTree.build(choices, device=device)
            check_ranks(self.static.tree, self.model.config.vocab_size, "the draft model")
            self.num_tokens, self.max_nodes = None, self.static.tree.num_nodes
            return
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.num_tokens, self.max_nodes = num_tokens, 1 + num_tokens

    def _takes_tree_masks(self) -> bool:
        return self.model.config._attn_implementation in ("sdpa", "eager")

    def default_arms(self, device: torch.device) -> list[dict | None]:
        arms: list[dict | None] = [None, {"num_tokens": 2}, {"num_tokens": 4}, {"num_tokens": 6}]
        if device.type != "cpu" and self._takes_tree_masks():
            # A 16-node tree costs the draft as many forwards as the 4-chain (one per level, a
            # level's width nearly free on a GPU) and the base one forward of 16 tokens.
            arms.append({"choices": build_static_tree(DEFAULT_ACCURACIES, 16)})
        return arms

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._fed: list[int] = []  # tokens whose keys/values are in self.cache

    def _feed(self, tokens: list[int], device) -> torch.Tensor:
        rows, read = self.model.config.vocab_size, tokens
        if self.vocab_size > rows:
            # A base token past a padded draft's rows (padding, which a trained base does not
            # write) has no embedding there: the draft reads token 0, which only drafts worse.
            read = [t if t < rows else 0 for t in tokens]
        ids = torch.tensor([read], device=device)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self._fed.extend(tokens)  # as the sequence holds them: the cache follows it
        return self._padded(out.logits[0, -1].float())

    def _padded(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V_draft) -> (..., V_base): the base's tokens past the draft's rows get -inf."""
        missing = self.vocab_size - logits.shape[-1]
        if missing == 0:
            return logits
        pad = logits.new_full((*logits.shape[:-1], missing), -math.inf)
        return torch.cat([logits, pad], dim=-1)

    def _sync(self, seq: list[int]) -> int:
        """Crop the cache to its common prefix with `seq`, short of the root (whose logits
        `propose` needs from a forward); returns the prefix length."""
        common = 0
        for a, b in zip(self._fed, seq):
            if a != b:
                break
            common += 1
        common = min(common, len(seq) - 1)
        if common < len(self._fed):
            self.cache.crop(common - len(self._fed))
            del self._fed[common:]
        return common

    @torch.no_grad()
    def catch_up(self, sequence: torch.Tensor) -> None:
        seq = sequence.tolist()
        common = self._sync(seq)
        if common < len(seq) - 1:
            self._feed(seq[common:-1], sequence.device)

    @torch.no_grad()
    def propose(self, sequence: torch.Tensor, sampling: Sampling) -> Draft:
        seq = sequence.tolist()
        common = self._sync(seq)
        logits = self._feed(seq[common:], sequence.device)
        if self.static is not None:
            return self._propose_static(sequence[-1:], logits)
        chain, rows = [], []
        for i in range(self.num_tokens):
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q = warp_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
                rows.append(q)
                token = int(torch.multinomial(q, 1, generator=sampling.generator))
            chain.append(token)
            if i + 1 < self.num_tokens:
                logits = self._feed([token], sequence.device)
        n = 1 + len(chain)
        tokens = torch.tensor([seq[-1], *chain], device=sequence.device)
        tree = tree_from_parents([-1, *range(n - 1)], device=sequence.device)
        if sampling.greedy:
            return Draft(tree, tokens, torch.zeros(n, dtype=torch.bool, device=sequence.device))
        # Row i of draft_probs is q after node i: the distribution node i+1 was drawn from.
        probs = torch.stack(rows + [torch.zeros_like(rows[0])])
        sampled = torch.ones(n, dtype=torch.bool, device=sequence.device)
        sampled[0] = False
        return Draft(tree, tokens, sampled, probs)

    def _propose_static(self, root: torch.Tensor, root_logits: torch.Tensor) -> Draft:
        """Fill the static tree level by level from the draft's ranked tokens at each parent
        (the root's from `root_logits`); the tree's cache entries are cropped afterwards."""
        tree, top, dev = self.static.tree, self.static.top, root.device
        tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=dev)
        tokens[0] = root[0]
        # ranked[i, r]: the draft's rank-r token after node i (filled for nodes with children)
        ranked = torch.empty(tree.num_nodes, top, dtype=torch.long, device=dev)
        ranked[0] = root_logits.topk(top).indices
        prefix = len(self._fed)  # the accepted sequence, root included
        dtype = self.model.get_input_embeddings().weight.dtype
        cached = torch.empty(0, dtype=torch.long, device=dev)  # tree nodes in the draft cache
        for depth, (level, frontier) in enumerate(self.static.levels, start=1):
            tokens[level] = ranked[tree.parents[level], tree.ranks[level]]
            if frontier.numel() == 0:
                continue
            # Each frontier node attends to the sequence, its cached ancestors and itself; the
            # columns follow the cache: the sequence, the tree nodes cached, this frontier.
            columns = torch.cat([cached, frontier])
            mask = frontier_attention_mask(tree.ancestors[frontier][:, columns], prefix, dtype)
            with grouped_kv_attention(dev):
                logits = self.model(
                    input_ids=tokens[frontier][None],
                    attention_mask=mask,
                    position_ids=torch.full((1, frontier.numel()), prefix - 1 + depth, device=dev),
                    cache=self.cache,
                    use_cache=True,
                ).logits[0]  # (F, V)
            ranked[frontier] = logits.topk(top, dim=-1).indices
            cached = columns
        if cached.numel():
            self.cache.crop(-cached.numel())
        return Draft(tree, tokens, torch.zeros(tree.num_nodes, dtype=torch.bool, device=dev))
