"""What `make_drafter` makes of what the generator is given: a heads path of any kind is refused
with the way to load it, a tuple is a union as a list is, and a draft model's vocab_size must
be the base's, fewer columns as more."""

from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from heads import MedusaConfig, MedusaHeads
from inference import NgramDrafter, SpeculativeGenerator, UnionDrafter
from inference.drafters.medusa import MedusaDrafter
from tests.conftest import make_tiny_llama


def test_a_heads_folder_given_as_a_path_is_refused_with_how_to_load_it():
    base = make_tiny_llama()
    for path in ("runs/x/heads", Path("runs/x/heads")):
        with pytest.raises(TypeError, match=r"got the path 'runs/x/heads': load the heads first"):
            SpeculativeGenerator(base, path)


def test_a_tuple_of_drafters_is_their_union_as_a_list_is():
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2))
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    want = base.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    for members in ((MedusaDrafter(heads), NgramDrafter()), [MedusaDrafter(heads), NgramDrafter()]):
        gen = SpeculativeGenerator(base, members)
        assert isinstance(gen.drafter, UnionDrafter) and len(gen.drafter.drafters) == 2
        assert torch.equal(gen.generate(prompt, 12, eos_token_id=[]).sequences, want)


def test_a_draft_models_vocab_size_other_than_the_bases_is_refused():
    # the verifier sets the draft's probabilities beside the base's 256 columns: 224 (room for
    # the draft's 200 rows) are as wrong as 300
    base, small = make_tiny_llama(), make_tiny_llama(seed=1, vocab_size=200)
    for vocab_size in (224, 300):
        with pytest.raises(
            ValueError, match=rf"padded to vocab_size={vocab_size} tokens, the base has 256"
        ):
            SpeculativeGenerator(base, small, num_tokens=3, vocab_size=vocab_size)
    gen = SpeculativeGenerator(base, small, num_tokens=3, vocab_size=256)
    assert gen.drafter.vocab_size == 256


def test_arguments_of_the_wrong_shape_say_the_shape_wanted(smollm2_tokenizer):
    """A string or a number for `adaptive`, flat ranks for `choices`, a (model, tokenizer)
    pair for the draft model: each refused with the form to give."""
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2))
    for adaptive in ("yes", 1, {"top_k": 4}):
        with pytest.raises(TypeError, match=r"adaptive must be True, False or a list of arms"):
            SpeculativeGenerator(base, heads, adaptive=adaptive)
    with pytest.raises(TypeError, match=r"adaptive arm 'cpu-8': an arm is None .* or a dict"):
        SpeculativeGenerator(base, heads, adaptive=[None, "cpu-8"])
    for choices in ([0, 1], [[0], 1]):
        with pytest.raises(TypeError, match=r"each choice is a path of ranks, a list such as"):
            SpeculativeGenerator(base, heads, choices=choices)
    tree = SpeculativeGenerator(base, heads, choices=torch.tensor([[0], [1]])).drafter.tree
    assert tree.num_nodes == 3  # rows of a tensor are paths too, and a generator's
    assert (
        SpeculativeGenerator(base, heads, choices=((i,) for i in range(3))).drafter.max_nodes == 4
    )
    arms = (a for a in [None, MappingProxyType({"choices": [[0]]})])  # any iterable of mappings
    assert SpeculativeGenerator(base, heads, adaptive=arms).arms == [None, {"choices": [[0]]}]
    draft = make_tiny_llama(seed=1)
    with pytest.raises(TypeError, match=r"got a tokenizer where the heads or draft model go"):
        SpeculativeGenerator(base, (draft, smollm2_tokenizer))
