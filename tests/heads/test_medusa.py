import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import MedusaConfig, MedusaHeads, load_heads


def test_fresh_head_reproduces_base_lm_head(tiny_llama):
    heads = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=3, num_layers=2)
    ).init_from_base(tiny_llama)
    hidden = torch.randn(2, 5, 64)
    logits = heads(hidden)
    assert logits.shape == (3, 2, 5, 256)  # (K,B,T,V)
    for k in range(3):
        torch.testing.assert_close(logits[k], tiny_llama.lm_head(hidden), rtol=0, atol=0)


def test_shared_lm_head_is_frozen_and_tied(tiny_llama):
    heads = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=2, original_lm_head=True)
    ).init_from_base(tiny_llama)
    assert heads.lm_head.weight is tiny_llama.lm_head.weight
    assert not heads.lm_head.weight.requires_grad
    H = 64
    assert heads.num_trainable_parameters() == 2 * (H * H + H)  # only the residual blocks


@torch.no_grad()
def test_each_head_reads_its_own_block_and_lm_head(tiny_llama):
    # fresh heads all equal the base's lm_head: heads of their own weights tell them apart
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=3)).init_from_base(
        tiny_llama
    )
    torch.manual_seed(0)
    for block, lm in zip(heads.blocks, heads.lm_heads):
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
        torch.nn.init.normal_(block.layers[0].bias, std=0.3)
        torch.nn.init.normal_(lm.weight, std=0.3)
    hidden = torch.randn(2, 3, 64)  # (B, T, H)
    logits = heads(hidden)  # (K, B, T, V)
    for k in range(3):
        layer = heads.blocks[k].layers[0]
        x = hidden + torch.nn.functional.silu(hidden @ layer.weight.T + layer.bias)
        want = x @ heads.lm_heads[k].weight.T
        torch.testing.assert_close(logits[k], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(heads.head_logits(k, hidden), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[0], logits[1])


def test_trainable_parameter_count_own_heads(tiny_llama):
    K, L, H, V = 4, 2, 64, 256
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=K, num_layers=L))
    assert heads.num_trainable_parameters() == K * (L * (H * H + H) + V * H)
    no_bias = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=K, num_layers=L, medusa_fc_bias=False)
    )
    assert no_bias.num_trainable_parameters() == K * (L * H * H + V * H)


def test_reduced_vocab_maps_back_to_base_ids(tiny_llama, tmp_path):
    keep = torch.tensor([0, 2, 3, 7, 100, 255])
    cfg = MedusaConfig.from_base(tiny_llama.config, num_heads=2, truncated_vocab_size=6)
    heads = MedusaHeads(cfg).init_from_base(tiny_llama, token_map=keep)
    hidden = torch.randn(1, 3, 64)
    torch.testing.assert_close(heads(hidden)[0], tiny_llama.lm_head(hidden)[..., keep])
    assert heads.to_base_ids(torch.tensor([4])).item() == 100
    heads.save_pretrained(tmp_path)
    again = load_heads(tmp_path, base=tiny_llama)
    torch.testing.assert_close(again.token_map, keep)
    # lm_heads saved over the whole vocabulary: vLLM keeps the token_map's rows, and so do we
    tensors = load_file(tmp_path / "model.safetensors")
    for h in range(2):
        whole = torch.randn(256, 64)
        whole[keep] = tensors[f"lm_heads.{h}.weight"]
        tensors[f"lm_heads.{h}.weight"] = whole
    save_file(tensors, tmp_path / "model.safetensors")
    torch.testing.assert_close(load_heads(tmp_path, base=tiny_llama)(hidden), heads(hidden))


@pytest.mark.parametrize("shared", [False, True])
def test_a_draft_vocabulary_of_the_whole_one_is_saved_in_token_order(tiny_llama, tmp_path, shared):
    """vLLM reads token_map only below the base's vocabulary, taking row j for token j: heads
    whose map covers the whole vocabulary in another order are saved with their rows sorted, so
    vLLM and headstart draft the same tokens from the folder as from the heads."""
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    cfg = MedusaConfig.from_base(
        tiny_llama.config, num_heads=2, truncated_vocab_size=256, original_lm_head=shared
    )
    heads = MedusaHeads(cfg).init_from_base(tiny_llama, token_map=order)
    for block in heads.blocks:  # non-zero blocks: each head's logits differ
        torch.nn.init.normal_(block.layers[0].weight, std=0.1)
    hidden = torch.randn(1, 3, 64)
    drafted = heads.to_base_ids(heads(hidden).argmax(-1))  # (K,B,T) base ids
    heads.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert torch.equal(tensors["token_map"], torch.arange(256))
    names = ["lm_head.weight"] if shared else [f"lm_heads.{h}.weight" for h in range(2)]
    for name in names:  # row j is token j's, as vLLM reads it
        torch.testing.assert_close(tensors[name], tiny_llama.lm_head.weight)
    again = load_heads(tmp_path, base=tiny_llama)
    assert torch.equal(again.to_base_ids(again(hidden).argmax(-1)), drafted)
    assert torch.equal(heads.token_map, order)  # the heads themselves are unchanged
    # a map naming a token twice is refused when given, when loaded and when saved
    repeated = order.clone()
    repeated[1] = repeated[0]
    with pytest.raises(ValueError, match="names a token more than once"):
        MedusaHeads(cfg).init_from_base(tiny_llama, token_map=repeated)
    tensors["token_map"] = repeated
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="token_map names a token more than once"):
        load_heads(tmp_path, base=tiny_llama)
    heads.token_map.copy_(repeated)
    with pytest.raises(ValueError, match="names a token more than once"):
        heads.save_pretrained(tmp_path / "bad")


def test_config_validation():
    with pytest.raises(ValueError, match="truncated_vocab_size"):
        MedusaHeads(MedusaConfig(vocab_size=10, truncated_vocab_size=20))


def test_a_token_map_of_another_length_than_the_draft_vocabulary_is_refused(tiny_llama):
    cfg = MedusaConfig.from_base(tiny_llama.config, num_heads=1, truncated_vocab_size=6)
    MedusaHeads(cfg).init_from_base(tiny_llama, token_map=torch.tensor([0, 2, 3, 7, 100, 255]))
    for wrong in (torch.tensor([0, 2, 3, 7, 100]), torch.tensor([5]), None):
        with pytest.raises(ValueError, match="needs a token_map of 6 ids"):
            MedusaHeads(cfg).init_from_base(tiny_llama, token_map=wrong)


def test_a_shared_lm_head_is_frozen_before_it_is_tied_and_when_loaded_alone(tiny_llama, tmp_path):
    """original_lm_head: the heads never train the base's lm_head, whether it is tied yet or the
    heads are loaded without a base (their saved copy of it stands in)."""
    from heads import load_heads

    K, H = 2, 64
    cfg = MedusaConfig.from_base(tiny_llama.config, num_heads=K, original_lm_head=True)
    fresh = MedusaHeads(cfg)
    assert not fresh.lm_head.weight.requires_grad
    assert fresh.num_trainable_parameters() == K * (H * H + H)  # the residual blocks only
    MedusaHeads(cfg).init_from_base(tiny_llama).save_pretrained(tmp_path)
    alone = load_heads(tmp_path)
    assert not alone.lm_head.weight.requires_grad
    assert alone.num_trainable_parameters() == K * (H * H + H)
    torch.testing.assert_close(alone.lm_head.weight, tiny_llama.lm_head.weight, rtol=0, atol=0)
