import random

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import SpeculativeGenerator
from inference.adaptive import AdaptivePolicy
from inference.draft import Sampling
from inference.drafters.model import ModelDrafter
from tests.conftest import make_tiny_llama


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


def test_an_arm_that_does_not_pay_is_tried_ever_more_rarely():
    """Re-tries (4 steps each) that leave an arm behind double its wait (32, 64, ... 512 steps
    after the try's last step): over 3,000 steps a drafter slower than plain decoding gets its
    warmup and 8 re-tries, not one every 32 steps (~80)."""
    policy = AdaptivePolicy.from_options([None, {"tree": 8}])
    chosen = drive(policy, 3000, lambda step, arm: (1, 1.0) if arm == 0 else (1, 1.5))
    tries = retries(chosen, 1)
    assert [length for _, length in tries] == [4] * 9  # warmup, then 8 re-tries of 4 steps
    waits = [b - (a + 4) + 1 for (a, _), (b, _) in zip(tries, tries[1:])]
    assert waits == [32, 64, 128, 256, 512, 512, 512, 512]


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


def test_an_arm_close_to_the_best_keeps_the_base_interval():
    """A lookup that found nothing costs what a plain step does: no back-off for it."""
    policy = AdaptivePolicy.from_options([None, {"num_tokens": 6}])
    # The lookup's rate is 0.95 of plain decoding's.
    chosen = drive(policy, 1000, lambda step, arm: (1, 1.0 if arm == 0 else 1.05))
    tries = retries(chosen, 1)
    assert {b - (a + length) + 1 for (a, length), (b, _) in zip(tries, tries[1:])} == {32}


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


def test_greedy_generation_feeds_the_root_ranking_of_a_dynamic_tree():
    """A draft's `root_ranking` is scored against the base's token at the root: the rank that
    held it is accepted, the others not; sampling feeds nothing."""
    from inference.draft import Draft, Drafter
    from inference.tree import tree_from_parents

    base = make_tiny_llama()

    class Ranking(Drafter):  # a root-only tree; the right token ranked second on even steps
        def __init__(self):
            self.steps = 0

        def configure(self, **options):
            pass

        def propose(self, sequence, sampling):
            order = base(sequence[None]).logits[0, -1].argsort(descending=True)
            ranking = order[[1, 0, 2]] if self.steps % 2 == 0 else order[[1, 2, 3]]
            self.steps += 1
            root = tree_from_parents([-1])
            return Draft(root, sequence[-1:], torch.zeros(1, dtype=torch.bool), None, ranking)

    drafter = Ranking()
    gen = SpeculativeGenerator(base, drafter, adaptive=[{}])
    gen.policy = AdaptivePolicy.from_options(gen.arms, smoothing=1e-9)
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    out = gen.generate(prompt, max_new_tokens=12)
    assert torch.equal(out.sequences, base.generate(prompt, max_new_tokens=12, do_sample=False))
    steps = out.num_steps
    rates = {path: stat for path, stat in gen.policy._paths.items()}
    assert rates.keys() == {(0,), (1,), (2,)} and all(s[1] == steps for s in rates.values())
    assert rates[(1,)][0] == pytest.approx(((steps + 1) // 2) / steps)
    assert rates[(0,)][0] == rates[(2,)][0] == 0.0
    assert gen.policy.arms[0].nodes is None
    gen.policy = AdaptivePolicy.from_options(gen.arms)
    gen.generate(prompt, max_new_tokens=8, temperature=0.8)
    assert not gen.policy._paths


def test_greedy_generation_feeds_the_paths_of_a_static_tree():
    """On one static arm with plain running means, the pooled estimate telescopes to the arm's
    own tokens per step (P(path accepted) = the product of its conditional rates), which a
    wrong rule for "the parent was accepted" or for the node keys would break; sampling feeds
    no paths."""
    base = make_tiny_llama()
    draft = make_tiny_llama()
    torch.manual_seed(0)
    with torch.no_grad():  # a draft that is right about half the time at each level
        lm_head = draft.get_output_embeddings().weight
        lm_head.add_(0.01 * torch.randn_like(lm_head))
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    gen = SpeculativeGenerator(base, draft, adaptive=[{"choices": choices}])
    gen.policy = AdaptivePolicy.from_options(gen.arms, smoothing=1e-9)
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(3, 256, (1, 8))
        out = gen.generate(prompt, max_new_tokens=40)
        assert torch.equal(out.sequences, base.generate(prompt, max_new_tokens=40, do_sample=False))
    policy = gen.policy
    rates = {path: stat[0] for path, stat in policy._paths.items()}
    assert set(rates) == {tuple(c) for c in choices}
    assert 0.3 < rates[(0,)] < 0.8 and 0.3 < rates[(0, 0)] < 0.8  # accepted and rejected paths
    assert policy.greedy and policy.estimate_tokens(0) == pytest.approx(policy.arms[0].tokens)
    assert 1.5 < policy.estimate_tokens(0) < 4
    gen.policy = AdaptivePolicy.from_options(gen.arms)
    gen.generate(prompt, max_new_tokens=16, temperature=0.8)
    assert not gen.policy.greedy and not gen.policy._paths
    assert gen.policy.arms[0].nodes is None


def test_a_model_drafter_caught_up_proposes_as_without():
    drafter = ModelDrafter(make_tiny_llama(seed=2), num_tokens=3)
    sequence = torch.randint(3, 256, (12,))
    drafter.reset()
    plain = drafter.propose(sequence, Sampling())
    drafter.reset()
    drafter.catch_up(sequence)
    assert drafter._fed == sequence[:-1].tolist()  # all but the root, whose logits propose needs
    caught_up = drafter.propose(sequence, Sampling())
    assert torch.equal(plain.tokens, caught_up.tokens)


@pytest.mark.parametrize("kind", ["medusa", "eagle3", "ngram", "draft-model"])
def test_adaptive_generation_is_still_exact(kind):
    base = make_tiny_llama()
    heads = {
        "medusa": MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(
            base
        ),
        "eagle3": EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=256)),
        "ngram": None,
        "draft-model": make_tiny_llama(seed=2),
    }[kind]
    gen = SpeculativeGenerator(base, heads)  # no options: adaptive by default
    assert gen.arms and None in gen.arms
    steps = 0
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(3, 256, (1, 5)).repeat(1, 2)
        ref = base.generate(prompt, max_new_tokens=48, do_sample=False)
        out = gen.generate(prompt, max_new_tokens=48)
        assert torch.equal(out.sequences, ref)
        steps += out.num_steps
        # The policy's measurements carry over from one call to the next.
        assert sum(a["steps"] for a in gen.policy.summary()) == steps
    gen.policy = None  # starts afresh
    out = gen.generate(prompt, max_new_tokens=8)
    assert sum(a["steps"] for a in gen.policy.summary()) == out.num_steps
    policy = gen.policy
    gen.arms = [dict(a) if a else a for a in gen.arms]  # equal arms: the same measurements
    gen.generate(prompt, max_new_tokens=8)
    assert gen.policy is policy
    gen.arms = gen.arms[:2][::-1]  # other arms (or another order): a policy, measured afresh
    ref = base.generate(prompt, max_new_tokens=8, do_sample=False)
    out = gen.generate(prompt, max_new_tokens=8)
    assert torch.equal(out.sequences, ref)
    assert len(gen.policy.arms) == 2
    assert sum(a["steps"] for a in gen.policy.summary()) == out.num_steps


def test_fixed_options_turn_adaptation_off():
    base = make_tiny_llama()
    assert SpeculativeGenerator(base, None, num_tokens=3).arms is None
    assert SpeculativeGenerator(base, None, num_tokens=3, adaptive=True).arms is not None


@pytest.mark.parametrize("num_heads", [1, 2, 3])
def test_medusa_cpu_arms_fit_the_heads(num_heads):
    from inference.drafters.medusa import MedusaDrafter

    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=num_heads))
    drafter = MedusaDrafter(heads.init_from_base(base))
    arms = drafter.default_arms(torch.device("cpu"))
    assert arms[0] is None
    sizes = []
    for options in arms[1:]:
        drafter.configure(**options)  # every arm is a tree these heads can draft
        sizes.append(drafter.tree.num_nodes)
    # head 0's top 4 (and head 1's top 1): the one tree that paid on 2 CPU cores
    assert sizes == [5 + (num_heads > 1)]


def test_medusa_sized_presets_fit_two_heads_and_chains_say_what_they_need():
    from inference.drafters.medusa import MedusaDrafter

    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    drafter = MedusaDrafter(heads, "cpu-8")  # the CPU recipe trains 2 heads
    assert (drafter.tree.num_nodes, drafter.tree.depth) == (8, 2)
    drafter.configure(choices="cpu-16")
    assert (drafter.tree.num_nodes, drafter.tree.depth) == (16, 2)
    with pytest.raises(ValueError, match="tree depth 3 needs 3 heads, these have 2"):
        drafter.configure(choices="chain-3")


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_medusa_gpu_arms_fit_the_heads(num_heads):
    from inference.drafters.medusa import MedusaDrafter

    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=num_heads))
    drafter = MedusaDrafter(heads.init_from_base(base))
    sizes = []
    for options in drafter.default_arms(torch.device("cuda"))[2:]:  # the trees after the chain
        drafter.configure(**options)
        sizes.append(drafter.tree.num_nodes)
    assert sizes == ([11] if num_heads == 1 else [32, 64])  # one head's top 10 at most


def test_interleaved_streams_run_the_arm_the_policy_credits():
    """Two streams of one generator share its drafter: each step runs the settings of the arm
    chosen for it, even when the other stream configured the drafter since."""
    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=256))
    gen = SpeculativeGenerator(base, draft)
    gen.policy = AdaptivePolicy.from_options(gen.arms, warmup=1)
    static, dynamic = 1, 2  # the CPU arms: the top 4 at one level; a 2-level dynamic tree
    assert "choices" in gen.arms[static] and "top_k" in gen.arms[dynamic]
    ran = []
    propose = gen.drafter.propose

    def logged(sequence, sampling):
        ran.append("static" if gen.drafter.static is not None else "dynamic")
        return propose(sequence, sampling)

    gen.drafter.propose = logged
    chosen = iter([static, dynamic] * 4)
    gen.policy.choose = lambda: next(chosen)
    rng = torch.Generator().manual_seed(1)
    a, b = (gen.stream(torch.randint(3, 256, (1, 10), generator=rng), 8) for _ in range(2))
    next(a), next(b)  # the prefills
    for _ in range(3):
        next(a), next(b)
    assert ran == ["static", "dynamic"] * 3


def test_arms_the_drafter_cannot_take_are_refused_when_the_generator_is_built():
    # The policy tries its arms in turn, 4 steps each: a bad third arm would first fail in a
    # later generate call, after tokens were produced (and yielded, streaming)
    from inference import MedusaDrafter, NgramDrafter

    base = make_tiny_llama()
    medusa = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    eagle = EagleDraft(EagleConfig.from_base(base.config, version=3))
    deep = {"choices": [[0], [0, 0], [0, 0, 0]]}
    with pytest.raises(ValueError, match=r"adaptive arm .*: tree depth 3 needs 3 heads"):
        SpeculativeGenerator(base, medusa, adaptive=[None, {"choices": [[0]]}, deep])
    with pytest.raises(
        ValueError, match=r"adaptive arm .*unexpected keyword argument 'total_token'"
    ):
        SpeculativeGenerator(
            base, eagle, adaptive=[None, {"top_k": 2, "depth": 2, "total_token": 4}]
        )
    with pytest.raises(ValueError, match=r"adaptive arm .*tree depth 3 needs 3 heads"):
        SpeculativeGenerator(base, [medusa, None], adaptive=[None, {"parts": [deep, {}]}])
    # checking leaves the drafters as configured: a union member keeps its settings too
    drafter, lookup = MedusaDrafter(medusa, [[0], [1]]), NgramDrafter(num_tokens=2)
    gen = SpeculativeGenerator(
        base, [drafter, lookup], adaptive=[None, {"parts": [{"choices": [[0]]}, {"num_tokens": 5}]}]
    )
    assert gen.drafter.drafters[0].tree.num_nodes == 3 and lookup.num_tokens == 2
    assert gen.drafter.enabled == [True, True]
    from inference import UnionDrafter  # a union in a union: its members untouched as well

    inner = UnionDrafter([drafter, lookup])
    nested = {"parts": [{"parts": [{"choices": [[0]]}, {"num_tokens": 7}]}, {}]}
    SpeculativeGenerator(base, [inner, NgramDrafter(num_tokens=3)], adaptive=[None, nested])
    assert drafter.tree.num_nodes == 3 and lookup.num_tokens == 2
    # and so are arms assigned afterwards (which start the measurements afresh)
    with pytest.raises(ValueError, match=r"adaptive arm .*tree depth 3 needs 3 heads"):
        gen.arms = [None, {"parts": [deep, {}]}]
    with pytest.raises(ValueError, match=r"adaptive arms mix \{\}"):
        gen.arms = [None, {}, {"parts": [{"choices": [[0]]}, {}]}]
