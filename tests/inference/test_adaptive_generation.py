"""The adaptive policy inside the generator: what greedy steps feed it, exactness with arms
switched, the arms each drafter offers, streams sharing a drafter."""

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import MedusaDrafter, NgramDrafter, SpeculativeGenerator
from inference.adaptive import AdaptivePolicy
from inference.draft import Sampling
from inference.drafters.model import ModelDrafter
from tests.conftest import make_tiny_llama


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


def medusa(base):
    return MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)


def test_drafter_objects_fix_the_settings_alone_or_in_a_union():
    base = make_tiny_llama()
    heads = medusa(base)
    assert SpeculativeGenerator(base, MedusaDrafter(heads, "cpu-8")).arms is None
    for union in (
        [MedusaDrafter(heads, "cpu-8"), NgramDrafter(num_tokens=4)],
        (MedusaDrafter(heads, "cpu-8"), NgramDrafter(num_tokens=4)),
    ):
        assert SpeculativeGenerator(base, union).arms is None


def test_a_dynamic_trees_root_ranking_is_scored_against_the_first_new_token():
    """The base's token at the root is the first token a step gains, the accepted child's,
    not the step's last (its bonus)."""
    from inference.draft import Draft, Drafter
    from inference.tree import tree_from_parents

    base = make_tiny_llama()

    class RightChild(Drafter):  # the base's token as the root's one child, ranked second
        max_nodes = 2

        def configure(self, **options):
            pass

        def propose(self, sequence, sampling):
            order = base(sequence[None]).logits[0, -1].argsort(descending=True)
            tokens = torch.stack([sequence[-1], order[0]])
            tree = tree_from_parents([-1, 0])
            return Draft(tree, tokens, torch.zeros(2, dtype=torch.bool), None, order[[1, 0, 2]])

    gen = SpeculativeGenerator(base, RightChild(), adaptive=[{}])
    gen.policy = AdaptivePolicy.from_options(gen.arms, smoothing=1e-9)
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    out = gen.generate(prompt, max_new_tokens=12)
    assert torch.equal(out.sequences, base.generate(prompt, max_new_tokens=12, do_sample=False))
    assert out.accepted_lengths[:-1] == [2] * (out.num_steps - 1)  # the child, then the bonus
    rates = {path: stat[0] for path, stat in gen.policy._paths.items()}
    assert rates == {(0,): 0.0, (1,): 1.0, (2,): 0.0}


def test_a_drafter_of_no_settings_made_adaptive_weighs_itself_against_plain_decoding():
    from inference.draft import Draft, Drafter
    from inference.tree import tree_from_parents

    class RootOnly(Drafter):
        def propose(self, sequence, sampling):
            return Draft(tree_from_parents([-1]), sequence[-1:], torch.zeros(1, dtype=torch.bool))

    gen = SpeculativeGenerator(make_tiny_llama(), RootOnly(), adaptive=True)
    assert gen.arms == [None, {}]


def test_the_output_gives_each_steps_tree_size_plain_steps_one_node():
    """`tree_sizes` tells a plain step (the root alone) from a drafted one: what bench needs to
    score heads only on the steps where they drafted."""
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    choices = [[0], [1], [0, 0]]
    gen = SpeculativeGenerator(base, heads, adaptive=[None, {"choices": choices}])
    prompt = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    out = gen.generate(prompt, max_new_tokens=40)
    assert len(out.tree_sizes) == len(out.accepted_lengths) == out.num_steps
    assert set(out.tree_sizes) == {1, len(choices) + 1}  # both arms ran (each tried first)
    plain, drafted = gen.policy.summary()
    assert out.tree_sizes.count(1) == plain["steps"] and plain["options"] is None
    assert out.tree_sizes.count(len(choices) + 1) == drafted["steps"]
    assert all(n == 1 for n, size in zip(out.accepted_lengths, out.tree_sizes) if size == 1)


def test_the_policy_counts_as_proposals_only_the_steps_a_lookup_drafted_on():
    """An n-gram lookup's step that found nothing verifies the root alone: the policy is told it
    proposed nothing (no failed draft toward backing it off as idle), the others it did."""
    base = make_tiny_llama()
    gen = SpeculativeGenerator(base, NgramDrafter(num_tokens=3), adaptive=[{}])
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 10, 11, 12, 13]])  # one repeat to find
    out = gen.generate(prompt, max_new_tokens=30)
    (lookup,) = gen.policy.arms
    assert lookup.tries == out.num_steps
    assert lookup.proposals == sum(size > 1 for size in out.tree_sizes)
    assert 0 < lookup.proposals < lookup.tries  # found something on some steps, not all


def test_a_stats_dict_given_again_describes_only_the_new_streams_steps():
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    gen = SpeculativeGenerator(base, heads, adaptive=[None, {"choices": [[0], [1], [0, 0]]}])
    prompt = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    stats: dict = {}
    for max_new_tokens in (12, 6):
        steps = list(gen.stream(prompt, max_new_tokens=max_new_tokens, stats=stats))
        # the first yield is the prefill's token; each later one a verify step's
        assert len(stats["tree_sizes"]) == len(stats["accepted_lengths"]) == len(steps) - 1
        assert sum(stats["accepted_lengths"]) + 1 == max_new_tokens
        assert set(stats["tree_sizes"]) <= {1, 4}  # the root alone, or the 3-node tree and root
