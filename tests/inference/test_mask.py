"""Tree attention masks and positions: hand-drawn trees, then a stock transformers Llama."""

import pytest
import torch
from transformers import DynamicCache

from inference.mask import frontier_attention_mask, tree_attention_mask, tree_position_ids
from inference.tree import tree_from_choices, tree_from_parents
from tests.conftest import make_tiny_llama

M = torch.finfo(torch.float32).min


def test_mask_root_ab_a_c():
    # root -> {a, b}, a -> {c}; nodes 0=root 1=a 2=b 3=c; prefix of 2
    tree = tree_from_parents([-1, 0, 0, 1])
    expected = torch.tensor(
        [
            [0, 0, 0, M, M, M],
            [0, 0, 0, 0, M, M],
            [0, 0, 0, M, 0, M],
            [0, 0, 0, 0, M, 0],
        ]
    )
    mask = tree_attention_mask(tree, prefix_len=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 6) and mask.dtype == torch.float32
    assert torch.equal(mask[0, 0], expected)
    assert tree_position_ids(tree, prefix_len=2).tolist() == [[2, 3, 3, 4]]
    assert tree.paths.tolist() == [[0, 2, -1], [0, 1, 3]]


def test_frontier_mask_opens_the_sequence_and_the_allowed_tree_entries():
    # 2 cached sequence entries; tree entries: a cached node, then a frontier of two nodes, the
    # first a child of the cached node, the second not
    allowed = torch.tensor([[True, True, False], [False, False, True]])
    mask = frontier_attention_mask(allowed, 2, torch.float32)
    blocked = torch.finfo(torch.float32).min
    expected = torch.tensor([[0, 0, 0, 0, blocked], [0, 0, blocked, blocked, 0]])
    assert mask.shape == (1, 1, 2, 5) and torch.equal(mask[0, 0], expected)


def test_mask_chain_is_causal_and_batched():
    tree = tree_from_parents([-1, 0, 1])
    expected = torch.tensor([[0, M, M], [0, 0, M], [0, 0, 0]])
    mask = tree_attention_mask(tree, prefix_len=0, dtype=torch.float32, batch_size=3)
    assert mask.shape == (3, 1, 3, 3)
    assert all(torch.equal(mask[b, 0], expected) for b in range(3))
    assert tree_position_ids(tree, 0).tolist() == [[0, 1, 2]]
    assert tree.paths.tolist() == [[0, 1, 2]]


def test_mask_star_in_bf16():
    # root -> {a, b, c}: siblings never see each other
    tree = tree_from_parents([-1, 0, 0, 0])
    mb = torch.finfo(torch.bfloat16).min
    expected = torch.tensor(
        [
            [0, 0, mb, mb, mb],
            [0, 0, 0, mb, mb],
            [0, 0, mb, 0, mb],
            [0, 0, mb, mb, 0],
        ],
        dtype=torch.bfloat16,
    )
    mask = tree_attention_mask(tree, prefix_len=1, dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and torch.equal(mask[0, 0], expected)
    assert tree_position_ids(tree, 1).tolist() == [[1, 2, 2, 2]]
    assert tree.paths.tolist() == [[0, 1], [0, 2], [0, 3]]


@pytest.fixture
def one_thread():
    # A 2-layer, H=64 model gains nothing from threads, and on a busy machine loses a lot.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_forward_matches_causal_forward_per_path(attn):
    torch.manual_seed(0)
    model = make_tiny_llama(seed=0, attn=attn)
    prefix = torch.randint(0, 256, (1, 5))
    tree = tree_from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
    tokens = torch.randint(0, 256, (tree.num_nodes,))  # (N,)
    tokens[2] = tokens[1]  # a duplicate sibling token must still get its own row
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prefix, cache=cache, use_cache=True)
        mask = tree_attention_mask(tree, prefix.shape[1], torch.float32)
        positions = tree_position_ids(tree, prefix.shape[1])
        out = model(
            tokens[None], attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        assert cache.get_seq_length() == prefix.shape[1] + tree.num_nodes
        for i in range(tree.num_nodes):
            path = tree.ancestors[i].nonzero().flatten()
            plain = model(torch.cat([prefix[0], tokens[path]])[None]).logits[0, -1]
            torch.testing.assert_close(out.logits[0, i], plain, atol=1e-5, rtol=0)


def test_frontier_mask_in_bf16_blocks_with_bf16s_minimum():
    # a bf16 draft model's forward takes a mask of its own dtype
    allowed = torch.tensor([[True, False], [True, True]])
    mask = frontier_attention_mask(allowed, 1, torch.bfloat16)
    mb = torch.finfo(torch.bfloat16).min
    expected = torch.tensor([[0, 0, mb], [0, 0, 0]], dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and torch.equal(mask[0, 0], expected)


def test_each_batch_row_of_the_tree_mask_is_its_own_copy():
    # attention code may write into the mask in place: one sequence's row must not be another's
    tree = tree_from_parents([-1, 0, 0])
    mask = tree_attention_mask(tree, prefix_len=1, dtype=torch.float32, batch_size=2)
    first = mask[1].clone()
    mask[0].fill_(0.0)
    assert torch.equal(mask[1], first) and mask[1].min() == torch.finfo(torch.float32).min


def test_grouped_kv_attention_is_scoped_to_a_cpu_and_leaves_a_users_setting(monkeypatch):
    import os

    from inference.mask import FORCE_GQA, grouped_kv_attention

    cpu = torch.device("cpu")
    monkeypatch.delenv(FORCE_GQA, raising=False)
    with grouped_kv_attention(cpu):
        assert os.environ[FORCE_GQA] == "1"
    assert FORCE_GQA not in os.environ
    with pytest.raises(RuntimeError), grouped_kv_attention(cpu):
        raise RuntimeError  # an error inside: the switch is off again after
    assert FORCE_GQA not in os.environ
    with grouped_kv_attention(torch.device("meta")):  # not a CPU (CUDA's kernels): untouched
        assert FORCE_GQA not in os.environ
    monkeypatch.setenv(FORCE_GQA, "0")  # the user's own choice stands
    with grouped_kv_attention(cpu):
        assert os.environ[FORCE_GQA] == "0"
    assert os.environ[FORCE_GQA] == "0"


def test_tree_steps_on_a_cpu_attend_the_shared_kv_heads_without_copying_them(monkeypatch):
    """The decode loop's tree forwards (4 query heads, 2 K/V heads) give sdpa the cached K/V
    heads as they are, with enable_gqa, not copied per query head; outside the loop's forwards
    the switch is off, and the greedy output is still HF's."""
    import os

    import torch.nn.functional as F

    from heads import MedusaConfig, MedusaHeads
    from inference import SpeculativeGenerator
    from inference.mask import FORCE_GQA

    monkeypatch.delenv(FORCE_GQA, raising=False)
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    gen = SpeculativeGenerator(base, heads, choices=[(0,), (1,), (0, 0)])
    sdpa, calls = F.scaled_dot_product_attention, []

    def spy(query, key, value, *args, **kwargs):
        switched = os.environ.get(FORCE_GQA)
        calls.append((query.shape[2], key.shape[1], kwargs.get("enable_gqa", False), switched))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    prompt = torch.tensor([[1, 5, 9, 14, 3, 7]])
    out = gen.generate(prompt, max_new_tokens=12)
    tree_calls = [c for c in calls if c[0] == 4]  # the 4-node tree's forwards
    assert tree_calls and all(kv_heads == 2 and gqa for _, kv_heads, gqa, _ in tree_calls)
    # the prompt's forward (no mask: the model's own causal path) is left as transformers runs it
    assert [c[3] for c in calls if c[0] == prompt.shape[1]] == [None] * 2  # per layer
    assert FORCE_GQA not in os.environ
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    expected = base.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, expected)
