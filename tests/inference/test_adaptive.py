"""The adaptive policy on its own: which arm it runs, re-tries and backs off from, and what it
estimates from the steps it is told of."""

import random

import pytest

from inference.adaptive import AdaptivePolicy


def drive(policy: AdaptivePolicy, steps: int, outcome) -> list[int]:
    """`steps` rounds of choose and update, `outcome(step, arm)` giving (tokens, seconds); the
    arms chosen."""
    chosen = []
    for step in range(steps):
        arm = policy.choose()
        chosen.append(arm)
        policy.update(arm, *outcome(step, arm))
    return chosen


def test_policy_tries_every_arm_then_exploits_and_explores():
    policy = AdaptivePolicy.from_options(
        [None, {"a": 1}, {"a": 2}], warmup=2, explore_every=5, explore_steps=1
    )
    rates = {0: (1, 1.0), 1: (3, 1.0), 2: (2, 1.0)}  # arm 1 gives the most tokens per second
    chosen = drive(policy, 30, lambda step, arm: rates[arm])
    assert chosen[:6] == [0, 0, 1, 1, 2, 2]  # warmup: each arm twice
    later = chosen[6:]
    assert later.count(1) >= 0.7 * len(later)  # mostly the fastest arm
    assert {0, 2} <= set(later)  # and the others are re-measured now and then
    best = max(policy.summary(), key=lambda a: a["tokens_per_s"])
    assert best["options"] == {"a": 1}


def test_policy_keeps_copies_of_its_arms():
    options = [None, {"a": 1}]
    policy = AdaptivePolicy.from_options(options)
    options[1]["a"] = 2  # the caller's dict changed in place: not the arm that was measured
    assert policy.arms[1].options == {"a": 1}


def test_policy_follows_a_change_in_acceptance():
    policy = AdaptivePolicy.from_options(
        [None, {"tree": 1}], warmup=1, explore_every=4, smoothing=0.5
    )
    # The drafter stops being accepted at step 30.
    drive(policy, 60, lambda step, arm: ((3 if step < 30 else 1), 1.5) if arm == 1 else (1, 1.0))
    assert policy.choose() == 0 or policy.estimate_rate(0) > policy.estimate_rate(1)


def test_with_the_defaults_a_drafter_that_stops_paying_is_left_within_a_few_dozen_steps():
    policy = AdaptivePolicy.from_options([None, {"tree": 1}])
    chosen = drive(
        policy, 300, lambda step, arm: ((3 if step < 200 else 1), 1.5) if arm == 1 else (1, 1.0)
    )
    assert chosen[150:200].count(1) >= 45  # while it pays: used
    # 40 steps after it stopped: plain decoding, the drafter re-tried 4 steps in every ~32
    assert chosen[240:].count(0) >= 50


def retries(chosen: list[int], arm: int) -> list[tuple[int, int]]:
    """(first step, length) of each run of consecutive steps on `arm`."""
    runs: list[tuple[int, int]] = []
    for i, a in enumerate(chosen):
        if a == arm:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def waits(tries: list[tuple[int, int]]) -> list[int]:
    """Steps from the end of each run of an arm (`retries`) to the start of its next."""
    return [b - (a + length) + 1 for (a, length), (b, _) in zip(tries, tries[1:])]


def test_an_arm_that_does_not_pay_is_tried_ever_more_rarely():
    """Re-tries (4 steps each) that leave an arm behind double its wait (32, 64, ... 512 steps
    after the try's last step): over 3,000 steps a drafter slower than plain decoding gets its
    warmup and 8 re-tries, not one every 32 steps (~80)."""
    policy = AdaptivePolicy.from_options([None, {"tree": 8}])
    chosen = drive(policy, 3000, lambda step, arm: (1, 1.0) if arm == 0 else (1, 1.5))
    tries = retries(chosen, 1)
    assert [length for _, length in tries] == [4] * 9  # warmup, then 8 re-tries of 4 steps
    assert waits(tries) == [32, 64, 128, 256, 512, 512, 512, 512]


def test_a_weak_drafter_that_pays_is_kept_despite_noisy_steps():
    """A drafter that gains 1, 2 or 3 tokens a step (p 0.6 / 0.25 / 0.15: 1.55 on average) at
    1.2x a plain step's cost is 1.29x faster than plain decoding. Judged by one step at a time
    and a short average (the policy before re-tries of 4 steps and smoothing 0.05), an unlucky
    step made it look slower and backed it off: it ran on ~20% of the steps. The defaults keep
    it on almost all of them (20 seeded runs of 1,500 steps)."""

    def share_on_drafter(policy: AdaptivePolicy, seed: int, gains: list[float]) -> float:
        rng = random.Random(seed)
        chosen = drive(
            policy,
            1500,
            lambda step, arm: (rng.choices([1, 2, 3], gains)[0], 1.2) if arm == 1 else (1, 1.0),
        )
        return chosen.count(1) / len(chosen)

    def mean_share(gains: list[float], **settings) -> tuple[float, float]:
        shares = [
            share_on_drafter(
                AdaptivePolicy.from_options([None, {"chain": 2}], **settings), s, gains
            )
            for s in range(20)
        ]
        return sum(shares) / len(shares), min(shares)

    before = {"warmup": 1, "explore_steps": 1, "smoothing": 0.2}
    assert mean_share([0.6, 0.25, 0.15], **before)[0] < 0.4
    mean, least = mean_share([0.6, 0.25, 0.15])
    assert mean > 0.9 and least > 0.7
    # Only 1.125x faster (1.35 tokens a step): kept on about half the steps, not one in 25.
    assert mean_share([0.75, 0.15, 0.10], **before)[0] < 0.1
    assert mean_share([0.75, 0.15, 0.10])[0] > 0.45


def test_a_backed_off_arm_that_pays_again_is_found_and_kept():
    """After many steps where the drafter did not pay, it pays again (copy-heavy text): the next
    re-try finds it, it becomes the best arm, and plain decoding is then re-tried at the base
    interval, not the backed-off one."""
    policy = AdaptivePolicy.from_options([None, {"tree": 8}])
    pays = False
    for step in range(2000):
        pays = step >= 1000
        arm = policy.choose()
        tokens = (4 if pays else 1) if arm == 1 else 1
        policy.update(arm, tokens, 1.5 if arm == 1 else 1.0)
        if pays and policy.best() == 1:
            break
    # Found at its next re-try: within the longest wait (512) and one re-try (4 steps).
    assert policy.best() == 1 and step <= 1000 + 512 + 4
    chosen = drive(policy, 100, lambda step, arm: (4, 1.5) if arm == 1 else (1, 1.0))
    # Exploits it; re-tries plain decoding after 32 steps (4 steps), not the backed-off 512.
    assert chosen.count(1) >= 90 and chosen.count(0) >= 4
    # and should it falter again, it is itself re-tried after 32 steps, not after 512
    assert policy.arms[1].interval == policy.explore_every


def test_of_the_arms_due_the_longest_overdue_is_re_tried_first_and_never_the_best():
    policy = AdaptivePolicy.from_options([None, {"a": 1}, {"a": 2}], warmup=1, explore_steps=1)
    for arm, (tokens, seconds) in enumerate([(1, 1.0), (1, 2.0), (3, 1.0)]):
        policy.update(arm, tokens, seconds)
    policy.step = 200
    policy.arms[0].last_step, policy.arms[0].interval = 100, 32  # due since step 132
    policy.arms[1].last_step, policy.arms[1].interval = 10, 32  # due since step 42
    policy.arms[2].last_step = 0  # the best arm, "due" the longest: it runs anyway
    assert policy.choose() == 1


def test_the_summary_gives_the_estimates_the_policy_decides_on():
    policy = AdaptivePolicy.from_options([None, {"c": 1}, {"c": 2}])
    policy.greedy = True
    # a one-node tree whose node was accepted: 2 tokens a step, as the path's rate estimates
    policy.update(1, 1, 1.0, drafted=[(0,)], accepted=(0,))
    summary = policy.summary()
    assert summary[1]["tokens_per_step"] == policy.estimate_tokens(1) == 2.0
    assert summary[1]["tokens_per_s"] == 2.0 and summary[1]["steps"] == 1
    assert summary[2]["tokens_per_s"] == 0.0 and summary[2]["steps"] == 0  # never run


def plain_beside_drafts(gains: dict[int, int]):
    """An outcome for `drive`: arm 0 (plain) 1 token in 1 s; arm 1 1.05 s a step and 1 token,
    but `gains[n]` tokens on its n-th step."""
    tried = 0

    def outcome(step, arm):
        nonlocal tried
        if arm == 0:
            return 1, 1.0
        tried += 1
        return gains.get(tried, 1), 1.05

    return outcome


def test_an_arm_close_to_the_best_keeps_the_base_interval():
    """A lookup that found nothing this time costs what a plain step does, and pays in bursts:
    no back-off for it."""
    policy = AdaptivePolicy.from_options([None, {"num_tokens": 6}])
    # its first step gains 3 tokens, every other one nothing
    chosen = drive(policy, 1000, plain_beside_drafts({1: 3}))
    assert policy.estimate_rate(1) >= 0.9 * policy.estimate_rate(0)  # close to the best
    tries = [t for t in retries(chosen, 1) if t[0] >= 100]  # once its burst has faded
    assert len(tries) >= 20
    assert set(waits(tries)) == {32}


@pytest.mark.parametrize("seconds", [1.05, 1.0, 0.95])
def test_an_arm_that_never_gains_a_token_is_backed_off_however_cheap(seconds):
    """Fresh untrained heads: no draft is ever accepted. A tree that costs about what a plain
    step does, or is measured a little faster, is backed off once it has run `idle_after` (12)
    steps: its warmup and two re-tries, then waits of 64, 128, ... steps; and it is never the
    best arm, which stays plain decoding."""
    policy = AdaptivePolicy.from_options([None, {"top_k": 4, "depth": 1}])
    chosen = drive(policy, 3000, lambda step, arm: (1, 1.0 if arm == 0 else seconds))
    tries = retries(chosen, 1)
    gaps = waits(tries)
    if seconds >= 1.0:
        assert gaps == [32, 32, 64, 128, 256, 512, 512, 512, 512]
    else:  # the best arm after its warmup, until its 12th draft; then re-tried as the others
        assert tries[0] == (4, 12) and gaps == [32, 64, 128, 256, 512, 512, 512, 512]
    assert chosen.count(1) <= 44  # against ~370 steps for a re-try every 32 steps
    assert policy.idle(1) and policy.best() == 0


def test_an_idle_arm_whose_draft_is_accepted_gets_the_base_interval_back():
    """Backed off for drafts never accepted, an arm whose draft is accepted on a later re-try
    (the text changed) is re-tried every 32 steps again, and stays so through dry stretches."""
    policy = AdaptivePolicy.from_options([None, {"num_tokens": 3}])
    # its fifth try's first step (its 17th step) gains a token
    chosen = drive(policy, 3000, plain_beside_drafts({17: 2}))
    tries = retries(chosen, 1)
    gaps = waits(tries)
    assert gaps[:4] == [32, 32, 64, 128] and policy.arms[1].gained
    assert set(gaps[5:]) == {32}  # from the try that gained on


def test_a_static_tree_never_accepted_under_greedy_is_idle_by_its_path_rates():
    """Greedy steps of a static tree estimate its tokens from its paths' rates: none accepted,
    1 token a step, and the tree is backed off like an arm of its own average."""
    policy = AdaptivePolicy.from_options([None, {"choices": [[0], [1], [2], [3]]}])
    policy.greedy = True
    paths = [(0,), (1,), (2,), (3,)]
    chosen = drive(
        policy, 2000, lambda step, arm: (1, 1.0) if arm == 0 else (1, 1.02, paths, (), True)
    )
    assert policy.estimate_tokens(1) == 1.0 and policy.arms[1].nodes == frozenset(paths)
    gaps = waits(retries(chosen, 1))
    assert gaps[:5] == [32, 32, 64, 128, 256]


def test_idle_after_below_one_is_refused():
    with pytest.raises(ValueError, match="idle_after >= 1"):
        AdaptivePolicy.from_options([None, {}], idle_after=0)


def test_a_lookup_that_finds_nothing_is_not_idle():
    """Steps on which a lookup found nothing to draft (plain steps in all but name) are not
    drafts that failed: however many, the lookup keeps the base interval."""
    policy = AdaptivePolicy.from_options([None, {"num_tokens": 6}])
    dry = (1, 1.02, None, (), True, False)  # nothing proposed
    chosen = drive(policy, 1000, lambda step, arm: (1, 1.0) if arm == 0 else dry)
    tries = retries(chosen, 1)
    assert len(tries) > 20 and policy.arms[1].proposals == 0
    assert set(waits(tries)) == {32}


def test_plain_decoding_is_never_idle():
    """Plain decoding gains one token a step by definition: re-tried beside a drafter barely
    faster, it keeps the base interval."""
    policy = AdaptivePolicy.from_options([None, {"num_tokens": 3}])
    chosen = drive(policy, 1000, lambda step, arm: (1, 1.0) if arm == 0 else (2, 1.9))
    assert policy.best() == 1
    tries = retries(chosen, 0)
    assert set(waits(tries)) == {32}


def test_a_short_time_average_brings_a_tree_timed_while_busy_back_after_one_re_try():
    """A step's cost moves with the machine's load: the tree (2 tokens a step at 1.4x plain's
    cost) had its 4 warm-up steps while another process took the cores (twice their time), so
    it looked slower than plain decoding. With seconds a short average (`time_smoothing` 0.25)
    its first re-try, on a quiet machine, brings it back for good; averaged as long as tokens
    are (the default), that re-try still leaves it behind."""

    def outcome(step, arm):
        busy = 2.0 if 4 <= step < 8 else 1.0
        return (1, 1.0) if arm == 0 else (2, 1.4 * busy)

    short = AdaptivePolicy.from_options([None, {"tree": 1}], time_smoothing=0.25)
    chosen = drive(short, 100, outcome)
    assert chosen[:8] == [0] * 4 + [1] * 4 and chosen[8:39] == [0] * 31  # next try in 32 steps
    assert chosen[39:43] == [1] * 4 and chosen[43:100].count(1) >= 50  # its re-try, and kept
    assert drive(AdaptivePolicy.from_options([None, {"tree": 1}]), 100, outcome)[43:70] == [0] * 27


def test_an_arm_averages_its_first_steps_then_smooths():
    policy = AdaptivePolicy.from_options([None], smoothing=0.25)
    for tokens in (1, 3, 2, 2):  # the first 1/smoothing = 4 steps: their mean
        policy.update(0, tokens, 1.0)
    assert policy.arms[0].tokens == 2.0
    policy.update(0, 6, 1.0)  # then an EMA with weight 0.25
    assert policy.arms[0].tokens == 3.0


def test_static_trees_share_their_paths_acceptance_on_greedy_steps():
    """Per path of ranks, the rate at which it was accepted when its parent was; an arm's tokens
    per step are 1 + the sum over its nodes of the rates' products along the path."""
    small, big = [(0,)], [(0,), (1,), (0, 0)]
    policy = AdaptivePolicy.from_options([None, {"t": 1}, {"t": 2}], smoothing=1e-9)
    policy.greedy = True
    policy.update(2, 3, 1.0, big, (0, 0))  # (0,) then (0, 0) accepted; (1,) not
    policy.update(2, 1, 1.0, big, ())  # nothing: (0,) and (1,) sampled, (0, 0) not
    assert policy.arms[1].nodes is None  # not run yet: no shape, its own (empty) average
    assert policy.estimate_tokens(1) == 0.0
    policy.update(1, 2, 1.0, small, (0,))
    assert policy.arms[1].nodes == frozenset(small)
    # (0,): accepted 2 of 3 times; (1,): 0 of 2; (0, 0): 1 of 1 when (0,) was accepted.
    assert policy.estimate_tokens(1) == pytest.approx(1 + 2 / 3)
    assert policy.estimate_tokens(2) == pytest.approx(1 + 2 / 3 + 0 + 2 / 3 * 1)
    assert policy.arms[2].tokens == pytest.approx(2.0)  # its own average, for sampling
    policy.greedy = False
    assert policy.estimate_tokens(1) == pytest.approx(2.0)
    assert policy.estimate_tokens(2) == pytest.approx(2.0)
    assert policy.estimate_rate(2) == pytest.approx(2.0)
    unpooled = AdaptivePolicy.from_options([None, {"t": 1}, {"t": 2}], pooled=False)
    unpooled.greedy = True
    unpooled.update(2, 3, 1.0, big, (0, 0))
    unpooled.update(2, 1, 1.0, big, ())
    unpooled.update(1, 2, 1.0, small, (0,))
    assert unpooled.estimate_tokens(1) == pytest.approx(2.0)  # each arm's own average
    assert unpooled.estimate_tokens(2) == pytest.approx(2.0)


def test_the_shared_rates_choose_between_nested_trees():
    """A small tree's one unlucky step against a larger tree's many: its own average says 1
    token a step, the paths it shares with the larger tree say ~1.6, and at nearly the cost of
    plain decoding that makes it the best arm; the larger tree stays best without pooling."""
    small, big = [(0,)], [(0,), (1,), (0, 0), (1, 0)]
    rng = random.Random(0)
    for pooled, best in ((True, 1), (False, 2)):
        policy = AdaptivePolicy.from_options(
            [None, {"t": 1}, {"t": 2}], warmup=1, pooled=pooled, smoothing=0.01
        )
        policy.greedy = True
        policy.update(0, 1, 1.0)
        policy.update(1, 1, 1.05, small, ())  # (0,) rejected on its one step
        for _ in range(200):  # (0,) right 60% of the time, (0, 0) after it 50%
            first = (0,) if rng.random() < 0.6 else ((1,) if rng.random() < 0.25 else ())
            path = first + (0,) if first and rng.random() < 0.5 else first
            policy.update(2, 1 + len(path), 1.6, big, path)
        assert policy.best() == best


def test_a_dynamic_trees_measured_paths_keep_a_static_trees_estimate_fresh():
    """A dynamic arm's step feeds the paths it measured (static=False) without taking them as
    its shape: its estimate stays its own average, and a static arm of those paths follows the
    text while it does not run."""
    one_level = [(0,), (1,), (2,), (3,)]
    policy = AdaptivePolicy.from_options([None, {"static": 1}, {"dynamic": 2}], smoothing=0.5)
    policy.greedy = True
    policy.update(1, 2, 1.0, one_level, (0,))  # the static arm: its top-1 right
    assert policy.estimate_tokens(1) == pytest.approx(2.0)
    for _ in range(6):  # a hard stretch on the dynamic arm: the root's top 4 all wrong
        policy.update(2, 1, 1.2, one_level, (), static=False)
    assert policy.arms[2].nodes is None  # not a static tree: its own average
    assert policy.estimate_tokens(2) == pytest.approx(1.0)
    assert policy.estimate_tokens(1) < 1.05  # (0,) went 1 -> 0.5 -> ... -> 1/64
    policy.update(2, 3, 1.2, one_level, (2,), static=False)
    assert policy._paths[(2,)][0] == pytest.approx(0.5)
    assert policy.estimate_tokens(2) == pytest.approx(2.0)
