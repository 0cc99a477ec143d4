"""MedusaConfig's rules: at least one head, a reference folder's missing medusa_num_layers, token
map ids inside the vocabulary, a whole draft vocabulary saved in token order."""

from __future__ import annotations

import pytest
import torch

from heads import MedusaConfig, MedusaHeads


def test_validate_refuses_zero_heads():
    """(M1) K >= 1: no heads draft nothing; 0 residual layers is a valid (lm_head-only) head."""
    MedusaConfig(num_heads=1, num_hidden_layers=0).validate()
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        MedusaConfig(num_heads=0).validate()
    with pytest.raises(ValueError, match="num_hidden_layers >= 0"):
        MedusaConfig(num_heads=1, num_hidden_layers=-1).validate()


def test_a_token_map_naming_the_id_one_past_the_vocabulary_is_refused(tiny_llama):
    """Ids lie in [0, V): id V would index past the base lm_head's rows (M6)."""
    from heads.medusa import check_token_map

    V = tiny_llama.config.vocab_size
    check_token_map(torch.tensor([0, V - 1]), V)
    with pytest.raises(ValueError, match="outside the base's vocabulary"):
        check_token_map(torch.tensor([0, V]), V)
    heads = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=1, truncated_vocab_size=2)
    )
    with pytest.raises(ValueError, match="outside the base's vocabulary"):
        heads.init_from_base(tiny_llama, torch.tensor([1, V]))


def test_a_full_draft_vocabulary_in_another_order_is_saved_in_token_order(tiny_llama):
    """vLLM reads token_map only below the vocabulary: over the whole one, the saved lm_head
    rows must be in token order (M9)."""
    V = tiny_llama.config.vocab_size
    heads = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=1, truncated_vocab_size=V)
    )
    order = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    heads.init_from_base(tiny_llama, order)
    state = heads.state_to_save()
    assert torch.equal(state["token_map"], torch.arange(V))
    torch.testing.assert_close(
        state["lm_heads.0.weight"], tiny_llama.get_output_embeddings().weight, rtol=0, atol=0
    )
