"""The core invariant (greedy output == the base's greedy output) for every drafter, the decode
loop's contract (EOS, stop strings, streaming, stats, batch > 1), and KV-cache compaction."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads, load_heads
from heads.cpu import can_prepack, prepack_linear_weights
from inference import (
    MedusaDrafter,
    ModelDrafter,
    NgramDrafter,
    NgramTable,
    SpeculativeGenerator,
    tree_from_parents,
)
from inference.generate import DENSE_LOGITS_MAX_NODES
from inference.kv_cache import keep_accepted
from inference.mask import tree_attention_mask, tree_position_ids
from inference.tree import DEFAULT_ACCURACIES, build_static_tree
from tests.conftest import make_tiny_llama

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from bench_verify import OracleDrafter  # noqa: E402  (scripts/ is not a package)

DRAFTERS = [  # the names `_drafter` knows
    "medusa",
    "medusa-shared",
    "eagle1",
    "eagle3",
    "eagle3-chain",
    "eagle3-wide",
    "eagle3-static",
    "eagle1-static",
    "draft-model",
    "draft-model-static",
    "self-draft",
    "self-draft-static",
    "ngram",
    "ngram-corpus",
    "medusa+ngram",
    "eagle3+ngram",
    "draft-model-static+ngram",
]


def _drafters(base):
    eagle3 = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=64))
    eagle3.set_vocab_map(torch.arange(0, 256, 4))
    medusa = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=3)).init_from_base(base)
    return {
        "medusa": (medusa, {"choices": "cpu-8"}),
        "medusa-shared": (
            MedusaHeads(
                MedusaConfig.from_base(base.config, num_heads=2, original_lm_head=True)
            ).init_from_base(base),
            {"choices": "chain-2"},
        ),
        "eagle1": (
            EagleDraft(EagleConfig.from_base(base.config, version=1)),
            {"top_k": 3, "depth": 3, "total_tokens": 8},
        ),
        "eagle3": (eagle3, {"top_k": 2, "depth": 4, "total_tokens": 10}),
        "eagle3-chain": (eagle3, {"top_k": 1, "depth": 3, "total_tokens": 4}),
        "eagle3-wide": (eagle3, {"top_k": 4, "depth": 1, "total_tokens": 5}),  # one level
        # static trees: three levels, a node with two children, a leaf beside a deeper branch
        "eagle3-static": (
            eagle3,
            {"choices": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 1, 0)]},
        ),
        "eagle1-static": (
            EagleDraft(EagleConfig.from_base(base.config, version=1)),
            {"choices": "cpu-8"},
        ),
        "draft-model": (make_tiny_llama(seed=1), {"num_tokens": 3}),
        # a static tree drafted with the base's attention (a tree mask on eager and sdpa)
        "draft-model-static": (
            make_tiny_llama(seed=1, attn=base.config._attn_implementation),
            {"choices": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 1, 0)]},
        ),
        "self-draft": (base, {"num_tokens": 4}),  # a perfect draft model
        "self-draft-static": (
            base,
            {"choices": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]},
        ),
        "ngram": (None, {"num_tokens": 4}),
        # Unions: fixed settings (drafter objects), and adaptive over the union's arms.
        "medusa+ngram": ([MedusaDrafter(medusa, "cpu-8"), NgramDrafter(num_tokens=4)], {}),
        "eagle3+ngram": ([eagle3, None], {}),
        "draft-model-static+ngram": (
            [ModelDrafter(base, choices=[(0,), (1,), (0, 0)]), NgramDrafter(num_tokens=4)],
            {},
        ),
    }


def _drafter(base, name: str):
    """(heads or drafter, generator options) of one of DRAFTERS."""
    if name == "ngram-corpus":  # built only when asked for: it runs the base
        return None, {"num_tokens": 4, "corpus": _own_answers(base)}
    return _drafters(base)[name]


def _own_answers(base) -> NgramTable:
    """The base's greedy answers to other prompts, plus noise: right and wrong proposals."""
    rng = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, 256, (8, 4), generator=rng).to(base.device)
    answers = base.generate(prompts, max_new_tokens=24, do_sample=False, eos_token_id=None)
    noise = torch.randint(3, 256, (8, 24), generator=rng)
    return NgramTable([*answers[:, 4:].tolist(), *noise.tolist()], min_count=1)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "sdpa-prepacked"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_equals_base_greedy(name, attn):
    base = make_tiny_llama(attn=attn.removesuffix("-prepacked"))
    heads, options = _drafter(base, name)
    if attn.endswith("-prepacked"):  # oneDNN's packed weights, as load_base does on CPU
        for module in (base, heads):
            if isinstance(module, torch.nn.Module):
                assert prepack_linear_weights(module) > 0 or not can_prepack()
    # sdpa runs the row-by-row verifier, eager the dense one (as on a GPU), prepacked the
    # default (on a CPU dense for trees of up to 16 nodes: every tree here).
    lazy = {"sdpa": True, "eager": False, "sdpa-prepacked": None}[attn]
    check_greedy_equals_base(base, heads, options, name, lazy_logits=lazy)


def test_default_verifier_is_dense_for_small_cpu_trees_and_lazy_for_large():
    """On a CPU the default computes every lm_head row of trees up to DENSE_LOGITS_MAX_NODES
    in one call and visits larger trees row by row; both keep the base's greedy output."""
    base = make_tiny_llama()
    heads, _ = _drafters(base)["eagle3"]
    assert SpeculativeGenerator(base, heads).dense_logits_max_nodes == DENSE_LOGITS_MAX_NODES
    assert SpeculativeGenerator(base, heads, lazy_logits=True).dense_logits_max_nodes == 1
    assert SpeculativeGenerator(base, heads, lazy_logits=False).dense_logits_max_nodes is None
    calls = []  # rows of each call by the generator: (N,H) or one row (H,); HF's are (B,T,H)

    def record(module, args, out):
        if args[0].dim() < 3:
            calls.append(args[0].shape[0] if args[0].dim() == 2 else 1)

    base.lm_head.register_forward_hook(record)
    for total in (DENSE_LOGITS_MAX_NODES, DENSE_LOGITS_MAX_NODES + 8):
        calls.clear()
        options = {"top_k": 4, "depth": 4, "total_tokens": total}
        check_greedy_equals_base(base, heads, options, f"eagle3 {total}", lazy_logits=None)
        # Past the prefill's row, a step's call holds its whole tree or one row.
        rows = set(calls) - {1}
        assert rows == ({total} if total <= DENSE_LOGITS_MAX_NODES else set()), (total, rows)


@pytest.mark.parametrize("name", ["medusa", "medusa-shared", "eagle1", "eagle3"])
def test_heads_loaded_in_bf16_on_an_fp32_base(name, tmp_path):
    """`load_heads(..., dtype=torch.bfloat16)` on an fp32 base: the drafters cast the base's
    states to the heads' dtype and back, and the output stays the base's."""
    base = make_tiny_llama()
    heads, options = _drafters(base)[name]
    heads.save_pretrained(tmp_path)
    loaded = load_heads(tmp_path, base, dtype=torch.bfloat16)
    assert any(p.dtype == torch.bfloat16 for p in loaded.parameters())
    check_greedy_equals_base(base, loaded, options, name, lazy_logits=True)


def check_greedy_equals_base(
    base, heads, options: dict, name: str, lazy_logits: bool | None
) -> None:
    """Speculative greedy output == `base.generate` greedy output on 4 prompts (also the CUDA
    tests' check); on the base's device."""
    gen = SpeculativeGenerator(base, heads, lazy_logits=lazy_logits, **options)
    for seed in range(4):
        torch.manual_seed(100 + seed)
        # Repetitive prompts give n-gram and fresh Medusa heads real hits.
        prompt = torch.randint(3, 256, (1, 6)).repeat(1, 1 + seed)
        ref = base.generate(prompt, max_new_tokens=32, do_sample=False)
        out = gen.generate(prompt, max_new_tokens=32)
        assert out.sequences.device == base.device
        assert torch.equal(out.sequences, ref), f"{name} seed {seed}"
        assert sum(out.accepted_lengths) + 1 == out.sequences.shape[1] - prompt.shape[1]
        if name.startswith("self-draft"):
            assert out.mean_accepted_length > 4.0  # every top-1 drafted token is accepted


def test_good_tree_drafts_are_accepted_and_exact():
    base = make_tiny_llama()
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(3, 256, (1, 8))
        ref = base.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None)
        truth = base.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None)
        # The base's greedy continuation as one branch, a wrong sibling before it at each level
        # (so the verifier must pick the right branch).
        oracle = OracleDrafter(truth[0].tolist(), depth=4, width=2, vocab_size=256, device="cpu")
        out = SpeculativeGenerator(base, oracle, adaptive=False).generate(
            prompt, max_new_tokens=40, eos_token_id=[]
        )
        assert torch.equal(out.sequences, ref)
        assert min(out.accepted_lengths[:-1]) == 5  # 4 drafted + the bonus, every step


def test_keep_accepted_equals_plain_forward():
    base = make_tiny_llama()
    prefix = torch.randint(3, 256, (1, 7))
    cache = DynamicCache(config=base.config)
    base(prefix, cache=cache, use_cache=True)
    tree = tree_from_parents([-1, 0, 0, 1, 2, 3])  # root -> {a, b}, a -> c -> e, b -> d
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16]])
    mask = tree_attention_mask(tree, 7, torch.float32)
    base(
        tokens,
        attention_mask=mask,
        position_ids=tree_position_ids(tree, 7),
        cache=cache,
        use_cache=True,
    )
    accepted = torch.tensor([0, 1, 3, 5])  # root, a, c, e
    keep_accepted(cache, 7, accepted)
    plain = DynamicCache(config=base.config)
    base(torch.cat([prefix, tokens[:, accepted]], 1), cache=plain, use_cache=True)
    assert cache.get_seq_length() == plain.get_seq_length() == 11
    for ours, ref in zip(cache.layers, plain.layers):
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, ref.values, atol=1e-5, rtol=1e-5)


def test_eos_stop_strings_streaming_and_stats():
    base = make_tiny_llama()
    prompt = torch.randint(3, 256, (1, 6))
    ref = base.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)[
        0, 6:
    ].tolist()
    gen = SpeculativeGenerator(base, base, num_tokens=3)
    eos = ref[5]
    out = gen.generate(prompt, max_new_tokens=20, eos_token_id=eos)
    assert out.sequences[0, 6:].tolist() == ref[: ref.index(eos) + 1] and out.finished
    steps = list(gen.stream(prompt, max_new_tokens=20, eos_token_id=[]))
    assert sum(steps, []) == ref and steps[0] == ref[:1]
    full = gen.generate(prompt, max_new_tokens=20, eos_token_id=[])
    assert not full.finished and full.sequences.shape[1] == 26
    assert set(full.timings) == {"base", "draft", "other", "total"} and full.timings["total"] > 0

    class Tok:  # a tokenizer whose text is the token ids
        def decode(self, ids):
            return " ".join(map(str, ids))

    stop = f"{ref[3]} {ref[4]}"
    out = gen.generate(
        prompt, max_new_tokens=20, eos_token_id=[], stop_strings=[stop], tokenizer=Tok()
    )
    new = out.sequences[0, 6:].tolist()
    assert stop in Tok().decode(new) and out.finished
    assert stop not in Tok().decode(new[:-1])  # cut at the token that completes it, as HF does
    assert new == ref[: len(new)]
    assert out.sequences.shape[1] - 6 < 20


def test_bad_input_is_clear():
    base = make_tiny_llama()
    gen = SpeculativeGenerator(base)
    with pytest.raises(ValueError, match="batch size 2"):
        gen.generate(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        gen.generate(torch.ones(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="tokenizer"):
        gen.generate(torch.ones(1, 3, dtype=torch.long), stop_strings=["x"])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        gen.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=0)
    for bad in ({"temperature": -0.5}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match="need temperature >= 0 .* 0 < top_p <= 1"):
            gen.generate(torch.ones(1, 3, dtype=torch.long), **bad)
    with pytest.raises(ValueError, match="share the base's tokenizer"):
        SpeculativeGenerator(base, make_tiny_llama(vocab_size=128))
    with pytest.raises(TypeError, match="MedusaHeads, EagleDraft"):
        SpeculativeGenerator(base, object())


def test_a_tree_that_no_longer_fits_the_context_gives_way_to_plain_steps():
    base = make_tiny_llama()  # 512 positions
    limit = base.config.max_position_embeddings
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=3)).init_from_base(base)
    prompt = torch.randint(3, base.config.vocab_size, (1, limit - 12), generator=_seeded(0))
    ref = base.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert ref.shape[1] == limit
    for gen in (
        SpeculativeGenerator(base, heads, choices="cpu-8"),
        SpeculativeGenerator(base, heads),
    ):
        with pytest.warns(UserWarning, match="context length .512 positions. after 12 of"):
            out = gen.generate(prompt, max_new_tokens=50, eos_token_id=[])
        # an 8-node tree stops fitting 8 tokens before the end: plain steps fill the rest
        assert torch.equal(out.sequences, ref)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_same_first_draft(drafter_cls, prompt, first, second) -> None:
    """The two generators' drafters (of `drafter_cls`) propose the same first tree for `prompt`."""
    propose, drafts = drafter_cls.propose, []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            drafter_cls, "propose", lambda s, q, m: drafts.append(propose(s, q, m)) or drafts[-1]
        )
        for gen in (first, second):
            gen.generate(prompt, max_new_tokens=2)  # the prefill's token, then one step
    assert len(drafts) == 2
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    assert torch.equal(drafts[0].tree.parents, drafts[1].tree.parents)


DRAFT_TREES = {
    # (2,) and (0, 1) are leaves beside branches, so level 2's frontier is partial
    "three-levels": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0)],
    # frontiers of 2, 1 and 1 nodes: level 3 attends past cached non-ancestors of two depths
    "four-levels": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)],
    "one-level": [(0,), (1,), (2,)],
}


@pytest.mark.parametrize("shape", DRAFT_TREES)
def test_eagle_static_tree_nodes_hold_their_parents_ranked_tokens(shape):
    import copy

    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=64))
    draft.set_vocab_map(torch.arange(0, 256, 4))
    torch.manual_seed(3)
    for p in draft.parameters():  # a draft with opinions, so that ranks differ
        p.data.normal_(0, 0.5)
    choices = DRAFT_TREES[shape]
    seen = []  # (draft cache and root output before the proposal, the draft, cache length after)
    propose = EagleDrafter.propose

    def spy(self, sequence, sampling):
        self.catch_up(sequence)
        before = (copy.deepcopy(self.cache), self._root_hidden.clone())
        out = propose(self, sequence, sampling)
        seen.append((before, out, self.cache.get_seq_length()))
        return out

    prompt = torch.randint(3, 256, (1, 12), generator=_seeded(1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleDrafter, "propose", spy)
        gen = SpeculativeGenerator(base, draft, choices=choices)
        gen.generate(prompt, max_new_tokens=12)
    drafter = gen.drafter
    assert len(seen) >= 3
    ordered = sorted(choices, key=lambda c: (len(c), c))  # the tree's node order
    for (cache, root_hidden), proposal, length_after in seen[:3]:
        prefix = cache.get_seq_length()
        assert length_after == prefix  # the tree's entries were cropped from the draft cache
        # Reference: each node's path fed causally, one token at a time, on a copy of the cache.
        token = {(): proposal.tokens[0]}
        for c in ordered:
            h, path_cache = root_hidden, copy.deepcopy(cache)
            for i in range(1, len(c)):
                pos = torch.tensor([[prefix - 1 + i]])
                h = draft(
                    drafter.embed(token[c[:i]])[None, None], h[None, None], pos, cache=path_cache
                )[0, -1]
            ranked = drafter._log_probs(h[None]).topk(c[-1] + 1, dim=-1).indices[0]
            token[c] = draft.to_base_ids(ranked[c[-1]])
        assert proposal.tokens.tolist() == [int(token[c]) for c in [(), *ordered]]
    if shape != "one-level":  # ranks at different parents name different tokens
        assert len({int(t) for t in seen[0][1].tokens[1:]}) > 3
    # a static chain drafts what EAGLE-2's top_k=1 chain does
    _assert_same_first_draft(
        EagleDrafter,
        prompt,
        SpeculativeGenerator(base, draft, choices="chain-3"),
        SpeculativeGenerator(base, draft, top_k=1, depth=3, total_tokens=4),
    )


def test_an_eagle_dynamic_tree_ranks_the_tokens_of_the_one_level_static_tree():
    """A dynamic tree's `root_ranking` is the draft's top k at the root, best first: the tokens
    of the static tree [(0,), ..., (k-1,)] at the same step (what the adaptive policy scores it
    as), whichever of them the reranked tree kept."""
    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=64))
    draft.set_vocab_map(torch.arange(0, 256, 4))
    torch.manual_seed(3)
    for p in draft.parameters():  # a draft with opinions, so that some of the top 4 are dropped
        p.data.normal_(0, 0.5)
    one_level = [(0,), (1,), (2,), (3,)]
    dropped = []  # per step, how many of the root's top 4 the reranked tree left out
    propose = EagleDrafter.propose

    def both(self, sequence, sampling):
        dynamic = propose(self, sequence, sampling)
        self.configure(choices=one_level)
        static = propose(self, sequence, sampling)
        self.configure(top_k=4, depth=2, total_tokens=6)
        assert (
            static.root_ranking is None
            and dynamic.root_ranking.tolist() == static.tokens[1:].tolist()
        )
        level_one = dynamic.tokens[1:][dynamic.tree.depths[1:] == 1]
        assert set(level_one.tolist()) <= set(dynamic.root_ranking.tolist())
        dropped.append(4 - level_one.numel())
        return dynamic

    prompt = torch.randint(3, 256, (1, 12), generator=_seeded(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleDrafter, "propose", both)
        gen = SpeculativeGenerator(base, draft, top_k=4, depth=2, total_tokens=6)
        out = gen.generate(prompt, max_new_tokens=16)
    assert torch.equal(out.sequences, base.generate(prompt, max_new_tokens=16, do_sample=False))
    assert len(dropped) >= 4 and any(dropped)


def test_eagle_options_are_a_dynamic_or_a_static_tree():
    from inference.drafters.eagle import EagleDrafter

    base = make_tiny_llama()
    drafter = EagleDrafter(EagleDraft(EagleConfig.from_base(base.config, version=1)), base)
    assert (drafter.top_k, drafter.depth, drafter.total_tokens) == (4, 4, 12)  # the defaults
    drafter.configure(choices=[(0,), (0, 0)])
    assert (drafter.top_k, drafter.depth, drafter.max_nodes) == (None, 2, 3)
    for mixed in ({"choices": "chain-2", "top_k": 2}, {"depth": 2}, {}):
        with pytest.raises(ValueError, match="either top_k, depth and total_tokens .* or choices"):
            drafter.configure(**mixed)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("shape", DRAFT_TREES)
def test_draft_model_static_tree_nodes_hold_their_parents_ranked_tokens(attn, shape):
    base = make_tiny_llama()
    small = make_tiny_llama(seed=1, attn=attn)
    torch.manual_seed(3)
    for p in small.parameters():  # sharp attention, so that positions and masks matter
        if p.dim() == 2:
            p.data.normal_(0, 0.3)
    choices = DRAFT_TREES[shape]
    seen = []  # (the sequence, the draft, the draft cache's length after it, the tokens fed)
    widths = []  # tokens per forward of the draft model
    per_proposal = []  # the widths of each proposal's forwards
    propose = ModelDrafter.propose

    def spy(self, sequence, sampling):
        start = len(widths)
        out = propose(self, sequence, sampling)
        seen.append((sequence.clone(), out, self.cache.get_seq_length(), list(self._fed)))
        per_proposal.append(widths[start:])
        return out

    hook = small.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    prompt = torch.randint(3, 256, (1, 12), generator=_seeded(1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelDrafter, "propose", spy)
        gen = SpeculativeGenerator(base, small, choices=choices)
        gen.generate(prompt, max_new_tokens=12)
    hook.remove()
    # the new tokens fed, then one forward per level over the nodes that have children
    levels = {"three-levels": [2, 2], "four-levels": [2, 1, 1], "one-level": []}[shape]
    assert all(w[1:] == levels for w in per_proposal), per_proposal
    assert len(seen) >= 3
    ordered = sorted(choices, key=lambda c: (len(c), c))  # the tree's node order
    for sequence, proposal, length_after, fed in seen[:3]:
        # the tree's entries were cropped: the cache holds the sequence, root included
        assert length_after == sequence.numel() and fed == sequence.tolist()
        # Reference: each node's parent path fed causally from scratch, no cache.
        token = {(): int(sequence[-1])}
        for c in ordered:
            path = [token[c[:i]] for i in range(1, len(c))]
            ids = torch.tensor([sequence.tolist() + path])
            token[c] = int(small(ids).logits[0, -1].topk(c[-1] + 1).indices[c[-1]])
        assert proposal.tokens.tolist() == [token[c] for c in [(), *ordered]]
        assert not proposal.sampled.any()  # point masses, at any temperature
    if shape != "one-level":  # ranks at different parents name different tokens
        assert len({int(t) for t in seen[0][1].tokens[1:]}) > 3
    # a static chain drafts what the greedy chain does
    _assert_same_first_draft(
        ModelDrafter,
        prompt,
        SpeculativeGenerator(base, small, choices="chain-3"),
        SpeculativeGenerator(base, small, num_tokens=3),
    )


def test_draft_model_options_are_a_chain_or_a_static_tree():
    drafter = ModelDrafter(make_tiny_llama(seed=1))
    assert (drafter.num_tokens, drafter.max_nodes) == (4, 5)  # the default chain
    drafter.configure(choices="cpu-8")
    assert (drafter.num_tokens, drafter.max_nodes) == (None, 8)
    drafter.configure(num_tokens=2)
    assert (drafter.static, drafter.max_nodes) == (None, 3)
    for mixed in ({"choices": "chain-2", "num_tokens": 2}, {}):
        with pytest.raises(ValueError, match="either num_tokens .* or choices"):
            drafter.configure(**mixed)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        drafter.configure(num_tokens=0)
    with pytest.raises(ValueError, match="needs its prefix"):
        drafter.configure(choices=[(0, 0)])
    flex = make_tiny_llama(seed=1)
    flex.config._attn_implementation = "flex_attention"  # takes no additive 4D float mask
    assert ModelDrafter(flex, num_tokens=3).max_nodes == 4  # a chain needs no mask
    with pytest.raises(ValueError, match="needs sdpa or eager attention"):
        ModelDrafter(flex, choices="chain-2")
    # nor does the GPU arms' tree come up for it
    gpu_arms = ModelDrafter(flex).default_arms(torch.device("cuda"))
    assert gpu_arms == [None, {"num_tokens": 2}, {"num_tokens": 4}, {"num_tokens": 6}]


def test_draft_model_arms_switch_between_chains_and_a_tree():
    """The GPU arms (chains of 2, 4, 6 tokens, a 16-node tree), run on the CPU with the base as
    its own perfect draft: after every switch each arm drafts from a clean cache, so each step
    gains exactly its depth + 1 tokens, and the output is the base's."""
    base = make_tiny_llama()
    arms = ModelDrafter(base).default_arms(torch.device("cuda"))
    assert arms[-1]["choices"] == build_static_tree(DEFAULT_ACCURACIES, 16)
    gen = SpeculativeGenerator(base, base, adaptive=arms)
    for seed in range(4):
        prompt = torch.randint(3, 256, (1, 8), generator=_seeded(seed))
        ref = base.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert torch.equal(gen.generate(prompt, max_new_tokens=40, eos_token_id=[]).sequences, ref)
    summary = gen.policy.summary()
    assert all(a["steps"] >= gen.policy.warmup for a in summary)
    assert [a["tokens_per_step"] for a in summary] == pytest.approx([1, 3, 5, 7, 5])
