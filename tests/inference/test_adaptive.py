import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import SpeculativeGenerator
from inference.adaptive import AdaptivePolicy
from tests.conftest import make_tiny_llama


def test_policy_tries_every_arm_then_exploits_and_explores():
    policy = AdaptivePolicy.from_options([None, {"a": 1}, {"a": 2}], warmup=2, explore_every=5)
    rates = {0: (1, 1.0), 1: (3, 1.0), 2: (2, 1.0)}  # arm 1 gives the most tokens per second
    chosen = []
    for _ in range(30):
        arm = policy.choose()
        chosen.append(arm)
        policy.update(arm, *rates[arm])
    assert chosen[:6] == [0, 0, 1, 1, 2, 2]  # warmup: each arm twice
    later = chosen[6:]
    assert later.count(1) >= 0.7 * len(later)  # mostly the fastest arm
    assert {0, 2} <= set(later)  # and the others are re-measured now and then
    best = max(policy.summary(), key=lambda a: a["tokens_per_s"])
    assert best["options"] == {"a": 1}


def test_policy_follows_a_change_in_acceptance():
    policy = AdaptivePolicy.from_options(
        [None, {"tree": 1}], warmup=1, explore_every=4, smoothing=0.5
    )
    for step in range(60):
        arm = policy.choose()
        tokens = (3 if step < 30 else 1) if arm == 1 else 1  # the drafter stops being accepted
        seconds = 1.5 if arm == 1 else 1.0
        policy.update(arm, tokens, seconds)
    assert policy.choose() == 0 or policy.arms[0].rate > policy.arms[1].rate


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
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(3, 256, (1, 5)).repeat(1, 2)
        ref = base.generate(prompt, max_new_tokens=48, do_sample=False)
        out = gen.generate(prompt, max_new_tokens=48)
        assert torch.equal(out.sequences, ref)
        assert sum(a["steps"] for a in gen.policy.summary()) == out.num_steps


def test_fixed_options_turn_adaptation_off():
    base = make_tiny_llama()
    assert SpeculativeGenerator(base, None, num_tokens=3).arms is None
    assert SpeculativeGenerator(base, None, num_tokens=3, adaptive=True).arms is not None
