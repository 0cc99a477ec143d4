import pytest
import torch

from heads import EagleConfig, EagleDraft, default_aux_layer_ids, read_hidden_states
from heads.eagle import check_vocab_map, t2d_from_d2t
from tests.conftest import TINY, make_tiny_llama


def test_aux_layer_convention_is_state_entering_layer():
    # EAGLE-3 / vLLM: hidden states entering layers 2, L//2, L-3.
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(7) == (2, 3, 4)
    # small bases: three layers in order, as vLLM and SGLang collect them (the exports refused
    # (2, 3, 3) for 6 layers and (2, 2, 1) for 4)
    assert [default_aux_layer_ids(L) for L in (3, 4, 6)] == [(0, 1, 2), (1, 2, 3), (3, 4, 5)]
    assert default_aux_layer_ids(2) == (1, 1, 0)  # clamped for test models
    from transformers import LlamaConfig

    from heads.eagle_config import engine_refusal

    for L in (4, 6):  # a draft on the defaults is one the engines compute as headstart does
        config = EagleConfig.from_base(LlamaConfig(**{**TINY, "num_hidden_layers": L}), version=3)
        assert [engine_refusal(config, e) for e in ("vllm", "sglang")] == [None, None]


def test_read_hidden_states_index_is_input_of_layer(tiny_llama):
    ids = torch.tensor([[5, 6, 7]])
    captured = {}
    layer = tiny_llama.model.layers[1]
    handle = layer.register_forward_pre_hook(lambda m, args: captured.setdefault("x", args[0]))
    try:
        logits, last, aux = read_hidden_states(tiny_llama, ids, [1])
    finally:
        handle.remove()
    torch.testing.assert_close(aux[0], captured["x"])
    torch.testing.assert_close(logits, tiny_llama(ids).logits)
    torch.testing.assert_close(tiny_llama.lm_head(last), logits)


@pytest.mark.parametrize("version", [1, 3])
def test_stepwise_with_cache_equals_full_forward(tiny_llama, version):
    draft = EagleDraft(
        EagleConfig.from_base(tiny_llama.config, version=version, draft_vocab_size=64)
    ).eval()
    T = 6
    emb = tiny_llama.model.embed_tokens(torch.randint(0, 256, (1, T)))
    hidden = torch.randn(1, T, 64)
    pos = torch.arange(T)[None]
    full = draft(emb, hidden, pos)
    cache = draft.new_cache()
    first = draft(emb[:, :4], hidden[:, :4], pos[:, :4], cache=cache)
    rest = [
        draft(emb[:, t : t + 1], hidden[:, t : t + 1], pos[:, t : t + 1], cache=cache)
        for t in (4, 5)
    ]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == T


def test_eagle1_has_no_input_layernorm_and_shares_lm_head(tiny_llama):
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1))
    names = set(draft.state_dict())
    assert not any("input_layernorm" in n for n in names)
    assert draft.fc.weight.shape == (64, 128)
    with pytest.raises(ValueError, match="base.lm_head"):
        draft.compute_logits(torch.randn(1, 1, 64))


def test_eagle3_shapes_follow_base_gqa_and_head_dim():
    base = make_tiny_llama(
        num_hidden_layers=8, head_dim=32, num_attention_heads=4, num_key_value_heads=1
    )
    cfg = EagleConfig.from_base(base.config, version=3, draft_vocab_size=32)
    draft = EagleDraft(cfg)
    sd = draft.state_dict()
    assert cfg.aux_layer_ids == [2, 4, 5]
    assert sd["fc.weight"].shape == (64, 192)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 32, 128)  # q/k/v take 2H
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (1 * 32, 128)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (64, 4 * 32)
    assert sd["lm_head.weight"].shape == (32, 64)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool


def test_eagle3_rope_scaling_carries_over():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
    }
    base = make_tiny_llama(rope_parameters=scaling)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    torch.testing.assert_close(draft.rotary_emb.inv_freq, base.model.rotary_emb.inv_freq)
    written = draft.config.to_dict()
    assert written["rope_scaling"]["rope_type"] == "llama3"
    assert written["rope_theta"] == 500000.0  # engines that read the top-level key


def test_vocab_map_roundtrip_and_errors(tiny_llama):
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=3, draft_vocab_size=4))
    draft.set_vocab_map(torch.tensor([3, 10, 11, 200]))
    assert draft.to_base_ids(torch.tensor([0, 1, 2, 3])).tolist() == [3, 10, 11, 200]
    assert draft.t2d.sum() == 4 and draft.t2d[200]
    draft.set_vocab_map(torch.tensor([200, 3, 11, 10]))  # any order, as the engines read it
    assert draft.to_base_ids(torch.tensor([0, 1, 2, 3])).tolist() == [200, 3, 11, 10]
    assert draft.t2d.nonzero().flatten().tolist() == [3, 10, 11, 200]
    twice = torch.tensor([3, 9, 9, 197])  # targets 3, 10, 11, 200 less d2t's own index
    check_vocab_map(twice, draft.t2d)
    twice[2] = 8  # targets 3, 10, 10, 200: two draft tokens on one base id
    with pytest.raises(ValueError, match="distinct"):
        check_vocab_map(twice, draft.t2d)
    with pytest.raises(ValueError, match="outside the base vocabulary"):
        check_vocab_map(torch.tensor([3, 9, 9, 300]), draft.t2d)
    t2d = draft.t2d.clone()
    t2d[50] = True
    with pytest.raises(ValueError, match="t2d"):
        check_vocab_map(draft.d2t, t2d)
    # a refused map leaves the draft's own as it was
    for ids, error in (([3, 10, 10, 200], "distinct"), ([3, 10, 11, 256], "outside the base")):
        with pytest.raises(ValueError, match=error):
            draft.set_vocab_map(torch.tensor(ids))
        assert draft.to_base_ids(torch.tensor([0, 1, 2, 3])).tolist() == [200, 3, 11, 10]
        assert draft.t2d.nonzero().flatten().tolist() == [3, 10, 11, 200]


def test_a_vocabulary_map_reaching_outside_the_base_is_refused_at_either_end():
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[[0, 1, 2, 255]] = True
    # targets (draft + d2t[draft]) 255, 1, 2, -1: -1 would index t2d's last entry
    with pytest.raises(ValueError, match="run from -1 to 255, outside the base vocabulary of 256"):
        check_vocab_map(torch.tensor([255, 0, 0, -4]), t2d)
    # targets 0, 1, 2, 256: one past the last id
    with pytest.raises(ValueError, match="run from 0 to 256, outside the base vocabulary of 256"):
        check_vocab_map(torch.tensor([0, 0, 0, 253]), t2d)
    with pytest.raises(ValueError, match="outside the base vocabulary of 256"):
        t2d_from_d2t(torch.tensor([0, 0, 0, 253]), 256)


@torch.no_grad()
def test_eagle1_fc_reads_the_embedding_then_the_feature(tiny_llama):
    # vLLM's and the EAGLE repo's EAGLE-1 layer: fc(cat(inputs_embeds, hidden_states)).
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1)).eval()
    H = 64
    draft.fc.weight[:, H:] = 0  # the feature's half off
    emb, pos = torch.randn(1, 4, H), torch.arange(4)[None]
    a = draft(emb, torch.randn(1, 4, H), pos)
    torch.testing.assert_close(draft(emb, torch.randn(1, 4, H), pos), a)  # feature: no effect
    assert not torch.allclose(draft(torch.randn(1, 4, H), torch.randn(1, 4, H), pos), a)


@pytest.mark.parametrize(("aux", "layer"), [([0, 1, 1], None), ([0, 0, 0], 0)])
def test_init_from_base_starts_as_a_base_layer_reading_the_fused_state(aux, layer):
    # The fc passes the highest fused state (entering layer k) through; the midlayer copies
    # base layer `layer` (default the last): with the token embedding's half of q/k/v zeroed
    # and layer k, it returns the state entering layer k+1, and after the last layer (through
    # the copied norm and lm_head) the base's logits on the draft vocabulary.
    base = make_tiny_llama(seed=3, attention_bias=True, mlp_bias=True)
    draft = EagleDraft(
        EagleConfig.from_base(base.config, version=3, draft_vocab_size=32, aux_layer_ids=aux)
    ).eval()
    ids = torch.tensor([[5, 9, 2, 77, 130, 31, 8]])
    draft.set_vocab_map(torch.arange(0, 256, 8))
    assert draft.init_from_base(base, layer) == []
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(draft.midlayer.self_attn, name).weight[:, :64].data.zero_()
    with torch.no_grad():
        out = base(ids, output_hidden_states=True)
        states = out.hidden_states
        fused = draft.fuse(torch.cat([states[i] for i in aux], dim=-1))
        mid = draft(base.model.embed_tokens(ids), fused, torch.arange(7)[None])
        logits = draft.compute_logits(mid)
    torch.testing.assert_close(fused, states[aux[-1]])
    if layer is None:  # the last layer: hidden_states' last entry is after the final norm
        torch.testing.assert_close(logits, out.logits[..., ::8], atol=1e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(mid, states[layer + 1], atol=1e-5, rtol=1e-4)


def test_init_from_base_names_what_the_base_layer_lacks():
    base = make_tiny_llama(seed=3)
    config = EagleConfig.from_base(base.config, version=3, draft_vocab_size=32)
    config.mlp_bias = True  # a draft with biases the base has not
    draft = EagleDraft(config)
    draft.set_vocab_map(torch.arange(32))
    notes = draft.init_from_base(base)
    biases = ", ".join(f"midlayer.mlp.{p}_proj.bias" for p in ("gate", "up", "down"))
    assert notes == [f"{biases}: none in the base of that shape and kind, left as built"]
    torch.testing.assert_close(draft.lm_head.weight, base.lm_head.weight[:32])
    v1 = EagleDraft(EagleConfig.from_base(base.config, version=1))
    before = {k: v.clone() for k, v in v1.state_dict().items()}
    assert v1.init_from_base(base) == []  # EAGLE-1 stays as built
    assert all(torch.equal(before[k], v) for k, v in v1.state_dict().items())


def _tiny(config_class, model_class, **fields):
    from tests.conftest import TINY

    torch.manual_seed(5)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    config = config_class(**{k: TINY[k] for k in keys}, num_attention_heads=4, **fields)
    return model_class(config).eval().requires_grad_(False)


def test_init_from_base_says_what_a_qwen_layer_has_that_the_draft_has_not():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    base = _tiny(Qwen3Config, Qwen3ForCausalLM, num_key_value_heads=2, head_dim=16)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    draft.set_vocab_map(torch.arange(32))
    notes = draft.init_from_base(base)
    assert notes == [
        "the base layer's self_attn.q_norm.weight, self_attn.k_norm.weight: not in a Llama "
        "layer, left out"
    ]
    last = base.model.layers[-1]
    torch.testing.assert_close(draft.midlayer.mlp.up_proj.weight, last.mlp.up_proj.weight)
    torch.testing.assert_close(draft.norm.weight, base.model.norm.weight)


def test_init_from_base_reads_gemmas_norms_as_they_compute():
    """Gemma's RMSNorm scales by 1 + w (w near 0): copied as w, the draft's norms would scale by
    about 0. Its MLP reads pre_feedforward_layernorm; the post-norms have no place."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    base = _tiny(
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["full_attention"] * 2,
    )
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.normal_(std=0.1)
    config = EagleConfig.from_base(base.config, version=3, draft_vocab_size=32)
    assert config.rope_parameters["rope_theta"] == 1_000_000  # full attention's, of two
    draft = EagleDraft(config)
    draft.set_vocab_map(torch.arange(32))
    notes = draft.init_from_base(base)
    assert "post_attention_layernorm.weight, post_feedforward_layernorm.weight" in notes[0]
    assert "gelu_pytorch_tanh" in notes[1] and len(notes) == 2
    x = torch.randn(3, 64)
    last = base.model.layers[-1]
    for ours, theirs in (
        (draft.norm, base.model.norm),
        (draft.midlayer.hidden_norm, last.input_layernorm),
        (draft.midlayer.post_attention_layernorm, last.pre_feedforward_layernorm),
    ):
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rope_type", ["default", "longrope"])
def test_a_partially_rotary_base_gets_a_draft_that_rotates_every_dimension(rope_type):
    """Phi-4-mini rotates 3/4 of each head; transformers' Llama layer rotates all of it (with
    longrope's factors sized for 3/4 it broke), so the draft says so in its config."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": rope_type, "rope_theta": 5000.0, "partial_rotary_factor": 0.75}
    if rope_type == "longrope":  # factors for the 6 rotated frequency pairs of a 16-wide head
        rope |= {"short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
        rope |= {"original_max_position_embeddings": 64}
    base = _tiny(
        Phi3Config,
        Phi3ForCausalLM,
        num_key_value_heads=4,
        rope_parameters=rope,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    assert base.config.rope_parameters["partial_rotary_factor"] == 0.75
    for version in (1, 3):
        config = EagleConfig.from_base(base.config, version=version, draft_vocab_size=32)
        assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}
        draft = EagleDraft(config)
        ids = torch.tensor([[5, 9, 2, 77]])
        with torch.no_grad():
            state = base(ids, output_hidden_states=True).hidden_states[-1]  # (1,4,H)
            features = draft.fuse(torch.cat([state] * 3, -1)) if version == 3 else state
            out = draft(base.model.embed_tokens(ids), features, torch.arange(4)[None])
        assert out.shape == (1, 4, 64) and out.isfinite().all()


@pytest.mark.parametrize("kind", ["granite", "gemma2"])
def test_training_reads_a_bases_logits_as_its_forward_returns_them(kind):
    # the soft targets are the base's distribution: Granite divides its logits after the
    # lm_head, Gemma-2 soft-caps them (tanh(logits / cap) * cap)
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    from tests.conftest import TINY
    from train.features import base_targets

    torch.manual_seed(0)
    if kind == "granite":
        config, cls = GraniteConfig(**TINY, logits_scaling=8.0), GraniteForCausalLM
        config._attn_implementation = "sdpa"
    else:  # a cap of 2 bends logits of this size well away from the identity
        config = Gemma2Config(**TINY, head_dim=16, final_logit_softcapping=2.0)
        config._attn_implementation, cls = "eager", Gemma2ForCausalLM
    base = cls(config).eval().requires_grad_(False)
    ids = torch.tensor([[1, 5, 9, 22, 7]])
    want = base(input_ids=ids).logits
    logits, last, _ = read_hidden_states(base, ids, [1])
    torch.testing.assert_close(logits, want)
    draft_ids = torch.arange(0, 256, 4)
    kept, top, whole = base_targets(base, last[0], draft_ids, full=True)
    torch.testing.assert_close(whole, want[0])
    torch.testing.assert_close(kept, want[0][:, draft_ids])
    sliced, _, _ = base_targets(base, last[0], draft_ids, top=top)  # the offline path
    torch.testing.assert_close(sliced, want[0][:, draft_ids])


def test_init_from_base_names_what_a_granite_or_starcoder2_layer_does_otherwise():
    # Granite scales its residual branches and attention scores by config values the Llama
    # layer lacks; StarCoder2's MLP (c_fc / c_proj) is not copied, so no activation is named
    from transformers import (
        GraniteConfig,
        GraniteForCausalLM,
        Starcoder2Config,
        Starcoder2ForCausalLM,
    )

    granite = GraniteForCausalLM(GraniteConfig(**TINY, residual_multiplier=0.22))
    draft = EagleDraft(EagleConfig.from_base(granite.config, version=3))
    notes = " ".join(draft.init_from_base(granite))
    assert "residual_multiplier 0.22" in notes and "attention_multiplier 1.0" in notes
    coder = Starcoder2ForCausalLM(Starcoder2Config(**TINY))
    draft = EagleDraft(EagleConfig.from_base(coder.config, version=3))
    notes = " ".join(draft.init_from_base(coder))
    assert "mlp.c_fc.weight" in notes and "midlayer.mlp.up_proj.weight" in notes
    assert "the MLP: copied" not in notes
    llama = make_tiny_llama()  # a Llama's layer carries over whole
    assert EagleDraft(EagleConfig.from_base(llama.config, version=3)).init_from_base(llama) == []


def test_a_draft_built_on_the_cpu_takes_its_vocabulary_under_another_default_device():
    """torch.device("cuda") as a context (the GPU tests build their drafts so) makes the default
    device of tensors created without one: the vocabulary map and the norm probe name theirs
    (the meta device stands in for CUDA here)."""
    from heads.eagle import _as_llama_norm

    base = make_tiny_llama(seed=3)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    norm = base.model.norm
    with torch.device("meta"):
        draft.set_vocab_map(torch.arange(0, 256, 8, device="cpu"))
        assert _as_llama_norm(norm, norm.weight) is norm.weight  # its probe draws on the CPU
    assert draft.d2t.device.type == "cpu" and draft.d2t.tolist() == [7 * i for i in range(32)]
    assert draft.t2d.sum() == 32
