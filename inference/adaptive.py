"""Adaptive speculation: pick the tree size (or plain decoding) that gives the most tokens per
second on this machine, from the generator's own measurements.

Speculation pays only when tau * cost(1 token) > cost(tree forward + drafting). Both sides depend
on the hardware (a CPU's forward cost grows with the tree, a GPU's hardly does) and on how good
the drafter is on this text, so the generator measures them as it goes (EAGLE-2's
`total_token=-1` idea, applied to every drafter): each "arm" is a drafter setting, or plain
decoding; its rate is an exponential moving average of tokens gained over seconds spent per step.
After trying every arm, the best arm is used, and the others are re-tried now and then, since
acceptance changes with the text. Every arm is lossless, so choosing among them never changes
the output distribution (greedy output stays identical to the base's).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Arm:
    """A drafter setting (`options` passed to `drafter.configure`), or plain decoding (None)."""

    options: dict | None
    tokens: float = 0.0  # EMA of tokens gained per step
    seconds: float = 0.0  # EMA of seconds per step
    tries: int = 0
    last_step: int = -1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class AdaptivePolicy:
    """Per-step choice among arms by measured tokens/s.

    Args:
        arms: drafter settings to choose among; None is plain decoding (one token per step).
        warmup: steps each arm is tried before the policy starts exploiting.
        explore_every: after warmup, every this many steps the least recently used arm is tried.
        smoothing: EMA weight of the newest measurement.
    """

    arms: list[Arm]
    warmup: int = 1
    explore_every: int = 32
    smoothing: float = 0.2
    step: int = field(default=0, init=False)

    @classmethod
    def from_options(cls, options: list[dict | None], **kwargs) -> AdaptivePolicy:
        return cls([Arm(o) for o in options], **kwargs)

    def choose(self) -> int:
        """Index of the arm to use for the next step."""
        for i, arm in enumerate(self.arms):
            if arm.tries < self.warmup:
                return i
        if self.step % self.explore_every == self.explore_every - 1:
            return min(range(len(self.arms)), key=lambda i: self.arms[i].last_step)
        return max(range(len(self.arms)), key=lambda i: self.arms[i].rate)

    def update(self, index: int, tokens: int, seconds: float) -> None:
        arm = self.arms[index]
        a = 1.0 if arm.tries == 0 else self.smoothing
        arm.tokens += a * (tokens - arm.tokens)
        arm.seconds += a * (seconds - arm.seconds)
        arm.tries += 1
        arm.last_step = self.step
        self.step += 1

    def summary(self) -> list[dict]:
        return [
            {
                "options": a.options,
                "tokens_per_step": a.tokens,
                "seconds_per_step": a.seconds,
                "tokens_per_s": a.rate,
                "steps": a.tries,
            }
            for a in self.arms
        ]
