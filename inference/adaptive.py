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
pays in bursts) keeps the base interval, unless none of its drafts was ever accepted (`idle_after`
or more of them: steps on which it drafted something, so a lookup's dry steps do not count): a
drafter whose drafts are never accepted (fresh, untrained heads) cannot pay until they are, and
a tree about as cheap as a plain step (5 nodes on a CPU once grouped K/V heads are read as
cached) would otherwise be re-tried every `explore_every` steps for good, each re-try also
paying the drafter's catch-up over the plain steps' tokens. Every arm is lossless, so choosing
among them never changes the output distribution (greedy output stays identical to the base's).

Static trees under greedy decoding share their measurements. A static tree's node is a path of
ranks (`(0, 1)`: the drafter's top-1 token, then its top-2 after it), the same token in every
tree of that drafter that holds the path; under greedy verification it is accepted iff its
parent is and its token is the base's argmax there. So the policy keeps, per path, the rate at
which it was accepted when its parent was (sampled on every step whose tree holds it, whatever
the arm), and a static arm's expected tokens per step is 1 + the sum over its nodes of the
product of those rates along the node's path (Medusa's expected acceptance length, Cai et al.
2024, with measured rates). Two nested trees then differ only by their extra nodes' terms:
comparing them no longer sets one arm's noisy tokens-per-step average against another's, and a
small tree's tokens are measured on every step of a larger one. Costs (seconds per step) stay
per arm. Sampling (temperature > 0), dynamic trees and unions keep the per-arm average: there a
node's acceptance depends on its siblings or the draft chose the shape. A dynamic tree's step
still feeds the paths `(0,)` ... `(k-1,)` of its drafter's top k tokens at the root (the base's
token there says which would have been accepted, in the tree or not), so a one-level static tree
of them (EAGLE's CPU arm) is measured on every step of a deeper dynamic one: its estimate follows
the text as the running arm's average does, and a hard stretch that lowers the running arm's
average lowers it too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from inference.tree import Choice


@dataclass
class Arm:
    """A drafter setting (`options` passed to `drafter.configure`), or plain decoding (None)."""

    options: dict | None
    tokens: float = 0.0  # mean, then EMA, of tokens gained per step
    seconds: float = 0.0  # mean, then EMA, of seconds per step
    tries: int = 0
    proposals: int = 0  # steps on which it drafted something (a lookup may find nothing)
    gained: bool = False  # whether a step of it ever gained more than the bonus token
    last_step: int = -1
    interval: int = 0  # steps from its last try to its next exploratory one
    # A static tree's nodes as paths of ranks (from its greedy steps), else None.
    nodes: frozenset[Choice] | None = None


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
        idle_after: a drafting arm that has drafted on this many steps or more and never
            gained a token past the bonus one (estimated tokens per step 1) waits twice as long
            too, whatever its rate, and is not the best arm: it cannot pay until a draft of it
            is accepted.
        smoothing: EMA weight of the newest measurement (after the first 1/smoothing steps of
            an arm, which are averaged); also of each path's acceptance rate.
        time_smoothing: another weight for the seconds per step (None: `smoothing`). A short
            one (0.25) follows the machine's load: in replays of recorded steps it came 1-5
            points nearer the best fixed setting with trained heads and with untrained EAGLE-3
            weights, as near with untrained Medusa heads; a live side-by-side run on fresh heads
            could not tell the two apart (docs/bench.md), so it is not the default yet.
        pooled: estimate static trees' tokens per step from per-path acceptance rates on greedy
            steps (see the module's doc); False keeps every arm's own average.
    """

    arms: list[Arm]
    warmup: int = 4
    explore_every: int = 32
    explore_steps: int = 4
    max_explore_every: int = 512
    backoff_below: float = 0.9
    idle_after: int = 12
    smoothing: float = 0.05
    time_smoothing: float | None = None
    pooled: bool = True
    # Greedy decoding: the generator sets it per call; the pooled estimates serve only then.
    greedy: bool = field(default=False, init=False)
    step: int = field(default=0, init=False)
    # Per path of ranks: [rate at which it was accepted when its parent was, samples].
    _paths: dict[Choice, list[float]] = field(default_factory=dict, init=False, repr=False)
    # The arm of the re-try in progress and its steps left.
    _retry: int | None = field(default=None, init=False, repr=False)
    _retry_steps_left: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.explore_steps < 1:
            raise ValueError("need warmup >= 1 and explore_steps >= 1 (steps per arm per try)")
        if self.idle_after < 1:
            raise ValueError("need idle_after >= 1 (drafted steps before an arm may be idle)")
        for arm in self.arms:
            arm.interval = arm.interval or self.explore_every

    @classmethod
    def from_options(cls, options: list[dict | None], **kwargs) -> AdaptivePolicy:
        # Copies: a caller's dict changed in place later is a new arm, not this one.
        return cls([Arm(copy.deepcopy(o)) for o in options], **kwargs)

    def estimate_tokens(self, index: int) -> float:
        """Estimated tokens per step of an arm: pooled over paths for a static tree on greedy
        steps, else the arm's own average."""
        arm = self.arms[index]
        if not (self.pooled and self.greedy and arm.nodes is not None):
            return arm.tokens
        total = 1.0  # the bonus token
        for node in arm.nodes:
            p = 1.0
            for depth in range(1, len(node) + 1):
                p *= self._paths.get(node[:depth], (0.0,))[0]
            total += p
        return total

    def estimate_rate(self, index: int) -> float:
        """Estimated tokens per second of an arm."""
        seconds = self.arms[index].seconds
        return self.estimate_tokens(index) / seconds if seconds > 0 else 0.0

    def best(self) -> int:
        """Index of the arm with the highest measured rate, an idle one left out (its drafts
        never accepted, it can at most match plain decoding: measured faster, it is noise or a
        tree's forward a little cheaper than a plain step's, and drafting for nothing)."""
        active = [i for i in range(len(self.arms)) if not self.idle(i)]
        return max(active or range(len(self.arms)), key=self.estimate_rate)

    def idle(self, index: int) -> bool:
        """Whether a drafting arm has drafted on `idle_after` steps or more and none of its
        drafts was ever accepted (nor, for a static tree, any of its paths)."""
        arm = self.arms[index]
        return (
            arm.options is not None
            and arm.proposals >= self.idle_after
            and not arm.gained
            and self.estimate_tokens(index) <= 1.0
        )

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

    def update(
        self,
        index: int,
        tokens: int,
        seconds: float,
        drafted: Sequence[Choice] | None = None,
        accepted: Choice = (),
        static: bool = True,
        proposed: bool = True,
    ) -> None:
        """Record a step of arm `index`: the tokens it gained and its seconds. On a greedy
        step, also `drafted` (paths of ranks, the root left out: a static tree's nodes, or with
        `static=False` the paths a dynamic tree's step measured, which feed the shared rates but
        are not the arm's shape) and `accepted` (the deepest accepted path; () when none was).
        `proposed`: whether the arm drafted anything on this step (a lookup may find nothing)."""
        arm = self.arms[index]
        arm.tries += 1
        if proposed and arm.options is not None:
            arm.proposals += 1
        arm.gained = arm.gained or tokens > 1
        arm.tokens += self._weight(arm.tries) * (tokens - arm.tokens)
        arm.seconds += self._weight(arm.tries, self.time_smoothing) * (seconds - arm.seconds)
        if drafted is not None:
            if static and arm.nodes is None:  # a static arm's tree is the same on every step
                arm.nodes = frozenset(drafted)
            for node in drafted:
                if accepted[: len(node) - 1] == node[:-1]:  # its parent was accepted
                    stat = self._paths.setdefault(node, [0.0, 0])
                    stat[1] += 1
                    stat[0] += self._weight(stat[1]) * (
                        float(accepted[: len(node)] == node) - stat[0]
                    )
        arm.last_step = self.step
        self.step += 1
        retried = index == self._retry
        if retried:
            self._retry_steps_left -= 1
            if self._retry_steps_left > 0:
                return  # judged when its re-try ends
            self._retry = None
        close = self.estimate_rate(index) >= self.backoff_below * self.estimate_rate(self.best())
        if close and not self.idle(index):
            arm.interval = self.explore_every
        elif retried:
            arm.interval = min(2 * arm.interval, self.max_explore_every)

    def _weight(self, samples: int, smoothing: float | None = None) -> float:
        """Weight of the newest of `samples` measurements: their mean, then an EMA (of weight
        `smoothing`, by default the policy's)."""
        return max(self.smoothing if smoothing is None else smoothing, 1.0 / samples)

    def summary(self) -> list[dict]:
        """Per arm: its options, estimated tokens per step and per second, seconds per step and
        steps run."""
        return [
            {
                "options": a.options,
                "tokens_per_step": self.estimate_tokens(i),
                "seconds_per_step": a.seconds,
                "tokens_per_s": self.estimate_rate(i),
                "steps": a.tries,
            }
            for i, a in enumerate(self.arms)
        ]


def check_arms(arms: Iterable[Mapping | None]) -> list[dict | None]:
    """The arms as a list of None (plain decoding) and dicts of drafter options, checked: `{}`
    is the drafter as configured before any arm ran, so no arm may have configured it."""
    if isinstance(arms, (str, Mapping)) or not isinstance(arms, Iterable):
        raise TypeError(
            f"adaptive must be True, False or a list of arms (None: plain decoding, a dict of "
            f"drafter options), e.g. [None, {{}}]; got {arms!r}"
        )
    arms = [a if a is None or not isinstance(a, Mapping) else dict(a) for a in arms]
    odd = [a for a in arms if a is not None and not isinstance(a, dict)]
    if odd:
        raise TypeError(
            f"adaptive arm {odd[0]!r}: an arm is None (plain decoding) or a dict of drafter "
            "options, e.g. [None, {}, {'top_k': 4, 'depth': 2, 'total_tokens': 6}]"
        )
    settings = [a for a in arms if a]
    if {} in arms and settings:
        raise ValueError(
            f"adaptive arms mix {{}} (the drafter as it is configured) with settings {settings}: "
            "once another arm has configured the drafter, {} no longer means its first "
            "settings; name them instead"
        )
    return arms
