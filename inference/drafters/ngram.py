"""n-gram prompt lookup: propose the continuation of the latest earlier occurrence of the
sequence's last n tokens (Saxena 2023, "Prompt Lookup Decoding"; HF `prompt_lookup_num_tokens`).
No model, no training; strong on copy-heavy tasks (summarisation, code edits, RAG)."""

from __future__ import annotations

import torch

from inference.draft import Draft, Drafter, Sampling


class NgramDrafter(Drafter):
    """Chain drafter from prompt lookup; every node is a point mass."""

    def __init__(self, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError("need 1 <= min_ngram <= max_ngram and num_tokens >= 1")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_nodes = 1 + num_tokens

    def configure(self, num_tokens: int) -> None:
        self.num_tokens, self.max_nodes = num_tokens, 1 + num_tokens

    def default_arms(self, device: torch.device) -> list[dict | None]:
        return [None, {"num_tokens": 3}, {"num_tokens": 6 if device.type == "cpu" else 10}]

    def propose(self, sequence: torch.Tensor, sampling: Sampling) -> Draft:
        return Draft.chain(int(sequence[-1]), self.lookup(sequence), sequence.device)

    def lookup(self, sequence: torch.Tensor) -> list[int]:
        """The up-to-`num_tokens` tokens that followed the latest earlier match of the longest
        matching suffix n-gram (n from max_ngram down to min_ngram); [] when none matches."""
        seq = sequence.tolist()
        T = len(seq)
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            suffix = seq[T - n :]
            for start in range(T - n - 1, -1, -1):  # latest occurrence first
                if seq[start : start + n] == suffix:
                    follow = seq[start + n : start + n + self.num_tokens]
                    if follow:
                        return follow
        return []
