"""A small draft model sharing the base's tokenizer (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling").

It proposes a chain of `num_tokens` tokens: greedy (point masses) at temperature 0, otherwise
sampled from its own warped distribution q (the verifier then applies min(1, p/q)). Its KV cache
follows the accepted sequence: entries past the longest prefix it shares with the sequence are
cropped, the missing tokens are fed, then the chain is drafted.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.acceptance import warp_probs
from inference.draft import Draft, Drafter, Sampling
from inference.tree import tree_from_parents


class ModelDrafter(Drafter):
    """Chain drafter from a small causal LM with the base's vocabulary."""

    def __init__(self, model: PreTrainedModel, num_tokens: int = 4) -> None:
        if num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")
        self.model, self.num_tokens = model, num_tokens
        self.max_nodes = 1 + num_tokens
        self.reset()

    def configure(self, num_tokens: int) -> None:
        self.num_tokens, self.max_nodes = num_tokens, 1 + num_tokens

    def default_arms(self, device: torch.device) -> list[dict | None]:
        return [None, {"num_tokens": 2}, {"num_tokens": 4}, {"num_tokens": 6}]

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._fed: list[int] = []  # tokens whose keys/values are in self.cache
        self._last_logits: torch.Tensor | None = None

    def _feed(self, tokens: list[int], device) -> torch.Tensor:
        ids = torch.tensor([tokens], device=device)
        logits = self.model(input_ids=ids, cache=self.cache, use_cache=True).logits[0, -1]
        self._fed.extend(tokens)
        return logits.float()

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
