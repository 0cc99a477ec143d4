"""What `SpeculativeGenerator.generate` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationOutput:
    """Result of `SpeculativeGenerator.generate` (batch size 1)."""

    sequences: torch.Tensor  # (1, prompt + new) long
    accepted_lengths: list[int]  # tokens gained per verify step, bonus token included
    # seconds: base, draft, other, total; prefill_base and prefill_draft, the parts of base and
    # draft spent on the prompt (the prefill forward, the drafter's first pass over the prompt)
    timings: dict[str, float] = field(default_factory=dict)
    finished: bool = False  # an EOS token or a stop string ended the generation
    # nodes each verify step verified, root included: 1 for a plain step (the adaptive policy's,
    # a drafter's with nothing to propose, a tree past the context)
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """tau, Spec-Bench's "mean accepted tokens" (plain decoding = 1.0; so is a generation
        without a verify step: max_new_tokens=1, or an end of turn as the first token)."""
        if not self.accepted_lengths:
            return 1.0
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def num_steps(self) -> int:
        return len(self.accepted_lengths)
