"""Which bases and draft models the generator takes, and how: a base whose forward cannot verify
a tree is refused, logits scaled after the lm_head are the forward's, a draft model of a padded
vocabulary drafts, an unmerged adapter is refused, longrope switches as in HF; and options given
with adaptive=True."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import DynamicCache, GenerationConfig, LlamaConfig, Phi3Config

from heads import MedusaConfig, MedusaHeads
from inference import SpeculativeGenerator, plain_generation_config
from inference.base_checks import (
    _LOGITS_SETTINGS,
    not_full_attention,
    plain_generation,
    position_rules,
    warn_unapplied_logits_settings,
)
from tests.conftest import TINY, change_logits, make_tiny_llama


def test_bases_whose_forward_cannot_verify_a_tree_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    base = make_tiny_llama()
    base.config._attn_implementation = "flash_attention_2"  # packs sequences by position ids
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*'sdpa'"):
        SpeculativeGenerator(base)
    sliding = MistralForCausalLM(
        MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
        )
    )
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer cache layers") as refused:
        SpeculativeGenerator(sliding)
    assert "as in Mistral v0.1" in str(refused.value)  # and what to do instead:
    assert "export (scripts/export.py)" in str(refused.value)
    from inference.drafters.model import ModelDrafter

    with pytest.raises(ValueError, match="the draft model has DynamicSlidingWindowLayer cache"):
        ModelDrafter(sliding)  # its cache is cropped to the accepted tokens too
    sliding.config.sliding_window = sliding.config.max_position_embeddings  # never applies
    SpeculativeGenerator(sliding)  # as Phi-3.5-mini's 256k window over 128k positions
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no .model decoder"):
        SpeculativeGenerator(gpt2)


def test_bases_that_scale_their_logits_are_verified_on_the_forwards_logits():
    # Granite divides its logits by logits_scaling after the lm_head, Cohere multiplies them by
    # logit_scale, Gemma-2 soft-caps them: the verifier computes them as the forward does (the
    # sampling law is checked in test_sampling_generate.py); a transform it does not know is
    # refused, not sampled around. (A Gemma-2 whose sliding window is narrower than its context,
    # every released one, is refused for that: the test above.)
    from transformers import (
        Cohere2Config,
        Cohere2ForCausalLM,
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
    )

    from tests.conftest import TINY

    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    gemma2 = Gemma2Config(**TINY, head_dim=16, final_logit_softcapping=2.0, sliding_window=512)
    for cls, config in (
        (GraniteForCausalLM, GraniteConfig(**TINY, logits_scaling=8.0)),
        (CohereForCausalLM, CohereConfig(**TINY, logit_scale=0.0625)),
        (Cohere2ForCausalLM, Cohere2Config(**TINY, logit_scale=0.25)),  # Command R7B's
        (Gemma2ForCausalLM, gemma2),  # transformers runs it with eager attention only
    ):
        torch.manual_seed(0)
        config._attn_implementation = "eager" if cls is Gemma2ForCausalLM else "sdpa"
        base = cls(config).eval().requires_grad_(False)
        gen = SpeculativeGenerator(base, None, num_tokens=3, adaptive=False)
        hidden = base.model(input_ids=prompt).last_hidden_state[0]
        torch.testing.assert_close(gen.lm_head(hidden), base(input_ids=prompt).logits[0])
        want = base.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
        got = gen.generate(prompt, max_new_tokens=24, eos_token_id=[]).sequences
        assert torch.equal(got, want), cls.__name__
        if cls is GraniteForCausalLM:  # EAGLE-1 drafts on the base's logits, scaled too
            from heads import EagleConfig, EagleDraft
            from inference.drafters.eagle import EagleDrafter

            draft = EagleDraft(EagleConfig.from_base(base.config, version=1))
            log_probs = EagleDrafter(draft, base)._log_probs(hidden)
            torch.testing.assert_close(log_probs, (base.lm_head(hidden) / 8).log_softmax(-1))
    capped = make_tiny_llama()
    capped.lm_head.weight.mul_(8)
    change_logits(capped, torch.tanh)
    with pytest.raises(ValueError, match="computes its logits otherwise than its output embed"):
        SpeculativeGenerator(capped)


@pytest.mark.parametrize("family", ["cohere2", "hyperclovax", "falcon_h1"])
def test_the_logits_are_read_as_the_forward_scales_them(family):
    # What training reads as the base's logits (heads.base.output_logits), for the bases that
    # scale them after the lm_head beside the test above's: Command R7B multiplies them by
    # logit_scale, HyperCLOVA X by logits_scaling (Granite divides), Falcon-H1 by
    # lm_head_multiplier (a Mamba hybrid: trained for, not decoded).
    import transformers

    from heads.base import logits_scaling, output_logits
    from tests.conftest import TINY

    name, scale = {
        "cohere2": ("Cohere2", {"logit_scale": 0.25}),
        "hyperclovax": ("HyperCLOVAX", {"logits_scaling": 0.5}),
        "falcon_h1": ("FalconH1", {"lm_head_multiplier": 0.3}),
    }[family]
    config = getattr(transformers, f"{name}Config")(**TINY, **scale)
    torch.manual_seed(0)
    base = getattr(transformers, f"{name}ForCausalLM")(config).eval().requires_grad_(False)
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    hidden = base.model(input_ids=prompt).last_hidden_state
    assert logits_scaling(base) is not None
    torch.testing.assert_close(output_logits(base, hidden), base(input_ids=prompt).logits)


def test_a_draft_model_padded_to_fewer_rows_drafts_for_the_base():
    # Qwen2.5 0.5B-3B pad the tokenizer's vocabulary to 151,936 rows, 7B-72B to 152,064: the
    # small ones draft for the large ones (the sampling law: test_sampling_generate.py)
    from inference import ModelDrafter

    base, small = make_tiny_llama(), make_tiny_llama(seed=1, vocab_size=200)
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    want = base.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    for options in ({"num_tokens": 3}, {"choices": [[0], [1], [0, 0]]}):
        got = SpeculativeGenerator(base, small, **options).generate(prompt, 24, eos_token_id=[])
        assert torch.equal(got.sequences, want), options
    with pytest.raises(ValueError, match=r"ModelDrafter\(model, ..., vocab_size=256\)"):
        SpeculativeGenerator(base, ModelDrafter(small, num_tokens=3))
    SpeculativeGenerator(base, ModelDrafter(small, num_tokens=3, vocab_size=256))
    # the same option given to the generator: its first sampled step would mix 256 and 300 columns
    with pytest.raises(
        ValueError, match=r"SpeculativeGenerator\(base, model, ..., vocab_size=256\)"
    ):
        SpeculativeGenerator(base, small, num_tokens=3, vocab_size=300)
    with pytest.raises(ValueError, match=r"vocabulary \(300 tokens\) is larger than the base's"):
        SpeculativeGenerator(base, make_tiny_llama(seed=1, vocab_size=300))


def test_adaptive_with_options_numpy_counts_and_unmerged_adapters():
    from peft import LoraConfig, get_peft_model

    base = make_tiny_llama()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    # adaptive=True with settings: those settings or plain decoding, not the default arms
    gen = SpeculativeGenerator(base, heads, adaptive=True, choices=[[0], [1], [0, 0]])
    assert gen.arms == [None, {}] and gen.drafter.tree.num_nodes == 4
    # a drafter object with adaptive=True: the drafter's own arms, as for heads (the README's
    # heads plus an n-gram drafter with a corpus, which only a drafter object can carry)
    from inference import NgramDrafter

    union = [heads, NgramDrafter(num_tokens=4)]
    arms = SpeculativeGenerator(base, union, adaptive=True).arms
    assert arms == SpeculativeGenerator(base, [heads, None]).arms and len(arms) > 2
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    out = gen.generate(prompt, max_new_tokens=np.int64(6), eos_token_id=[])  # as HF takes it
    assert out.sequences.shape == (1, 11)
    peft = get_peft_model(make_tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"merge the adapter first, base = base.merge_and_unload"):
        SpeculativeGenerator(peft)
    SpeculativeGenerator(peft.merge_and_unload())


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "phi3", "cohere", "stablelm"])
def test_other_llama_style_bases_decode_their_own_greedy_output(family):
    # The README's "Your own model": bases of other families with full attention (Qwen2's
    # attention biases, Qwen3's q/k norms, Phi-3's fused projections, Cohere's and StableLM's
    # LayerNorms, whose epsilon their configs name otherwise) decode with fresh Medusa heads and
    # a fresh EAGLE-3 draft started from the base, token for token as their generate
    import transformers

    from heads import EagleConfig, EagleDraft

    config_class, model_class = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "cohere": ("CohereConfig", "CohereForCausalLM"),
        "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
    }[family]
    from tests.conftest import TINY

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**TINY)
    config._attn_implementation = "sdpa"
    if family in ("cohere", "stablelm"):
        config.layer_norm_eps = 3e-4  # the draft's norms take it
    base = getattr(transformers, model_class)(config).eval().requires_grad_(False)
    base.config.name_or_path = f"tiny-{family}"
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    want = base.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    medusa = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    eagle = EagleDraft(EagleConfig.from_base(base.config, version=3))
    notes = " ".join(eagle.init_from_base(base))  # what does not carry over to a Llama layer
    named = {
        "qwen2": ["self_attn.q_proj.bias"],
        "qwen3": ["self_attn.q_norm.weight"],
        "mistral": [],
        # fused qkv_proj / gate_up_proj: the midlayer's stay as built
        "phi3": ["midlayer.self_attn.q_proj.weight", "midlayer.mlp.up_proj.weight", "qkv_proj"],
        # LayerNorms: the draft's RMSNorms stay as built; StableLM's biases have no place
        "cohere": ["midlayer.hidden_norm.weight"],
        "stablelm": ["midlayer.hidden_norm.weight", "input_layernorm.bias"],
    }[family]
    assert all(name in notes for name in named) and bool(notes) == bool(named), notes
    eps = getattr(config, "layer_norm_eps", None) or config.rms_norm_eps
    assert eagle.config.rms_norm_eps == eps
    eagle1 = EagleDraft(EagleConfig.from_base(base.config, version=1))
    for heads in (medusa, eagle, eagle1):
        for options in ({}, {"adaptive": False}):
            got = SpeculativeGenerator(base, heads, **options).generate(prompt, 24, eos_token_id=[])
            assert torch.equal(got.sequences, want), (family, type(heads).__name__, options)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_longrope_base_decodes_its_greedy_output_across_the_switch(family):
    """Longrope (Phi-3.5-mini, Phi-4-mini) rotates a forward's tokens with the long factors once
    its last position reaches original_max_position_embeddings: HF's one-token steps switch
    token by token (Phi-3's generate computes the sequence again there), and the loop takes
    plain steps across the switch. The base drafts for itself: trees accepted whole, reaching
    the switch from every distance."""
    import transformers

    from tests.conftest import TINY

    torch.manual_seed(0)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0**i for i in range(8)],
    }
    name = {"llama": "Llama", "phi3": "Phi3"}[family]
    switch = {"original_max_position_embeddings": 64} if family == "phi3" else {}  # its own
    config = getattr(transformers, f"{name}Config")(**TINY, rope_scaling=rope, **switch)
    config._attn_implementation = "sdpa"
    base = getattr(transformers, f"{name}ForCausalLM")(config).eval().requires_grad_(False)
    with torch.no_grad():  # sharper attention, so that the factors change the choices
        for layer in base.model.layers:
            for proj in ("q_proj", "k_proj", "qkv_proj"):
                if hasattr(layer.self_attn, proj):
                    getattr(layer.self_attn, proj).weight.mul_(6)
    gen = SpeculativeGenerator(base, base, num_tokens=4, adaptive=False)
    for length in range(56, 66):
        prompt = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(length))
        want = base.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
        got = gen.generate(prompt, max_new_tokens=24, eos_token_id=[])
        assert torch.equal(got.sequences, want), (family, length)
        assert max(got.accepted_lengths) == 5  # trees ran and were accepted whole
    # and the factors matter: 4 tokens over the switch in one forward are not 4 one by one
    ids = torch.randint(3, 256, (1, 66), generator=torch.Generator().manual_seed(0))
    logits = []
    for steps in ([range(62, 66)], [[i] for i in range(62, 66)]):
        cache = DynamicCache(config=config)
        base(ids[:, :62], cache=cache)
        logits.append(torch.cat([base(ids[:, list(s)], cache=cache).logits for s in steps], 1))
    assert not torch.allclose(*logits, atol=1e-3)


def test_a_draft_model_of_a_shorter_context_drafts_within_it():
    # GPT-2's absolute position embeddings end at n_positions: past it the loop takes plain
    # steps (and its trees, which need a few positions more, stop a little earlier)
    from transformers import GPT2Config, GPT2LMHeadModel

    base = make_tiny_llama()
    small = GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    small._attn_implementation = "sdpa"
    draft = GPT2LMHeadModel(small).eval().requires_grad_(False)
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    want = base.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=None)
    for options in ({"num_tokens": 3, "adaptive": False}, {}):
        got = SpeculativeGenerator(base, draft, **options).generate(prompt, 60, eos_token_id=[])
        assert torch.equal(got.sequences, want), options
        assert got.accepted_lengths[-30:] == [1] * 30, options  # plain past position 64
    rotary = make_tiny_llama(max_position_embeddings=64)  # the base, said to have 64: it
    # rotates any position, so it drafts (whole chains) past 64
    gen = SpeculativeGenerator(base, rotary, num_tokens=3, adaptive=False)
    got = gen.generate(prompt, 60, eos_token_id=[])
    assert torch.equal(got.sequences, want) and got.accepted_lengths[-5:-1] == [4] * 4


def test_mixed_layer_kinds_are_not_said_to_be_a_sliding_window():
    assert "as in Mistral v0.1" in not_full_attention(["DynamicSlidingWindowLayer"])
    mixed = not_full_attention(["DynamicSlidingWindowLayer", "LinearAttentionLayer"])
    assert "Mamba, convolution or linear-attention" in mixed and "Mistral" not in mixed


def test_a_longrope_of_one_layer_type_sets_its_switch():
    # transformers 5 may give rope_parameters per layer type: a longrope among them switches
    longrope = {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
    }
    config = SimpleNamespace(
        rope_parameters={"full_attention": longrope, "sliding_attention": {"rope_type": "default"}},
        model_type="llama",
    )
    assert position_rules(config).crossings == (64,)


def test_a_phi3_without_longrope_still_keeps_trees_off_its_recompute_point():
    config = Phi3Config(**TINY, original_max_position_embeddings=64)
    rules = position_rules(config)
    assert rules.recompute_at == 64 and rules.crossings == (64,)


def test_min_new_tokens_of_the_generation_config_is_said_and_left_out():
    base = make_tiny_llama()
    base.generation_config.min_new_tokens = 5  # HF generate suppresses the eos until then
    with pytest.warns(UserWarning, match="min_new_tokens=5"):
        warn_unapplied_logits_settings(base)
    assert plain_generation_config(base).min_new_tokens is None


def test_a_base_that_scales_its_logits_slightly_is_refused():
    # a scaling the verifier does not know changes the sampled law even at 0.5%: refused
    base = make_tiny_llama()
    change_logits(base, lambda logits: logits * 1.005)
    with pytest.raises(ValueError, match="computes its logits otherwise"):
        SpeculativeGenerator(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeGenerator(make_tiny_llama())  # the unscaled base is taken


def test_a_longrope_under_the_older_type_key_sets_its_switch():
    # Phi-3's config.json files name the rope kind under "type" (transformers 4's rope_scaling)
    config = SimpleNamespace(
        rope_scaling={
            "type": "longrope",
            "original_max_position_embeddings": 4096,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
        },
        model_type="llama",
    )
    assert position_rules(config).crossings == (4096,)


@pytest.mark.parametrize("model_type", ["phi3", "phimoe", "phi4_multimodal"])
def test_the_phi3_family_recomputes_at_its_original_context(model_type):
    config = SimpleNamespace(model_type=model_type, original_max_position_embeddings=64)
    rules = position_rules(config)
    assert rules.recompute_at == 64 and rules.crossings == (64,)


def test_other_families_with_an_original_context_take_trees_across_it():
    # only the Phi-3 family's generate computes the sequence again there
    config = LlamaConfig(**TINY, original_max_position_embeddings=64)
    rules = position_rules(config)
    assert rules.recompute_at is None and rules.crossings == ()


NOT_NEUTRAL = {
    "repetition_penalty": 1.05,
    "no_repeat_ngram_size": 3,
    "min_length": 4,
    "min_new_tokens": 5,
    "bad_words_ids": [[7]],
    "suppress_tokens": [7],
    "begin_suppress_tokens": [7],
    "sequence_bias": {(7,): -1.0},
    "forced_eos_token_id": 2,
    "exponential_decay_length_penalty": (4, 1.5),
}


@pytest.mark.parametrize("name", sorted(NOT_NEUTRAL))
def test_each_logits_setting_of_the_generation_config_is_said_and_left_out(name):
    assert set(NOT_NEUTRAL) == set(_LOGITS_SETTINGS)
    base = make_tiny_llama()
    setattr(base.generation_config, name, NOT_NEUTRAL[name])
    with pytest.warns(UserWarning, match=f"sets {name}="):
        warn_unapplied_logits_settings(base)
    assert getattr(plain_generation_config(base), name) is None
    assert getattr(base.generation_config, name) == NOT_NEUTRAL[name]  # the base's own kept


def test_plain_generation_takes_the_config_given_and_gives_the_bases_back():
    base = make_tiny_llama()
    base.generation_config.repetition_penalty = 1.3
    kept = base.generation_config
    given = GenerationConfig(max_new_tokens=3, do_sample=False)  # as the scripts build it
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    with plain_generation(base, given):
        assert base.generation_config is given
        out = base.generate(prompt)
    assert out.shape == (1, 8)  # the given config's max_new_tokens
    assert base.generation_config is kept
