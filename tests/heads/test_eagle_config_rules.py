"""EagleConfig's rules: aux layer and draft vocabulary ranges, format-1 and engine keys (bias,
no draft vocabulary, top-level rope_theta), norm epsilon names, partial rotary factors, head_dim
and attention bias from the base, the engines' refusals."""

from __future__ import annotations

import pytest

from heads import EagleConfig

# An EAGLE-1 draft's config.json as an engine's (or another trainer's) folder holds it.
ENGINE_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "num_hidden_layers": 1,
}


def test_validate_refuses_an_aux_layer_id_equal_to_the_base_layer_count():
    """aux ids name the state *entering* layer i, i in [0, L): L itself is no base layer (E7)."""
    EagleConfig(base_hidden_layers=4, aux_layer_ids=[0, 1, 3]).validate()  # the last layer: fine
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        EagleConfig(base_hidden_layers=4, aux_layer_ids=[0, 1, 4]).validate()


def test_validate_refuses_a_draft_vocabulary_larger_than_the_base_one():
    """EAGLE-3's d2t maps draft ids into the base vocabulary: it cannot be the larger (E8)."""
    EagleConfig(vocab_size=256, draft_vocab_size=256).validate()
    with pytest.raises(ValueError, match=r"draft_vocab_size=257 must be in \(0, 256\]"):
        EagleConfig(vocab_size=256, draft_vocab_size=257).validate()


def test_an_eagle1_config_of_format_1_reads_its_bias_key_as_the_fc_bias():
    """Format 1 wrote the EAGLE-1 fc bias as "bias": true (E11); it is no attention bias."""
    tiny = dict(ENGINE_CONFIG)
    assert EagleConfig.from_dict({**tiny, "bias": True}).fc_bias is True
    config = EagleConfig.from_dict(dict(tiny))
    assert config.fc_bias is False and config.attention_bias is False


def test_an_eagle3_config_naming_no_draft_vocabulary_drafts_over_the_whole_one():
    """The engines draft over the whole vocabulary when draft_vocab_size is absent or null
    (E12): not EAGLE-3's default 32000."""
    data = {
        **ENGINE_CONFIG,
        "architectures": ["LlamaForCausalLMEagle3"],
        "vocab_size": 50000,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    }
    assert EagleConfig.from_dict(dict(data)).draft_vocab_size == 50000
    assert EagleConfig.from_dict({**data, "draft_vocab_size": None}).draft_vocab_size == 50000


@pytest.mark.parametrize("key", ["rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps"])
def test_the_draft_takes_the_base_norm_epsilon_under_each_name(key):
    """LayerNorm families (Cohere, StableLM: layer_norm_eps; StarCoder2: norm_epsilon) (E13)."""
    from types import SimpleNamespace

    from heads.eagle_config import norm_eps

    assert norm_eps(SimpleNamespace(**{key: 1e-6})) == 1e-6
    assert norm_eps(SimpleNamespace()) == 1e-5


@pytest.mark.parametrize("ids", [[1, 2, 4], [-1, 1, 2]])
def test_check_base_refuses_aux_layers_outside_the_given_base(ids):
    """Another trainer's folder records no base layer count, so only `check_base` can tell that
    its aux layers are not the given base's: the states entering layers 0..L-1 (E15)."""
    from tests.conftest import make_tiny_llama

    base = make_tiny_llama(num_hidden_layers=4).config
    EagleConfig(aux_layer_ids=[0, 1, 3]).check_base(base)
    with pytest.raises(ValueError, match="has 4 layers"):
        EagleConfig(aux_layer_ids=ids).check_base(base)


def test_from_base_takes_the_base_head_dim_and_attention_bias():
    """Bases whose head_dim is not H / heads (Qwen3, Gemma) and whose attention has biases
    (Qwen2): the draft layer mirrors them (E18, E19)."""
    from tests.conftest import make_tiny_llama

    base = make_tiny_llama(head_dim=32, attention_bias=True, num_hidden_layers=4).config
    config = EagleConfig.from_base(base)
    assert config.head_dim == 32 and config.llama_config().head_dim == 32
    assert config.attention_bias is True
    assert config.to_dict()["attention_bias"] is True
    assert EagleConfig.from_base(make_tiny_llama(num_hidden_layers=4).config).head_dim == 16


def test_a_partial_rotary_factor_named_on_the_config_rotates_the_whole_head_at_the_base_theta():
    """Phi-4-mini names partial_rotary_factor beside longrope's parameters (E20)."""
    from types import SimpleNamespace

    from heads.eagle_config import draft_rope_parameters

    rope = {
        "rope_type": "longrope",
        "rope_theta": 250000.0,
        "long_factor": [1.0],
        "short_factor": [1.0],
    }
    base = SimpleNamespace(rope_parameters=dict(rope), partial_rotary_factor=0.75)
    assert draft_rope_parameters(base) == {"rope_type": "default", "rope_theta": 250000.0}
    assert draft_rope_parameters(SimpleNamespace(rope_parameters=dict(rope))) == rope


def test_a_top_level_rope_theta_is_read():
    """Engine configs name rope_theta at the top level, without rope_parameters (E21)."""
    data = {**ENGINE_CONFIG, "rope_theta": 500000.0}
    config = EagleConfig.from_dict(data)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert EagleConfig.from_dict(config.to_dict()).rope_parameters["rope_theta"] == 500000.0


def test_from_base_refuses_a_repeated_aux_layer_from_three_base_layers_on():
    """A base of 3 layers has 3 distinct ones: repeating one is refused there (E22); only a
    base of under 3 layers may repeat."""
    from tests.conftest import make_tiny_llama

    with pytest.raises(ValueError, match="ascending order, each once"):
        EagleConfig.from_base(make_tiny_llama(num_hidden_layers=3).config, aux_layer_ids=[1, 1, 2])
    EagleConfig.from_base(make_tiny_llama().config, aux_layer_ids=[0, 1, 1])


def test_an_eagle1_draft_with_mlp_biases_only_is_one_vllm_serves():
    """vLLM lacks only EAGLE-1's fc bias; SGLang lacks the MLP biases (E17)."""
    from heads.eagle_config import engine_refusal

    config = EagleConfig(version=1, mlp_bias=True, fc_bias=False)
    assert engine_refusal(config, "vllm") is None
    assert "no MLP biases" in engine_refusal(config, "sglang")
    config = EagleConfig(version=1, mlp_bias=False, fc_bias=True)
    assert "fc has no bias" in engine_refusal(config, "vllm")
    assert engine_refusal(config, "sglang") is None


EAGLE3_CONFIG = {  # another trainer's EAGLE-3 config.json, as an engine reads it
    "model_type": "llama",
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "num_hidden_layers": 1,
    "eagle_aux_hidden_state_layer_ids": [0, 1, 3],
}


@pytest.mark.parametrize("ids", [[0, 1], [0, 1, 2, 3]])
def test_validate_refuses_an_eagle3_draft_fusing_other_than_three_layers(ids):
    """EAGLE-3's fc reads three base states concatenated (3H): two or four ids are no EAGLE-3."""
    EagleConfig(aux_layer_ids=[0, 1, 2]).validate()
    with pytest.raises(ValueError, match="EAGLE-3 fuses three base layers"):
        EagleConfig(aux_layer_ids=ids).validate()


@pytest.mark.parametrize("key", ["eagle_aux_hidden_state_layer_ids", "eagle_config"])
def test_a_true_among_the_aux_layer_ids_is_no_layer_number(key):
    """JSON's true is Python's 1: read as a layer number it would fuse layer 1 (or 2) unsaid."""
    assert EagleConfig.from_dict(dict(EAGLE3_CONFIG)).aux_layer_ids == [0, 1, 3]
    data = {k: v for k, v in EAGLE3_CONFIG.items() if k != "eagle_aux_hidden_state_layer_ids"}
    ids = [True, 2, 3]
    data[key] = ids if key != "eagle_config" else {"eagle_aux_hidden_state_layer_ids": ids}
    with pytest.raises(ValueError, match=r"is \[True, 2, 3\], expected a list of layer numbers"):
        EagleConfig.from_dict(data)


def test_a_top_level_rope_theta_of_true_is_refused():
    """rope_theta true is no theta (Python would compute with 1.0): a hand-edit to name."""
    data = {**EAGLE3_CONFIG, "rope_theta": 1}
    assert EagleConfig.from_dict(data).rope_parameters["rope_theta"] == 1
    with pytest.raises(ValueError, match="rope_theta is True, expected a number"):
        EagleConfig.from_dict({**EAGLE3_CONFIG, "rope_theta": True})
