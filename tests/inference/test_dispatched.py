"""Bases under accelerate's hooks, as big models are loaded: dispatched with a `device_map`, or
offloaded (the weights wait on the "meta" device and are brought to the execution device for each
forward). The generator, the drafters and `load_heads` work on the device the base takes its
inputs on, and the greedy output stays the base's. (A base split over a GPU and the CPU is in
tests/gpu.)"""

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from safetensors.torch import load_file, save_file

from heads import MedusaConfig, MedusaHeads, load_heads
from heads.base import input_device
from inference import SpeculativeGenerator
from tests.conftest import make_tiny_llama
from tests.inference import test_generate

PROMPTS = [torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]]), torch.tensor([[9, 3, 9, 3, 9]])]


def _place(base, placement: str):
    if placement == "hooks":  # every module on the CPU, each behind its hook
        return dispatch_model(base, device_map={"": "cpu"}, force_hooks=True)
    return cpu_offload(base, execution_device=torch.device("cpu"))


@pytest.mark.parametrize("placement", ["hooks", "offload"])
@pytest.mark.parametrize(
    "name",
    ["medusa", "medusa-shared", "eagle1", "eagle3", "draft-model", "self-draft", "eagle3+ngram"],
)
def test_greedy_equals_base_greedy_under_accelerate_hooks(name, placement):
    base = make_tiny_llama()
    heads, options = test_generate._drafter(base, name)
    refs = [
        base.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=None) for p in PROMPTS
    ]
    base = _place(base, placement)
    if name == "medusa-shared":  # placing replaced the base's lm_head weight: tie to it again,
        heads.lm_head = base.get_output_embeddings()  # as load_heads does (its hook and all)
    if placement == "offload":
        assert next(base.parameters()).device.type == "meta"  # what the generator must not use
    assert input_device(base) == torch.device("cpu")
    gen = SpeculativeGenerator(base, heads, **options)
    for prompt, ref in zip(PROMPTS, refs):
        out = gen.generate(prompt, max_new_tokens=24, eos_token_id=[])
        assert torch.equal(out.sequences, ref), name


def test_shared_medusa_heads_of_a_reduced_vocabulary_load_onto_an_offloaded_base(tmp_path):
    """Heads sharing the base's lm_head over a reduced vocabulary save no lm_head: loading
    takes the base's rows, which an offloaded base keeps in its hook, not on "meta"."""
    base = make_tiny_llama()
    config = MedusaConfig.from_base(
        base.config, num_heads=2, original_lm_head=True, truncated_vocab_size=128
    )
    MedusaHeads(config).init_from_base(base, token_map=torch.arange(0, 256, 2)).save_pretrained(
        tmp_path / "heads"
    )
    weights = tmp_path / "heads" / "model.safetensors"  # as a folder that leaves it to the base
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights)
    ref = base.generate(PROMPTS[0], max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = load_heads(tmp_path / "heads", base=base).lm_head.weight.clone()
    base = _place(base, "offload")
    loaded = load_heads(tmp_path / "heads", base=base)
    assert torch.equal(loaded.lm_head.weight, expected)
    out = SpeculativeGenerator(base, loaded).generate(
        PROMPTS[0], max_new_tokens=16, eos_token_id=[]
    )
    assert torch.equal(out.sequences, ref)


def test_heads_loaded_onto_an_offloaded_base_go_to_its_execution_device(tmp_path):
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    heads.save_pretrained(tmp_path / "heads")
    ref = base.generate(PROMPTS[0], max_new_tokens=16, do_sample=False, eos_token_id=None)
    base = _place(base, "offload")
    loaded = load_heads(tmp_path / "heads", base=base)
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert next(loaded.parameters()).dtype == torch.float32
    out = SpeculativeGenerator(base, loaded).generate(
        PROMPTS[0], max_new_tokens=16, eos_token_id=[]
    )
    assert torch.equal(out.sequences, ref)
