"""heads.cpu: oneDNN-prepacked linear weights give the same numbers as nn.Linear, keep the
module's parameters and state dict, and fall back wherever the packed copy cannot be used."""

import collections
import copy
import io

import pytest
import torch
from torch import nn

from heads import MedusaConfig, MedusaHeads
from heads.cpu import (
    PackedLinear,
    can_prepack,
    can_prepack_bf16,
    prepack_linear_weights,
    repack_stale,
)
from inference import SpeculativeGenerator
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
        assert not lin.stale()
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=0)
        half = lin.to(torch.bfloat16)
        assert half(x.detach().bfloat16()).dtype == torch.bfloat16


def test_only_fp32_and_onednn_bf16_cpu_linears_are_packed():
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Linear(4, 4).to(torch.bfloat16),
        nn.Linear(4, 4).to(torch.float16),
        nn.Embedding(5, 4),
    )
    assert prepack_linear_weights(model) == 1 + can_prepack_bf16()
    assert isinstance(model[1], PackedLinear) == can_prepack_bf16()
    assert type(model[2]) is nn.Linear


@pytest.mark.skipif(not can_prepack_bf16(), reason="oneDNN computes no bf16 on this CPU")
def test_prepacked_bf16_llama_matches_the_plain_bf16_gemm():
    """bf16 weights packed where oneDNN computes bf16: the same logits as the plain bf16 GEMM,
    for a tree's rows and for a batch's last positions (HF generate's strided slice)."""
    plain, packed = make_tiny_llama().to(torch.bfloat16), make_tiny_llama().to(torch.bfloat16)
    assert prepack_linear_weights(packed) == 2 * 7 + 1
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (ids[:1, :1], ids[:1, :4], ids):
            expected = plain(rows).logits
            got = packed(rows).logits
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
        hidden = plain.model(ids).last_hidden_state[:, -1:, :]  # (3, 1, H), not contiguous
        torch.testing.assert_close(
            packed.lm_head(hidden), plain.lm_head(hidden), atol=1e-2, rtol=1e-2
        )


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


def test_weights_replaced_or_changed_through_data_are_never_computed_stale():
    """`.data =` and a dtype round trip move the storage: the plain GEMM runs at once. A change
    written through `.data` (peft's merge_and_unload) moves nothing the forward checks: the
    probe finds it, and repack_stale (SpeculativeGenerator calls it) packs again."""
    import copy

    lin = nn.Linear(16, 8)
    prepack_linear_weights(lin)
    x = torch.randn(3, 16)
    with torch.no_grad():
        lin.weight.data = torch.zeros_like(lin.weight)
        torch.testing.assert_close(lin(x), lin.bias.expand(3, 8))
        lin.to(torch.bfloat16).to(torch.float32)
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)
        # the allocator may hand a freed weight's address to the next: a packed weight is
        # held, so a round trip (rounded to bf16) never passes for it
        wide = nn.Linear(1024, 1024)
        prepack_linear_weights(wide)
        wide.to(torch.bfloat16).to(torch.float32)
        y = torch.randn(2, 1024)
        torch.testing.assert_close(wide(y), y @ wide.weight.T + wide.bias, atol=1e-5, rtol=0)
        assert repack_stale(lin) == 1 and not lin.stale()
        lin.weight.data += 1.0  # in place, as a LoRA merge writes it
        assert lin.stale() and repack_stale(lin) == 1 and repack_stale(lin) == 0
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=0)
        twin = copy.deepcopy(lin)  # the packed copy stays behind: the plain GEMM, then repacked
        torch.testing.assert_close(twin(x), x @ lin.weight.T + lin.bias)
        assert repack_stale(twin) == 1
        torch.testing.assert_close(twin(x), lin(x), atol=1e-5, rtol=0)


def test_a_lora_merged_into_a_prepacked_base_is_what_the_generator_computes(tmp_path):
    """The Medusa-2 serving flow on a CPU: load_base prepacks, peft merges the adapter through
    `.data`; the generator's greedy output is the merged model's, token for token."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from inference import SpeculativeGenerator

    adapted = get_peft_model(
        make_tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    adapted.save_pretrained(tmp_path)
    reference = PeftModel.from_pretrained(make_tiny_llama(), tmp_path).merge_and_unload()
    base = make_tiny_llama()
    prepack_linear_weights(base)
    merged = PeftModel.from_pretrained(base, tmp_path).merge_and_unload()
    prompt = torch.tensor([[5, 6, 7, 8]])
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    gen = SpeculativeGenerator(merged, None, num_tokens=3)
    out = gen.generate(prompt, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out.sequences, expected)


def test_a_change_to_some_rows_through_data_is_found():
    """An adapter on a block of output rows leaves the first and last values as they were."""
    lin = nn.Linear(64, 32)
    prepack_linear_weights(lin)
    x = torch.randn(2, 64)
    with torch.no_grad():
        lin.weight.data[8:24] += 1.0
        assert lin.stale() and repack_stale(lin) == 1
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=0)


def test_a_prepacked_module_saved_whole_loads_and_computes():
    """torch.save keeps a weight and its alias on one storage: the loaded copy must not take
    the weight for the one packed (its packed copy is not saved)."""
    lin = nn.Linear(16, 8)
    prepack_linear_weights(lin)
    buffer = io.BytesIO()
    torch.save(lin, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([PackedLinear, collections.OrderedDict, set]):
        loaded = torch.load(buffer, weights_only=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), x @ lin.weight.T + lin.bias)
        assert repack_stale(loaded) == 1
        torch.testing.assert_close(loaded(x), lin(x), atol=1e-5, rtol=0)


def test_a_packed_weight_that_trains_gets_its_gradient_from_an_input_without_one():
    """Heads train on a frozen base's features (no grad): the weight's gradient still flows."""
    lin = nn.Linear(16, 8)
    prepack_linear_weights(lin)
    x = torch.randn(3, 16)
    lin(x).sum().backward()
    assert lin.weight.grad is not None
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(8, 16))


def test_a_linear_subclass_keeps_its_own_forward():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Doubled(4, 4), nn.Linear(4, 4))
    assert prepack_linear_weights(model) == 1
    assert type(model[0]) is Doubled and isinstance(model[1], PackedLinear)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), 2 * (x @ model[0].weight.T + model[0].bias))


def test_the_count_is_of_the_linears_packed_now():
    model = make_tiny_llama()
    assert prepack_linear_weights(model) == 2 * 7 + 1
    model.to(torch.float16)  # oneDNN packs no fp16: the plain GEMM from now on
    assert prepack_linear_weights(model) == 0


def test_heads_changed_since_they_were_prepacked_draft_with_their_current_weights():
    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    assert prepack_linear_weights(heads) > 0
    with torch.no_grad():
        for p in heads.parameters():
            p.data += 0.05  # in place, as a LoRA merge or a finished training step writes it
    plain = copy.deepcopy(heads)  # its packed copies stay behind: plain GEMMs, current weights
    hidden = torch.randn(3, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    SpeculativeGenerator(base, heads, choices="cpu-8")
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden), plain(hidden), atol=1e-5, rtol=0)
