"""Adaptive speculation: pick the tree size (or plain decoding) that gives the most tokens per
second on this machine, from the generator's own measurements.

Speculation pays only when tau * cost(1 token) > cost(tree forward + drafting). Both sides depend
on the hardware (a CPU's forward cost grows with the tree, a GPU's hardly does) and on how good
the drafter is on this text, so the generator measures them as it goes (EAGLE-2's
`total_token=-1` idea, applied to every drafter): each "arm" is a drafter setting, or plain
decoding; its rate is its tokens gained per step over its seconds per step, each the mean of its
first steps and then an exponential moving average. After trying every arm, the best arm is
used, and each other arm is re-tried when its exploration interval has passed, since acceptance
changes with the text. A re-try runs `explore_steps` steps in a row: the tokens a step gains vary
a lot (a weak drafter gains nothing on most steps and several tokens on some), and a one-step
re-try judged a good arm by one unlucky step. An arm re-tried and found clearly slower than the
best (under `backoff_below` of its rate) waits twice as long before its next try (up to
`max_explore_every` steps), so a drafter that does not pay here costs almost nothing; an arm
found close to the best (a lookup that found nothing this time costs what a plain step does, and
pays in bursts) keeps the base interval. Every arm is lossless, so choosing among them never
changes the output distribution (greedy output stays identical to the base's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class Arm:
    """A drafter setting (`options` passed to `drafter.configure`), or plain decoding (None)."""

    options: dict | None
    tokens: float = 0.0  # mean, then EMA, of tokens gained per step
    seconds: float = 0.0  # mean, then EMA, of seconds per step
    tries: int = 0
    last_step: int = -1
    interval: int = 0  # steps from its last try to its next exploratory one

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class AdaptivePolicy:
    """Per-step choice among arms by measured tokens/s.

    Args:
        arms: drafter settings to choose among; None is plain decoding (one token per step).
        warmup: steps each arm is tried before the policy starts exploiting.
        explore_every: after warmup, an arm that is not the best is re-tried this many steps
            after its last try; each re-try that leaves it behind doubles its wait.
        explore_steps: consecutive steps of each re-try (judged at its end; a re-try left
            unfinished when a generation ends goes on in the next one).
        max_explore_every: the longest wait between re-tries of an arm.
        backoff_below: a re-tried arm whose rate is under this fraction of the best arm's
            waits twice as long for its next try; otherwise it waits `explore_every`.
        smoothing: EMA weight of the newest measurement (after the first 1/smoothing steps of
            an arm, which are averaged).
    """

    arms: list[Arm]
    warmup: int = 4
    explore_every: int = 32
    explore_steps: int = 4
    max_explore_every: int = 512
    backoff_below: float = 0.9
    smoothing: float = 0.05
    step: int = field(default=0, init=False)
    # The arm of the re-try in progress and its steps left.
    _retry: int | None = field(default=None, init=False, repr=False)
    _retry_steps_left: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.explore_steps < 1:
            raise ValueError("need warmup >= 1 and explore_steps >= 1 (steps per arm per try)")
        for arm in self.arms:
            arm.interval = arm.interval or self.explore_every

    @classmethod
    def from_options(cls, options: list[dict | None], **kwargs) -> AdaptivePolicy:
        # Copies: a caller's dict changed in place later is a new arm, not this one.
        return cls([Arm(copy.deepcopy(o)) for o in options], **kwargs)

    def best(self) -> int:
        """Index of the arm with the highest measured rate."""
        return max(range(len(self.arms)), key=lambda i: self.arms[i].rate)

    def choose(self) -> int:
        """Index of the arm to use for the next step."""
        if self._retry is not None:
            return self._retry
        for i, arm in enumerate(self.arms):
            if arm.tries < self.warmup:
                return i
        best = self.best()
        due = [
            i
            for i, arm in enumerate(self.arms)
            if i != best and self.step - arm.last_step >= arm.interval
        ]
        if due:  # the longest overdue first
            self._retry = min(due, key=lambda i: self.arms[i].last_step + self.arms[i].interval)
            self._retry_steps_left = self.explore_steps
            return self._retry
        return best

    def update(self, index: int, tokens: int, seconds: float) -> None:
        arm = self.arms[index]
        arm.tries += 1
        a = max(self.smoothing, 1.0 / arm.tries)
        arm.tokens += a * (tokens - arm.tokens)
        arm.seconds += a * (seconds - arm.seconds)
        arm.last_step = self.step
        self.step += 1
        retried = index == self._retry
        if retried:
            self._retry_steps_left -= 1
            if self._retry_steps_left > 0:
                return  # judged when its re-try ends
            self._retry = None
        if arm.rate >= self.backoff_below * self.arms[self.best()].rate:
            arm.interval = self.explore_every
        elif retried:
            arm.interval = min(2 * arm.interval, self.max_explore_every)

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
