import pytest
import torch

import heads.base as base_module
from heads import load_base
from heads.cpu import PackedLinear, can_prepack


@pytest.mark.slow
def test_embedded_model_loads_generates_and_caches(smollm2, monkeypatch):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.config.vocab_size == 49152 and model.dtype == torch.float32
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    # fp32 on CPU: linear weights prepacked for oneDNN (heads.cpu), tied lm_head kept tied.
    assert isinstance(model.lm_head, PackedLinear) == can_prepack()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8 or tokenizer.eos_token_id in out[0, ids.shape[1] :]
    assert tokenizer.decode(out[0, ids.shape[1] :]).strip()
    # The second load must read the cached safetensors copy, not convert the GGUF again.
    cached = base_module.cache_dir() / base_module.EMBEDDED_NAME
    assert (cached / "model.safetensors").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("GGUF converted again")

    monkeypatch.setattr(base_module, "_convert_gguf", no_conversion)
    again, _ = load_base("smollm2-135m-instruct", device="cpu")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_missing_gguf_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_base(tmp_path / "absent.gguf")


def test_a_missing_base_folder_is_said():
    for name in ("./no-such-model", "runs/x/no-such-model"):  # two slashes: not a Hub id
        with pytest.raises(FileNotFoundError, match=f"base model folder not found: {name}"):
            load_base(name, device="cpu")


def test_a_name_that_does_not_load_says_what_was_meant(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no Hub retries
    # a misspelt embedded name cannot be a Hub id (none without an owner is that new): said at
    # once, without asking the Hub
    monkeypatch.setattr(base_module.AutoTokenizer, "from_pretrained", pytest.fail, raising=True)
    with pytest.raises(OSError, match="did you mean the embedded model 'smollm2-135m-instruct'"):
        load_base("SmolLM2-135M", device="cpu")
    monkeypatch.undo()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="if it is a Hub id, check its spelling and the network"):
        load_base("no-such-model-anywhere", device="cpu")
    # a Hub id that did not load (gated, offline) is not taken for a misspelt embedded name
    with pytest.raises(OSError) as failed:
        load_base("HuggingFaceTB/SmolLM2-360M-Instruct", device="cpu")
    assert "did you mean" not in str(failed.value) and "spelling" not in str(failed.value)
