"""The invariants on a CUDA device: tree attention through sdpa and eager in fp32 and bf16, greedy
output equal to the base's for every drafter (fp32), lossless sampling, and bf16 greedy outputs
that differ from HF's only where the base's two best tokens tie within bf16 rounding.

Everything is built under `torch.device("cuda")`, so the same helpers as the CPU tests run with
every tensor on the GPU. Skipped without CUDA (CI has none); run with `pytest -m gpu`.
"""

import pytest
import torch
from transformers import DynamicCache

from inference import SpeculativeGenerator
from inference.mask import tree_attention_mask, tree_position_ids
from inference.tree import tree_from_choices
from tests.conftest import make_tiny_llama
from tests.inference import test_generate, test_sampling_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


@pytest.fixture(autouse=True)
def on_cuda():
    with CUDA:
        yield


def _tree_and_path_logits(model, dtype, mask_of=tree_attention_mask):
    """Logits of one tree forward over a cached prefix, and of a plain forward per path (the
    same prefix and tree tokens on every call)."""
    torch.manual_seed(1)
    prefix = torch.randint(0, 256, (1, 37))
    tree = tree_from_choices(TREE)
    tokens = torch.randint(0, 256, (tree.num_nodes,))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prefix, cache=cache, use_cache=True)
        out = model(
            tokens[None],
            attention_mask=mask_of(tree, prefix.shape[1], dtype),
            position_ids=tree_position_ids(tree, prefix.shape[1]),
            cache=cache,
            use_cache=True,
        ).logits[0]
        plain = torch.stack(
            [
                model(torch.cat([prefix[0], tokens[tree.ancestors[i]]])[None]).logits[0, -1]
                for i in range(tree.num_nodes)
            ]
        )
    return out.float(), plain.float()


def _causal_mask(tree, prefix_len, dtype):
    """The wrong mask (plain causal over the tree's nodes): the negative control."""
    n = tree.num_nodes
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype)
    mask[0, 0, :, prefix_len:] = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_forward_matches_causal_forward_per_path_on_cuda(attn, dtype):
    torch.manual_seed(0)
    model = make_tiny_llama(attn=attn).to(dtype)
    tree_logits, path_logits = _tree_and_path_logits(model, dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    error = (tree_logits - path_logits).abs().max().item()
    assert error < tol, f"{attn} {dtype}: tree vs per-path logits differ by {error}"
    # A wrong mask (siblings that see each other) must land far further off than rounding.
    wrong, same_paths = _tree_and_path_logits(model, dtype, mask_of=_causal_mask)
    assert torch.equal(same_paths, path_logits)  # the same inputs as above
    wrong_error = (wrong - path_logits).abs().max().item()
    assert wrong_error > max(5 * error, 1e-3), (error, wrong_error)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", test_generate.DRAFTERS)
def test_greedy_equals_base_greedy_on_cuda(name, attn):
    base = make_tiny_llama(attn=attn)
    heads, options = test_generate._drafter(base, name)
    assert base.device.type == "cuda"
    # eager runs the row-by-row verifier (the CPU default), sdpa the dense one (the GPU default).
    test_generate.check_greedy_equals_base(base, heads, options, name, attn == "eager")


@pytest.mark.parametrize(
    "name", ["medusa", "medusa-shared", "eagle1", "eagle3", "draft-model", "eagle3+ngram"]
)
def test_greedy_on_a_base_split_over_the_gpu_and_the_cpu(name):
    """A base dispatched by accelerate over two devices (embeddings and layer 0 on the GPU,
    layer 1, the final norm and the lm_head computed on the CPU): the states, the logits and
    each layer's cache stay where their layers are, the loop and the heads work on the GPU."""
    from accelerate import dispatch_model

    from heads.base import input_device

    base = make_tiny_llama()
    heads, options = test_generate._drafter(base, name)
    prompts = [torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]]), torch.tensor([[9, 3, 9, 3, 9]])]
    refs = [
        base.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=None) for p in prompts
    ]
    on_gpu = ("model.embed_tokens", "model.rotary_emb", "model.layers.0")
    device_map = {m: 0 for m in on_gpu} | {m: "cpu" for m in ("model.layers.1", "model.norm")}
    base = dispatch_model(base, device_map={**device_map, "lm_head": "cpu"}, main_device="cpu")
    assert base.lm_head.weight.device.type == "cpu" and input_device(base).type == "cuda"
    gen = SpeculativeGenerator(base, heads, **options)
    for prompt, ref in zip(prompts, refs):
        out = gen.generate(prompt, max_new_tokens=24, eos_token_id=[])
        assert torch.equal(out.sequences.cpu(), ref.cpu()), name


@pytest.mark.parametrize("kind", ["medusa-topk", "union-sampled+topk"])
def test_speculative_sampling_matches_base_law_on_cuda(kind):
    base, gen = test_sampling_generate._gen(kind)
    seed = test_sampling_generate.seeds(kind, 5)  # a block the CPU tests (0-4) do not use
    stat, critical = test_sampling_generate.chi_square(gen, base, seed)
    assert stat < critical, (kind, stat, critical)


@pytest.mark.parametrize("name", ["medusa", "eagle3", "self-draft", "self-draft-static", "ngram"])
def test_bf16_greedy_differs_only_at_near_ties(name):
    """bf16 rounds differently for a 1-token forward and a tree forward, so the two greedy
    outputs may part where the base's best two tokens are within rounding of each other; they
    must never part anywhere else."""
    base = make_tiny_llama(attn="sdpa")
    base.lm_head.weight.mul_(8)  # peaked distributions: most steps are far from a tie
    heads, options = test_generate._drafter(base, name)
    base.to(torch.bfloat16)
    if isinstance(heads, torch.nn.Module):
        heads.to(torch.bfloat16)
    gen = SpeculativeGenerator(base, heads, **options)
    identical = 0
    for seed in range(8):
        torch.manual_seed(200 + seed)
        prompt = torch.randint(3, 256, (1, 6)).repeat(1, 2)
        ref = base.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None)[0]
        ours = gen.generate(prompt, max_new_tokens=48, eos_token_id=[]).sequences[0]
        differ = (ours != ref).nonzero()
        if differ.numel() == 0:
            identical += 1
            continue
        t = int(differ[0])
        with torch.no_grad():
            logits = base(ref[None, :t]).logits[0, -1].float()
        margin = (logits[ref[t]] - logits[ours[t]]).abs().item()
        scale = logits.abs().max().item()
        assert margin <= 0.03 * scale, f"{name} seed {seed}: parted at margin {margin:.3g}"
    assert identical >= 4, f"{name}: only {identical} of 8 bf16 outputs identical"
