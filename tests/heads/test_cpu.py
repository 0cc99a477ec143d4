"""heads.cpu: oneDNN-prepacked linear weights give the same numbers as nn.Linear, keep the
module's parameters and state dict, and fall back wherever the packed copy cannot be used."""

import pytest
import torch
from torch import nn

from heads.cpu import PackedLinear, can_prepack, prepack_linear_weights
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.skipif(not can_prepack(), reason="this torch build has no oneDNN")


def test_prepacked_llama_matches_plain_and_keeps_its_state():
    plain, packed = make_tiny_llama(), make_tiny_llama()
    keys = list(packed.state_dict())
    assert prepack_linear_weights(packed) == 2 * 7 + 1  # q k v o gate up down per layer + lm_head
    assert all(type(m) is not nn.Linear for m in packed.modules())
    assert list(packed.state_dict()) == keys
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (ids[:, :1], ids[:, :4], ids):
            torch.testing.assert_close(packed(rows).logits, plain(rows).logits, atol=1e-5, rtol=0)


def test_packed_linear_falls_back_for_grad_dtype_and_changed_weights():
    lin = nn.Linear(16, 8)
    prepack_linear_weights(lin)
    assert isinstance(lin, PackedLinear)
    x = torch.randn(3, 16, requires_grad=True)
    lin(x).sum().backward()  # autograd goes through the plain GEMM
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        lin.weight.mul_(2)  # the packed copy is stale now: the plain GEMM must be used
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)
        prepack_linear_weights(lin)  # repacking picks the new weight up
        assert lin._packed_version == lin.weight._version
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=0)
        half = lin.to(torch.bfloat16)
        assert half(x.detach().bfloat16()).dtype == torch.bfloat16


def test_only_fp32_cpu_linears_are_packed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Embedding(5, 4))
    assert prepack_linear_weights(model) == 1
    assert type(model[1]) is nn.Linear


def test_loaded_heads_are_packed_and_a_shared_lm_head_is_the_bases(tmp_path):
    from heads import MedusaConfig, MedusaHeads, load_heads

    base = make_tiny_llama()
    config = MedusaConfig.from_base(base.config, num_heads=2, original_lm_head=True)
    MedusaHeads(config).init_from_base(base).save_pretrained(tmp_path)
    prepack_linear_weights(base)
    packed = base.lm_head._packed
    heads = load_heads(tmp_path, base=base)
    assert heads.lm_head is base.lm_head and base.lm_head._packed is packed  # not packed twice
    assert all(type(m) is not nn.Linear for m in heads.modules())
