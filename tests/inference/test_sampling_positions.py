"""Lossless sampling at every generated position: a martingale test against the base's law.

Given the tokens before it, each sampled token x_t must be drawn from the base's warped law
p_t, whatever happened to reach that prefix (trees accepted in part, adaptive arms switched,
EOS inside a tree, a cut at max_new_tokens). So the residuals onehot(x_t) - p_t have mean zero
given the past, and summed over answers, per position (and per position and previous token)
they are martingale sums with the known covariance sum(diag(p_t) - p_t p_t^T). For many answers
the quadratic form S^T C^+ S of each block is chi-square with rank(C) degrees of freedom given
the blocks of earlier positions (the martingale central limit theorem), so the sum over blocks
is chi-square with the summed ranks.

This checks every position, where test_sampling_generate checks the joint law of tokens 2-3,
on the cases that one leaves out: an EAGLE-3 draft over a reduced vocabulary, adaptive arms
switched at random under sampling, EOS and stop strings under sampling, cuts inside accepted
paths, a draft equal to the base (its deep paths accepted most), a draft model's sampled chains
(q != p), temperatures off 1, and each case on its own block of seeds. A generator sampling at
another temperature than the one judged is caught (so the test can fail)."""

import random

import pytest
import torch

import inference.generate as generate_module
from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from inference import SpeculativeGenerator
from inference.acceptance import verify_sampling, warp_probs
from inference.adaptive import AdaptivePolicy
from tests.inference.test_sampling_generate import (  # one_thread: autouse here too
    PROMPT,
    V,
    one_thread,  # noqa: F401
    peaky_tiny,
)

ANSWERS = 500
NEW_TOKENS = 7  # a last step often accepts more than the room left: cut at max_new_tokens
ALPHA = 1e-3  # each test's two statistics share it (Bonferroni)
MIN_EXPECTED = 5.0  # tokens expected fewer times than this in a block are pooled


def _block(probs: torch.Tensor, tokens: torch.Tensor) -> tuple[float, int]:
    """Martingale statistic of one block: probs (N, V) the laws, tokens (N,) the draws.

    Tokens expected fewer than MIN_EXPECTED times are pooled into one class; a pool still under
    it joins the rarest kept token, so no class is too rare for the normal approximation."""
    expected = probs.sum(0)
    order = expected.argsort(descending=True)
    classes = torch.empty(V, dtype=torch.long)
    kept = int((expected >= MIN_EXPECTED).sum())
    if kept == 0:
        return 0.0, 0
    classes[order[:kept]] = torch.arange(kept)
    rest = order[kept:]
    if len(rest) and float(expected[rest].sum()) >= MIN_EXPECTED:
        classes[rest] = kept
        count = kept + 1
    else:
        classes[rest] = kept - 1
        count = kept
    if count < 2:
        return 0.0, 0
    p = torch.zeros(len(tokens), count, dtype=torch.float64).index_add_(1, classes, probs)
    x = torch.nn.functional.one_hot(classes[tokens], count).double()
    s = (x - p).sum(0)
    cov = torch.diag(p.sum(0)) - p.T @ p
    eig = torch.linalg.eigvalsh(cov)
    rank = int((eig > 1e-9 * eig.max()).sum())
    stat = s @ torch.linalg.pinv(cov, hermitian=True, rtol=1e-9) @ s
    return float(stat), rank


def martingale_test(base, answers, temperature, top_p=1.0, top_k=0) -> dict:
    """p-values of the per-position and per-(position, previous token) statistics of
    `answers` (lists of new tokens after PROMPT) under the base's warped law, and how many
    drawn tokens that law gives probability 0."""
    T, n = PROMPT.shape[1], max(map(len, answers))
    ids = torch.zeros(len(answers), T + n, dtype=torch.long)
    ids[:, :T] = PROMPT
    for i, a in enumerate(answers):
        ids[i, T : T + len(a)] = torch.tensor(a)
    with torch.no_grad():
        logits = base(ids).logits[:, T - 1 : T - 1 + n].float()
    probs = warp_probs(logits, temperature, top_k, top_p).double()  # (N, n, V): law of x_t
    # summing to 1 in float64: else the covariance's null direction (the ones vector) keeps an
    # eigenvalue of float32's rounding, counted as one more degree of freedom per block
    probs = probs / probs.sum(-1, keepdim=True)
    tokens, prev = ids[:, T:], ids[:, T - 1 : T - 1 + n]
    alive = torch.arange(n)[None] < torch.tensor([len(a) for a in answers])[:, None]
    drawn = probs.gather(-1, tokens[..., None])[..., 0]
    result = {"zero_probability": int(((drawn == 0) & alive).sum())}
    for name, strata in (("position", [None]), ("previous", range(V))):
        stat, df = 0.0, 0
        for t in range(n):
            for a in strata:
                rows = alive[:, t] if a is None else alive[:, t] & (prev[:, t] == a)
                if rows.any():
                    s, d = _block(probs[rows, t], tokens[rows, t])
                    stat, df = stat + s, df + d
        # at least 4 a position: most of the 8 tokens expected often enough to be judged
        assert df >= 4 * n, f"{name}: {df} degrees of freedom over {n} positions"
        p = torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0))
        result[name] = float(p)
    return result


def sample(gen, seeds, temperature, top_p=1.0, top_k=0, **options) -> list[list[int]]:
    """One answer of NEW_TOKENS (or to EOS) after PROMPT per seed: its new tokens."""
    T = PROMPT.shape[1]
    out = []
    for seed in seeds:
        o = gen.generate(
            PROMPT,
            max_new_tokens=NEW_TOKENS,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            **{"eos_token_id": [], **options},
        )
        out.append(o.sequences[0, T:].tolist())
    return out


class RandomArms(AdaptivePolicy):
    """Chooses its arm at random each step (from its own generator): any schedule that depends
    only on the past must leave the law alone, as the timing-driven one does."""

    def choose(self) -> int:
        return self.rng.randrange(len(self.arms))


def random_arms(gen, seed):
    gen.policy = RandomArms.from_options(gen.arms)
    gen.policy.rng = random.Random(seed)
    return gen


def _eagle3(base, seed=7):
    """EAGLE-3 over 5 of the 8 tokens (not the first five: the map is exercised)."""
    torch.manual_seed(seed)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=5))
    draft.set_vocab_map(torch.tensor([1, 2, 4, 5, 7]))
    return draft


def _medusa(base, seed=7):
    torch.manual_seed(seed)
    return MedusaHeads(MedusaConfig.from_base(base.config, num_heads=3)).init_from_base(base)


# name: (generator from a base, sampling settings, generate options)
CASES = {
    "eagle3-reduced-vocab": (
        lambda b: SpeculativeGenerator(b, _eagle3(b), top_k=2, depth=2, total_tokens=5),
        dict(temperature=1.0),
        {},
    ),
    "eagle3-reduced-vocab-top-p-hot": (
        lambda b: SpeculativeGenerator(b, _eagle3(b), top_k=3, depth=3, total_tokens=8),
        dict(temperature=1.6, top_p=0.8),
        {},
    ),
    "eagle3-static-tree-cold": (
        lambda b: SpeculativeGenerator(b, _eagle3(b), choices=[(0,), (1,), (0, 0), (0, 0, 0)]),
        dict(temperature=0.6),
        {},
    ),
    "eagle3-random-arms": (
        lambda b: random_arms(
            SpeculativeGenerator(
                b,
                _eagle3(b),
                adaptive=[
                    None,
                    {"choices": [[0], [1], [2]]},
                    {"top_k": 2, "depth": 2, "total_tokens": 5},
                    {"top_k": 3, "depth": 3, "total_tokens": 9},
                ],
            ),
            seed=11,
        ),
        dict(temperature=1.0),
        {},
    ),
    "medusa-random-arms-top-k": (
        lambda b: random_arms(
            SpeculativeGenerator(
                b,
                _medusa(b),
                adaptive=[None, {"choices": [[0], [1]]}, {"choices": [[0], [0, 0], [0, 0, 0]]}],
            ),
            seed=12,
        ),
        dict(temperature=0.9, top_k=4),
        {},
    ),
    "draft-equal-base-chain-eos": (  # q = p: every token accepted, EOS inside the chain
        lambda b: SpeculativeGenerator(b, peaky_tiny(), num_tokens=3),
        dict(temperature=1.0),
        {"eos_token_id": 3},
    ),
    "draft-equal-base-tree-eos": (  # point masses on the base's own ranks: deep paths accepted
        lambda b: SpeculativeGenerator(
            b, peaky_tiny(), choices=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
        ),
        dict(temperature=1.0),
        {"eos_token_id": [3, 6]},
    ),
    "draft-model-sampled-chain-cold": (  # q != p: chains drawn from another model's law
        lambda b: SpeculativeGenerator(b, peaky_tiny(seed=3), num_tokens=3),
        dict(temperature=0.8, top_p=0.9),
        {},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_position_follows_the_base_law(name):
    base = peaky_tiny()
    build, sampling, options = CASES[name]
    gen = build(base)
    first = 1_000_000 * (1 + list(CASES).index(name))  # a block of seeds per case, and
    # none of test_sampling_generate's (under 500,000)
    answers = sample(gen, range(first, first + ANSWERS), **sampling, **options)
    if "eos_token_id" in options:  # EOS ends some answers early, and only at EOS
        eos = options["eos_token_id"]
        eos = {eos} if isinstance(eos, int) else set(eos)
        assert not any(eos & set(a[:-1]) for a in answers)
        short = [a for a in answers if len(a) < NEW_TOKENS]
        assert short and all(a[-1] in eos for a in short)
    if "random-arms" in name:  # the same policy ran every arm, many times
        assert type(gen.policy) is RandomArms
        steps = [a["steps"] for a in gen.policy.summary()]
        assert min(steps) >= ANSWERS // 2, steps
    result = martingale_test(base, answers, **sampling)
    assert result["zero_probability"] == 0, result
    assert min(result["position"], result["previous"]) > ALPHA / 2, (name, result)


def test_stop_strings_under_sampling_cut_the_unstopped_answer():
    """With the same seed and fixed settings, the answer with a stop string is the answer
    without it, cut where the stop string first ends in a new token's text (as HF cuts)."""

    class Letters:  # token i is the letter "abcdefgh"[i]
        def decode(self, ids):
            return "".join("abcdefgh"[i] for i in ids)

    base = peaky_tiny()
    gen = SpeculativeGenerator(base, _eagle3(base), top_k=2, depth=2, total_tokens=5)
    T, text = PROMPT.shape[1], Letters()
    prompt_text = text.decode(PROMPT[0].tolist())
    P = len(prompt_text)
    cut = 0
    for seed in range(9_000_000, 9_000_060):
        full = sample(gen, [seed], 1.0)[0]
        letters = text.decode(full)
        stop = letters[3:5]  # a stop string every answer holds
        out = gen.generate(
            PROMPT,
            max_new_tokens=NEW_TOKENS,
            temperature=1.0,
            seed=seed,
            eos_token_id=[],
            stop_strings=[stop],
            tokenizer=text,
        )
        new = out.sequences[0, T:].tolist()
        # one letter a token: the stop string ends at the first new token whose text ends it
        whole = prompt_text + letters
        end = next(i + 1 for i in range(len(full)) if whole[: P + i + 1].endswith(stop))
        assert new == full[:end] and out.finished, (seed, stop, full, new)
        cut += end < 5  # an earlier occurrence than the one the stop string was taken from
    assert 0 < cut < 60


def test_a_wrong_law_is_caught(monkeypatch):
    """Power: answers sampled at temperature 1.25 judged at 1.0, and a verifier that draws the
    bonus token from p instead of the residual once every root child is rejected (a token just
    rejected may come back: the bug the residual exists to prevent)."""
    base = peaky_tiny()
    gen = SpeculativeGenerator(base, _eagle3(base), top_k=2, depth=2, total_tokens=5)
    answers = sample(gen, range(9_500_000, 9_500_000 + ANSWERS), 1.25)
    assert martingale_test(base, answers, temperature=1.25)["position"] > ALPHA / 2
    wrong = martingale_test(base, answers, temperature=1.0)
    assert min(wrong["position"], wrong["previous"]) < ALPHA / 100, wrong  # far past the level

    def bonus_from_p(tokens, target_probs, tree, *args, **kwargs):
        out = verify_sampling(tokens, target_probs, tree, *args, **kwargs)
        if len(out.nodes) == 1:
            out.bonus_token = int(torch.multinomial(target_probs[0], 1))
        return out

    monkeypatch.setattr(generate_module, "verify_sampling", bonus_from_p)
    answers = sample(gen, range(9_600_000, 9_600_000 + ANSWERS), 1.0)
    biased = martingale_test(base, answers, temperature=1.0)
    assert min(biased["position"], biased["previous"]) < ALPHA / 100, biased
