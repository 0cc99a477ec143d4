"""The core invariant (greedy output == the base's greedy output) for every drafter, the decode
loop's contract (EOS, stop strings, streaming, stats, batch > 1), and KV-cache compaction."""

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads, load_heads
from heads.cpu import can_prepack, prepack_linear_weights
from inference import (
    EagleDrafter,
    MedusaDrafter,
    ModelDrafter,
    NgramDrafter,
    NgramTable,
    SpeculativeGenerator,
    plain_generation,
    tree_from_parents,
)
from inference.generate import DENSE_LOGITS_MAX_NODES
from inference.kv_cache import keep_accepted
from inference.mask import tree_attention_mask, tree_position_ids
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
    rng = torch.Generator().manual_seed(7)  # on the CPU, also under `with torch.device("cuda")`
    prompts = torch.randint(3, 256, (8, 4), generator=rng, device="cpu").to(base.device)
    answers = base.generate(prompts, max_new_tokens=24, do_sample=False, eos_token_id=None)
    noise = torch.randint(3, 256, (8, 24), generator=rng, device="cpu")
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


def test_an_eagle3_vocabulary_map_in_any_order_loads_and_drafts_the_same(tmp_path):
    """A d2t in any one-to-one order (vLLM and SGLang read one; other trainers write them by
    frequency) loads, and drafts as the same draft in sorted order: the same tokens accepted."""
    base = make_tiny_llama()
    eagle3, options = _drafters(base)["eagle3"]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    permuted = EagleDraft(eagle3.config)
    permuted.load_state_dict(eagle3.state_dict())
    permuted.set_vocab_map(torch.arange(0, 256, 4)[perm])
    with torch.no_grad():
        permuted.lm_head.weight.copy_(eagle3.lm_head.weight[perm])
    permuted.save_pretrained(tmp_path)
    loaded = load_heads(tmp_path, base)
    assert torch.equal(loaded.d2t, permuted.d2t) and not torch.equal(loaded.d2t, eagle3.d2t)
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(6)).repeat(1, 3)
    from inference.drafters.eagle import EagleDrafter

    drafts, propose = [], EagleDrafter.propose  # every step's tree, of both generators
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            EagleDrafter, "propose", lambda s, q, m: drafts.append(propose(s, q, m)) or drafts[-1]
        )
        ref = SpeculativeGenerator(base, eagle3, **options).generate(prompt, max_new_tokens=32)
        steps = len(drafts)
        out = SpeculativeGenerator(base, loaded, **options).generate(prompt, max_new_tokens=32)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.accepted_lengths == ref.accepted_lengths
    assert steps > 0 and len(drafts) == 2 * steps
    for mine, theirs in zip(drafts[:steps], drafts[steps:]):  # the same trees, token for token
        assert torch.equal(mine.tokens, theirs.tokens)
        assert torch.equal(mine.tree.parents, theirs.tree.parents)


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
    for bad in (2.0, None):
        with pytest.raises(TypeError, match="max_new_tokens must be an int"):
            gen.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=bad)
    # a tree of ranks the drafter's vocabulary lacks: said when it is set, not at a step
    small = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=64))
    for options in ({"top_k": 80, "depth": 2, "total_tokens": 8}, {"choices": [(70,)]}):
        with pytest.raises(ValueError, match="vocabulary of this EAGLE draft has 64 tokens"):
            SpeculativeGenerator(base, small, **options)
    with pytest.raises(ValueError, match="need top_k >= 1, .* got top_k=0"):
        SpeculativeGenerator(base, small, top_k=0)
    with pytest.raises(
        ValueError, match="rank-300 token, but the vocabulary of these Medusa heads has 256"
    ):
        SpeculativeGenerator(
            base, MedusaHeads(MedusaConfig.from_base(base.config)), choices=[(300,)]
        )
    with pytest.raises(
        ValueError, match="rank-300 token, but the vocabulary of the draft model has 256"
    ):
        SpeculativeGenerator(base, make_tiny_llama(seed=1), choices=[(300,)])
    for bad in ({"temperature": -0.5}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match="need temperature >= 0 .* 0 < top_p <= 1"):
            gen.generate(torch.ones(1, 3, dtype=torch.long), **bad)
    with pytest.raises(ValueError, match="share the base's tokenizer"):
        SpeculativeGenerator(base, make_tiny_llama(vocab_size=512))  # fewer rows are padded
    with pytest.raises(TypeError, match="MedusaHeads, EagleDraft"):
        SpeculativeGenerator(base, object())
    with pytest.raises(TypeError, match=r"path 'runs/x/heads': load the heads first"):
        SpeculativeGenerator(base, "runs/x/heads")
    for text in ("Hello", ["Hello"]):
        with pytest.raises(TypeError, match="input_ids is text: tokenize it first"):
            gen.generate(text)
    with pytest.raises(TypeError, match=r"tokenizer's output dict: pass its \['input_ids'\]"):
        gen.generate({"input_ids": torch.ones(1, 3, dtype=torch.long)})
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2))
    # generate()'s arguments given to the generator, or options the drafter does not take
    with pytest.raises(
        TypeError,
        match=r"MedusaDrafter takes no option 'acceptance' \(its options: choices\); "
        r"acceptance is an argument of gen.generate",
    ):
        SpeculativeGenerator(base, heads, acceptance="typical")
    with pytest.raises(TypeError, match=r"NgramDrafter takes no option 'depth', 'temperature'"):
        SpeculativeGenerator(base, None, temperature=0.7, depth=3)
    with pytest.raises(
        TypeError,
        match=r"options \['choices'\] given with a drafter object \(MedusaDrafter\): build the "
        r"drafter with them instead, MedusaDrafter\(\.\.\., choices='cpu-8'\)",
    ):
        SpeculativeGenerator(base, MedusaDrafter(heads), choices="cpu-8")
    eagle3 = EagleDraft(EagleConfig.from_base(base.config, version=3))
    SpeculativeGenerator(base, eagle3, top_k=2, depth=2, total_tokens=4)  # EAGLE's own top_k
    with pytest.raises(
        TypeError,
        match=r"EagleDrafter takes no option 'num_tokens' \(its options: top_k, depth, total_tokens, choices\)$",
    ):
        SpeculativeGenerator(base, eagle3, num_tokens=4)
    with pytest.raises(TypeError, match=r"load_base's \(model, tokenizer\) pair"):
        SpeculativeGenerator((base, None), heads)
    with pytest.raises(TypeError, match=r"base is the name 'smollm2-135m-instruct': load it first"):
        SpeculativeGenerator("smollm2-135m-instruct", heads)
    wider = make_tiny_llama(hidden_size=2 * base.config.hidden_size)
    eagle = EagleDraft(EagleConfig.from_base(base.config, version=3))
    for other in (heads, [heads, None], [MedusaDrafter(heads), None], EagleDrafter(eagle, base)):
        with pytest.raises(
            ValueError, match=r"hidden_size=\d+, but the given base .* has hidden_size="
        ):
            SpeculativeGenerator(wider, other)
    limit = base.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"prompt has {limit + 1} tokens, more than .* {limit}"):
        gen.generate(torch.ones(1, limit + 1, dtype=torch.long))
    with pytest.raises(TypeError, match="must be numbers and top_k an int"):
        gen.generate(torch.ones(1, 3, dtype=torch.long), top_k=2.5)
    for bad in ({"temperature": float("nan")}, {"top_p": float("inf")}):
        with pytest.raises(ValueError, match="need temperature >= 0"):
            gen.generate(torch.ones(1, 3, dtype=torch.long), **bad)
    gen.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, top_k=np.int64(5))
    with pytest.raises(ValueError, match="acceptance='typical' .* without top_k / top_p"):
        gen.generate(
            torch.ones(1, 3, dtype=torch.long), temperature=0.7, top_p=0.9, acceptance="typical"
        )
    with pytest.raises(
        ValueError, match="the heads are on meta, the base takes its inputs on cpu: move them"
    ):
        SpeculativeGenerator(base, MedusaHeads(MedusaConfig.from_base(base.config)).to("meta"))
    with pytest.raises(ValueError, match=r"mix \{\} \(the drafter as it is configured\)"):
        SpeculativeGenerator(base, heads, adaptive=[None, {}, {"choices": "cpu-8"}])


def test_a_tokenizers_output_unpacks_into_generate():
    """`generate(**tokenizer(...))` as with HF: an all-ones attention mask is taken; padding,
    a mask of another length and more than two dimensions are refused before any step."""
    base = make_tiny_llama()
    gen = SpeculativeGenerator(base, MedusaHeads(MedusaConfig.from_base(base.config)))
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    unpacked = gen.generate(**inputs, max_new_tokens=12)
    expected = base.generate(**inputs, do_sample=False, max_new_tokens=12, min_new_tokens=12)
    assert torch.equal(unpacked.sequences, gen.generate(ids, max_new_tokens=12).sequences)
    assert torch.equal(unpacked.sequences, expected)
    padded = torch.ones_like(ids)
    padded[0, 0] = 0
    with pytest.raises(ValueError, match=r"masks some prompt tokens \(padding\).*attention_mask"):
        gen.generate(ids, attention_mask=padded)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 6\) for 7 prompt tokens"):
        gen.generate(ids, attention_mask=torch.ones(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 2\) for 4 prompt tokens"):
        gen.generate(ids[:, :4], attention_mask=torch.ones(2, 2, dtype=torch.long))
    one = gen.generate(ids[0], attention_mask=torch.ones(7, dtype=torch.long), max_new_tokens=1)
    # no verify step ran (the token is the prefill's): tau is plain decoding's, not 0
    assert one.num_steps == 0 and one.mean_accepted_length == 1.0
    with pytest.raises(ValueError, match=r"must be \(1, T\) or \(T,\), got shape \(1, 1, 7\)"):
        next(gen.stream(ids[None]))
    # the pad token in a prompt given without a mask: HF masks it, the generator reads it
    holed = ids.clone()
    holed[0, 3] = base.generation_config.pad_token_id
    with pytest.warns(UserWarning, match=r"holds the pad token \(0\) at positions \[3\]"):
        gen.generate(holed, max_new_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(holed, max_new_tokens=2, attention_mask=torch.ones_like(holed))
        gen.generate(holed, max_new_tokens=2, eos_token_id=[0, 2])  # HF infers no mask then


def test_eagle3_reads_the_states_entering_its_aux_layers_and_keeps_no_others():
    base = make_tiny_llama(num_hidden_layers=4)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, aux_layer_ids=[0, 2, 3]))
    gen = SpeculativeGenerator(base, draft, adaptive=False, top_k=2, depth=2, total_tokens=4)
    ids = torch.tensor([1, 5, 9, 22, 7])
    hidden, aux = gen._forward(ids, DynamicCache(config=base.config))
    want = base.model(input_ids=ids[None], output_hidden_states=True)
    torch.testing.assert_close(hidden, want.last_hidden_state[0], rtol=0, atol=0)
    states = [want.hidden_states[i][0] for i in (0, 2, 3)]  # HF's: the state entering layer i
    torch.testing.assert_close(aux, torch.cat(states, dim=-1), rtol=0, atol=0)
    assert all(not layer._forward_pre_hooks for layer in base.model.layers)  # none left behind


def test_prompts_as_lists_and_eos_as_tensors_are_taken():
    base = make_tiny_llama()
    gen = SpeculativeGenerator(base, None, num_tokens=3)
    ref = gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, eos_token_id=[])
    for prompt in ([[5, 6, 7]], [5, 6, 7], torch.tensor([5, 6, 7])):
        assert torch.equal(
            gen.generate(prompt, max_new_tokens=8, eos_token_id=[]).sequences, ref.sequences
        )
    new = ref.sequences[0, 3:].tolist()
    eos = new[2]  # the third new token: generation stops where it first comes
    end = 3 + new.index(eos) + 1
    for given in (torch.tensor(eos), torch.tensor([eos]), np.int64(eos), [eos], {eos}):
        out = gen.generate([5, 6, 7], max_new_tokens=8, eos_token_id=given)
        assert torch.equal(out.sequences, ref.sequences[:, :end]) and out.finished


def test_a_tree_that_no_longer_fits_the_context_gives_way_to_plain_steps():
    base = make_tiny_llama()  # 512 positions
    limit = base.config.max_position_embeddings
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=3)).init_from_base(base)
    prompt = torch.randint(
        3, base.config.vocab_size, (1, limit - 12), generator=torch.Generator().manual_seed(0)
    )
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


def test_logits_settings_of_the_generation_config_are_said_not_applied():
    """HF generate applies a generation_config's repetition penalty; the verifier reads the
    base's own logits: the generator says so, and its output is the plain greedy one."""
    base = make_tiny_llama()
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a base with no such settings: nothing to say
        plain = SpeculativeGenerator(base, None, num_tokens=3).generate(
            prompt, max_new_tokens=12, eos_token_id=[]
        )
    base.generation_config.repetition_penalty = 1.3
    base.generation_config.suppress_tokens = []  # empty: changes nothing
    with pytest.warns(UserWarning, match=r"sets repetition_penalty=1\.3, which HF generate"):
        gen = SpeculativeGenerator(base, None, num_tokens=3)
    out = gen.generate(prompt, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out.sequences, plain.sequences)
    with plain_generation(base):
        neutral = base.generate(prompt, max_new_tokens=12, do_sample=False)
    assert base.generation_config.repetition_penalty == 1.3  # given back
    assert torch.equal(out.sequences, neutral)
    penalised = base.generate(prompt, max_new_tokens=12, do_sample=False)
    assert not torch.equal(out.sequences, penalised)  # what the warning is about


def test_timings_say_what_the_prompt_cost():
    # scripts/bench_arms.py divides the steps' time by the steps: the prompt's prefill, and the
    # drafter's first pass over the prompt, are given apart (they would weigh more on the
    # settings of fewer steps)
    base = make_tiny_llama()
    eagle = EagleDraft(EagleConfig.from_base(base.config, version=3))
    prompt = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    plain = SpeculativeGenerator(base, eagle, adaptive=[None]).generate(prompt, 16)
    t = plain.timings
    assert 0 < t["prefill_base"] < t["base"] and t["prefill_draft"] <= t["draft"]
    tree = {"top_k": 2, "depth": 2, "total_tokens": 4}
    gen = SpeculativeGenerator(base, eagle, adaptive=[tree])
    catch_up = gen.drafter.catch_up

    def slow_catch_up(sequence):  # the draft layer's pass over the prompt, made to show
        time.sleep(0.05)
        catch_up(sequence)

    gen.drafter.catch_up = slow_catch_up
    t = gen.generate(prompt, 16).timings
    assert 0 < t["prefill_base"] < t["base"] and 0.05 <= t["prefill_draft"] < t["draft"]
    assert t["total"] >= t["base"] + t["draft"] and t["other"] >= 0
