"""Lossless sampling end to end: the empirical law of generated tokens 2-3 under speculative
sampling equals the exact law computed from the base, for point-mass and sampled drafters, at
temperature 1, with top-p < 1 and with top-k; and using q for top-k chosen tokens is caught."""

import math

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import (
    Draft,
    Drafter,
    MedusaDrafter,
    ModelDrafter,
    NgramDrafter,
    NgramTable,
    SpeculativeGenerator,
    UnionDrafter,
    tree_from_parents,
)
from inference.acceptance import warp_probs
from inference.draft import Sampling
from tests.conftest import TINY, make_tiny_llama

V = 8
SAMPLES = 1500
SCALE = 8  # logits scale: spread enough for power, peaked enough for acceptances
PROMPT = torch.tensor([[1, 5, 3, 6, 2, 7]])


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def peaky_tiny(seed=0, vocab_size=V):
    """A tiny Llama over 8 tokens (or `vocab_size`) whose next-token distributions are far from
    uniform."""
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    base = make_tiny_llama(seed=seed, vocab_size=vocab_size, **ids)
    base.lm_head.weight.mul_(SCALE)
    return base


def peaky_granite(seed=0):
    """peaky_tiny as a Granite, whose forward divides its logits by `logits_scaling` after the
    lm_head: the law to match is the forward's."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(seed)
    overrides = dict(vocab_size=V, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config = GraniteConfig(**{**TINY, **overrides, "logits_scaling": 2.0})
    config._attn_implementation = "sdpa"
    base = GraniteForCausalLM(config).eval().requires_grad_(False)
    base.lm_head.weight.mul_(SCALE * 2)
    return base


def exact_law(base, temperature, top_p, top_k=0):
    """P(x2, x3) for the first three generated tokens, marginalised over x1: (V, V)."""
    T = PROMPT.shape[1]
    seqs = torch.tensor([[a, b] for a in range(V) for b in range(V)], device=base.device)
    ids = torch.cat([PROMPT.to(base.device).expand(V * V, T), seqs], 1)  # (V*V, T+2)
    probs = warp_probs(base(ids).logits.float(), temperature, top_k, top_p)  # (V*V, T+2, V)
    p1 = probs[0, T - 1]  # (V,)
    p2 = probs[::V, T]  # rows for x1 = a: (V, V)
    p3 = probs[:, T + 1].reshape(V, V, V)  # [a, b, c]
    joint = p1[:, None, None] * p2[:, :, None] * p3  # (x1, x2, x3)
    return joint.sum(0)


def chi_square(gen, base, first_seed, temperature=1.0, top_p=1.0, top_k=0):
    """Pearson's statistic of tokens 2-3 of SAMPLES answers (seeds from `first_seed` on) against
    the exact law, and its critical value at significance 1e-3. Asserts that no answer holds a
    pair the law gives no mass (top_p / top_k's cut), and that drafted tokens were accepted in
    some answers (else the test would say nothing about the drafter)."""
    counts = torch.zeros(V, V)
    drafted = 0  # answers with a drafted token accepted
    for seed in range(first_seed, first_seed + SAMPLES):
        out = gen.generate(
            PROMPT,
            max_new_tokens=3,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            eos_token_id=[],
        )
        x = out.sequences[0, -2:]
        counts[x[0], x[1]] += 1
        drafted += max(out.accepted_lengths, default=1) > 1
    expected = exact_law(base, temperature, top_p, top_k) * SAMPLES
    assert counts[expected == 0].sum() == 0, "emitted a pair the warped law cannot produce"
    assert drafted >= SAMPLES // 20, f"drafted tokens accepted in {drafted} of {SAMPLES} answers"
    cells = expected > 5  # the rest are pooled into one cell
    stat = (((counts - expected) ** 2 / expected)[cells]).sum()
    rest_o, rest_e = counts[~cells].sum(), expected[~cells].sum()
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
    df = int(cells.sum()) + int(rest_e > 0) - 1
    z = 3.09  # significance 1e-3, Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return float(stat), critical


def _gen(kind, lazy_logits=None):
    base = peaky_tiny()
    if kind == "medusa-topk":  # point masses on a static tree
        heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
        return base, SpeculativeGenerator(
            base, heads, lazy_logits=lazy_logits, choices=[(0,), (1,), (0, 0), (1, 0)]
        )
    if kind == "granite-medusa-topk":
        base = peaky_granite()
        heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
        return base, SpeculativeGenerator(base, heads, choices=[(0,), (1,), (0, 0), (1, 0)])
    if kind == "eagle-topk":
        draft = EagleDraft(EagleConfig.from_base(base.config, version=1))
        return base, SpeculativeGenerator(base, draft, top_k=2, depth=2, total_tokens=5)
    if kind == "draft-model-sampled":  # chains sampled from q, accepted with min(1, p/q)
        return base, SpeculativeGenerator(base, peaky_tiny(seed=3), num_tokens=2)
    if kind == "draft-model-padded":  # a draft over the first 6 of the base's 8 tokens
        return base, SpeculativeGenerator(base, peaky_tiny(seed=3, vocab_size=6), num_tokens=2)
    if kind == "draft-model-tree":  # point masses: the draft's ranked tokens on a static tree
        return base, SpeculativeGenerator(
            base, peaky_tiny(seed=3), choices=[(0,), (1,), (0, 0), (1, 0)]
        )
    if kind == "ngram-corpus":  # point-mass chains from a table of the base's greedy answers
        rng = torch.Generator().manual_seed(5)  # on the CPU, also under a CUDA default device
        prompts = torch.randint(3, base.config.vocab_size, (8, 3), generator=rng, device="cpu")
        prompts = prompts.to(base.device)
        answers = base.generate(prompts, max_new_tokens=12, do_sample=False, eos_token_id=None)
        table = NgramTable(answers[:, 3:].tolist(), min_count=1)
        return base, SpeculativeGenerator(base, NgramDrafter(num_tokens=2, corpus=table))
    if kind == "union-sampled+topk":  # sampled and point-mass siblings under one root
        heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
        drafters = [
            MedusaDrafter(heads, [(0,), (1,), (0, 0)]),
            ModelDrafter(peaky_tiny(seed=3), num_tokens=2),
            NgramDrafter(num_tokens=2),
        ]
        return base, SpeculativeGenerator(base, drafters, lazy_logits=lazy_logits)
    if kind == "union-two-sampled":  # two draft models' chains: siblings from two qs
        drafters = [
            ModelDrafter(peaky_tiny(seed=3), num_tokens=2),
            ModelDrafter(peaky_tiny(seed=4), num_tokens=2),
        ]
        return base, SpeculativeGenerator(base, drafters, lazy_logits=lazy_logits)
    if kind == "union-nested-sampled":  # the same as a union inside a union, with a lookup
        inner = [
            ModelDrafter(peaky_tiny(seed=3), num_tokens=2),
            ModelDrafter(peaky_tiny(seed=4), num_tokens=2),
        ]
        drafters = [UnionDrafter(inner), NgramDrafter(num_tokens=2)]
        return base, SpeculativeGenerator(base, drafters, lazy_logits=lazy_logits)
    raise ValueError(kind)


KINDS = [
    "medusa-topk",
    "eagle-topk",
    "draft-model-sampled",
    "draft-model-tree",
    "ngram-corpus",
    "union-sampled+topk",
    "union-two-sampled",
    "union-nested-sampled",
    "granite-medusa-topk",
    "draft-model-padded",
]


def seeds(kind: str, test: int) -> int:
    """The first seed of a block of its own for each kind in each test: runs that share seeds
    share their luck, and the tests' low p-values would come together."""
    return 10_000 * (len(KINDS) * test + KINDS.index(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_sampling_matches_base_law(kind):
    base, gen = _gen(kind)
    stat, critical = chi_square(gen, base, seeds(kind, 0))
    assert stat < critical, (kind, stat, critical)


@pytest.mark.parametrize("kind", ["medusa-topk", "union-sampled+topk", "union-two-sampled"])
def test_speculative_sampling_matches_base_law_row_by_row(kind):
    """The verifier that computes only the lm_head rows it visits (the CPU default for trees
    over 16 nodes; these small trees take it when forced)."""
    base, gen = _gen(kind, lazy_logits=True)
    stat, critical = chi_square(gen, base, seeds(kind, 1))
    assert stat < critical, (kind, stat, critical)


@pytest.mark.parametrize("kind", ["medusa-topk", "draft-model-sampled"])
def test_speculative_sampling_matches_base_law_top_p(kind):
    base, gen = _gen(kind)
    stat, critical = chi_square(gen, base, seeds(kind, 2), temperature=1.0, top_p=0.7)
    assert stat < critical, (kind, stat, critical)


@pytest.mark.parametrize("kind", ["medusa-topk", "draft-model-sampled"])
def test_speculative_sampling_matches_base_law_top_k(kind):
    """top_k (with a temperature and top_p beside it, applied in HF's order): the draft model
    samples from its own q warped the same way, the verifier from the warped p."""
    base, gen = _gen(kind)
    stat, critical = chi_square(gen, base, seeds(kind, 3), temperature=0.8, top_p=0.95, top_k=3)
    assert stat < critical, (kind, stat, critical)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    "settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.9)]
)
def test_a_draft_model_reports_the_law_it_draws_its_chain_from(settings, padded):
    """Row i of a sampled chain's draft_probs is the draft model's warped law after node i, from
    a fresh forward of the sequence and the chain so far (the verifier's min(1, p/q) needs the q
    each token was drawn from: a q misreported at 1.15 T passes the law tests above at 1,500
    answers), and the first drafted token follows row 0 (Pearson over 1,000 draws; a padded
    draft's law is 0 past its 6 tokens)."""
    model = peaky_tiny(seed=3, vocab_size=6 if padded else V)  # padded: the first 6 tokens
    drafter = ModelDrafter(model, num_tokens=3, vocab_size=V)
    rows = model.config.vocab_size  # a padded draft reads a token past it as 0
    sequence, counts, draws = PROMPT[0], torch.zeros(V), 1000
    for seed in range(draws):
        sampling = Sampling(**settings, generator=torch.Generator().manual_seed(seed))
        draft = drafter.propose(sequence, sampling)
        assert draft.sampled.tolist() == [False, True, True, True]
        counts[draft.tokens[1]] += 1
        if seed < 4:
            for i in range(3):
                ids = torch.cat([sequence, draft.tokens[1 : i + 1]])[None]
                logits = torch.full((V,), float("-inf"))
                logits[:rows] = model(torch.where(ids < rows, ids, 0)).logits[0, -1].float()
                q = warp_probs(
                    logits,
                    settings["temperature"],
                    settings.get("top_k", 0),
                    settings.get("top_p", 1.0),
                )
                torch.testing.assert_close(draft.draft_probs[i], q)
                assert q[draft.tokens[i + 1]] > 0
            assert not draft.draft_probs[3].any()  # a leaf: nothing drawn from it
    expected = draft.draft_probs[0] * draws
    cells = expected > 5
    assert counts[~cells].sum() <= 5 * (~cells).sum()  # the rest all but never drawn
    stat = ((counts - expected)[cells] ** 2 / expected[cells]).sum()
    df = int(cells.sum()) - 1
    assert df >= 1 and torch.special.gammaincc(torch.tensor(df / 2), stat / 2) > 1e-3, (stat, df)


class TopKAsSampled(Drafter):
    """The bug the verifier must not have: a draft model's argmax chain reported as if it were
    sampled from q, so that the min(1, p/q) rule is applied to deterministic tokens."""

    max_nodes = 3

    def __init__(self, draft_model):
        self.model = draft_model

    def propose(self, sequence, sampling):
        tokens, rows = [int(sequence[-1])], []
        seq = sequence.clone()
        for _ in range(2):
            q = warp_probs(
                self.model(seq[None]).logits[0, -1].float(), sampling.temperature, 0, 1.0
            )
            tokens.append(int(q.argmax()))
            rows.append(q)
            seq = torch.cat([seq, seq.new_tensor([tokens[-1]])])
        return Draft(
            tree_from_parents([-1, 0, 1]),
            torch.tensor(tokens),
            torch.tensor([False, True, True]),
            torch.stack([*rows, torch.zeros(V)]),
        )


@pytest.mark.parametrize("lazy_logits", [False, True])
def test_negative_control_q_rule_on_argmax_tokens_fails(lazy_logits):
    base = peaky_tiny()
    gen = SpeculativeGenerator(
        base, TopKAsSampled(peaky_tiny(seed=3)), adaptive=False, lazy_logits=lazy_logits
    )
    stat, critical = chi_square(gen, base, seeds("medusa-topk", 4))
    assert stat > critical, (stat, critical)
