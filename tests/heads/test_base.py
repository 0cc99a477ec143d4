import shutil
from pathlib import Path

import pytest
import torch
from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

import heads.base as base_module
from heads import load_base
from heads.base import default_dtype, input_device, logits_scaling, output_logits, usable_device
from heads.cpu import PackedLinear, can_prepack
from inference import SpeculativeGenerator
from tests.conftest import TINY, make_tiny_llama, user_prompt_ids


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
    ids = user_prompt_ids(tokenizer, "Name a colour.")
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


def test_dtype_names_are_checked_and_auto_is_the_default(tmp_path, smollm2_tokenizer):
    from tests.conftest import make_tiny_llama

    make_tiny_llama(vocab_size=len(smollm2_tokenizer)).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no tokenizer .*tokenizer.save_pretrained"):
        load_base(str(tmp_path), device="cpu")  # the weights alone
    smollm2_tokenizer.save_pretrained(tmp_path)
    model, _ = load_base(str(tmp_path), dtype="auto", device="cpu")
    assert model.dtype == torch.float32
    # accelerate's placement instead of a device (on this machine: the CPU, hooks or not)
    placed, _ = load_base(str(tmp_path), device_map={"": "cpu"})
    assert placed.lm_head.weight.device.type == "cpu" and placed.dtype == torch.float32
    assert not any(isinstance(m, PackedLinear) for m in placed.modules())  # not under hooks
    assert any(isinstance(m, PackedLinear) for m in model.modules()) or not can_prepack()
    assert torch.equal(placed.lm_head.weight, model.lm_head.weight)
    with pytest.raises(ValueError, match="give device or device_map, not both"):
        load_base(str(tmp_path), device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="dtype='fp32' is no floating torch dtype"):
        load_base(str(tmp_path), dtype="fp32", device="cpu")
    with pytest.raises(ValueError, match="dtype='Tensor' is no floating torch dtype"):
        load_base(str(tmp_path), dtype="Tensor", device="cpu")


def test_a_damaged_converted_copy_of_the_embedded_model_says_to_remove_it(
    tmp_path, monkeypatch, smollm2_tokenizer
):
    """The GGUF's converted copy, cut short or missing its weights (disk trouble, a hand-deleted
    file): the error names the folder to remove, not a traceback or "did you mean" the name."""
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    copy = tmp_path / base_module.EMBEDDED_NAME
    make_tiny_llama(vocab_size=len(smollm2_tokenizer)).save_pretrained(copy)
    smollm2_tokenizer.save_pretrained(copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    remove = rf"converted copy in {copy} cannot be loaded .*remove that folder"
    with pytest.raises(FileNotFoundError, match=remove) as cut:
        load_base("smollm2-135m-instruct", device="cpu")
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=remove) as missing:
        load_base("smollm2-135m-instruct", device="cpu")
    assert "did you mean" not in str(cut.value) + str(missing.value)
    mine = tmp_path / "my-model"  # a model of the user's own kept in the cache folder
    shutil.copytree(copy, mine)
    with pytest.raises(FileNotFoundError, match="could not be loaded") as own:
        load_base(str(mine), device="cpu")
    assert "converts the GGUF" not in str(own.value)


def test_missing_gguf_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_base(tmp_path / "absent.gguf")


def test_a_missing_base_folder_is_said():
    for name in ("./no-such-model", "runs/x/no-such-model"):  # two slashes: not a Hub id
        with pytest.raises(FileNotFoundError, match=f"base model folder not found: {name}"):
            load_base(name, device="cpu")


def test_a_heads_folder_given_as_the_base_says_which_base_to_load(
    tmp_path, monkeypatch, smollm2_tokenizer
):
    """--base and --heads swapped: the heads folder (or the training run's) is named as heads,
    with the base they record, not as a base folder without a tokenizer. A Medusa-2 base, whose
    config Medusa's reference marks with its heads' count, is still a base."""
    import json

    from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads

    base = make_tiny_llama(vocab_size=len(smollm2_tokenizer))
    base.config.name_or_path = "org/tiny-base"
    MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).save_pretrained(
        tmp_path / "run/heads"
    )
    EagleDraft(EagleConfig.from_base(base.config, version=3)).save_pretrained(tmp_path / "e3")
    monkeypatch.chdir(tmp_path)
    for given in (tmp_path / "run/heads", tmp_path / "run", "run", tmp_path / "e3"):
        with pytest.raises(
            FileNotFoundError,
            match=r"holds draft heads, not a base model: load the base they were trained for "
            r"\(org/tiny-base\) with load_base, and these heads with load_heads",
        ):
            load_base(given, device="cpu")
    base.save_pretrained(tmp_path / "medusa2")
    smollm2_tokenizer.save_pretrained(tmp_path / "medusa2")
    config = json.loads((tmp_path / "medusa2/config.json").read_text())
    config.update(medusa_num_heads=3, medusa_num_layers=1)
    (tmp_path / "medusa2/config.json").write_text(json.dumps(config))
    assert load_base(tmp_path / "medusa2", device="cpu")[0].config.medusa_num_heads == 3


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
    # offline, huggingface_hub's message blames the network: the hint says the Hub was not asked
    with pytest.raises(OSError, match="offline mode is on.* so the Hub was not asked"):
        load_base("no-such-model-anywhere", device="cpu")
    # a Hub id that did not load (gated, offline) is not taken for a misspelt embedded name
    with pytest.raises(OSError) as failed:
        load_base("HuggingFaceTB/SmolLM2-360M-Instruct", device="cpu")
    assert "did you mean" not in str(failed.value)
    assert "the Hub was not asked" in str(failed.value)
    # online, a name without an owner is told a Hub id's form
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert "check its spelling and the network" in base_module._name_hint("no-such-model")
    assert base_module._name_hint("owner/no-such-model") == ""


def test_processes_converting_at_once_keep_the_first_copy(tmp_path, monkeypatch, smollm2_tokenizer):
    """accelerate launch: every process converts a GGUF none has cached yet. A copy already in
    place when another finishes is kept (another process may be reading it), whether it came
    before the check or between the check and the rename."""
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(vocab_size=len(smollm2_tokenizer))
    monkeypatch.setattr(
        base_module.AutoTokenizer, "from_pretrained", lambda *a, **k: smollm2_tokenizer
    )
    monkeypatch.setattr(base_module.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    out = tmp_path / "cache" / "model"

    def other_process_finished():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")  # the other's copy, being read

    gguf = tmp_path / "m.gguf"
    other_process_finished()
    base_module._convert_gguf(gguf, out, "m")  # finds it before renaming: keeps it
    assert (out / "config.json").read_text() == "{}" and not (out / "model.safetensors").exists()
    shutil.rmtree(out)
    rename = Path.rename

    def racing_rename(self, target):
        other_process_finished()  # lands between the check and this rename
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", racing_rename)
    base_module._convert_gguf(gguf, out, "m")
    assert (out / "config.json").read_text() == "{}"
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no temporary copy left
    monkeypatch.setattr(Path, "rename", rename)
    shutil.rmtree(out)
    base_module._convert_gguf(gguf, out, "m")  # alone: its own copy
    assert (out / "model.safetensors").is_file()


def test_an_architecture_without_sdpa_loads_with_eager(tmp_path, smollm2_tokenizer, caplog):
    """transformers refuses sdpa for Gemma-2 (its soft-capping): the default falls back to eager,
    and says so; eager asked for is what it was."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.conftest import TINY

    tok = smollm2_tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    sizes = dict(vocab_size=len(tok), head_dim=16, pad_token_id=tok.pad_token_id, **ids)
    Gemma2ForCausalLM(Gemma2Config(**{**TINY, **sizes})).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="heads.base"):
        model, _ = load_base(str(tmp_path), device="cpu")
    assert model.config._attn_implementation == "eager"
    assert "no sdpa attention for this architecture; loaded with eager" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="heads.base"):
        model, _ = load_base(str(tmp_path), device="cpu", attn_implementation="eager")
    assert model.config._attn_implementation == "eager" and "no sdpa" not in caplog.text


def test_a_device_this_machine_cannot_use_is_a_clear_error():
    from heads.base import usable_device

    assert usable_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'foo' is no torch device: give 'cpu', 'cuda'"):
        load_base("smollm2-135m-instruct", device="foo")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no cuda device on this machine"):
            load_base("smollm2-135m-instruct", device="cuda")
    else:
        with pytest.raises(ValueError, match=r"'cuda:99', but torch sees \d+ cuda devices"):
            usable_device("cuda:99")


def test_a_granite_moe_base_scales_its_logits_as_its_forward_does():
    torch.manual_seed(0)
    config = GraniteMoeConfig(
        **TINY, logits_scaling=8.0, num_local_experts=2, num_experts_per_tok=1
    )
    config._attn_implementation = "sdpa"
    base = GraniteMoeForCausalLM(config).eval().requires_grad_(False)
    assert logits_scaling(base) is not None
    ids = torch.tensor([[1, 5, 9, 22, 7]])
    hidden = base.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(output_logits(base, hidden), base(input_ids=ids).logits)
    SpeculativeGenerator(base, None, num_tokens=3, adaptive=False)  # taken, not refused


def test_the_input_device_is_the_embeddings_own():
    model = make_tiny_llama().to("meta")
    assert input_device(model) == torch.device("meta")


def test_a_device_index_past_the_count_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert usable_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match=r"'cuda:1', but torch sees 1 cuda devices"):
        usable_device("cuda:1")


def test_bf16_is_the_default_on_a_gpu_that_computes_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_dtype("cuda") == torch.bfloat16
    assert default_dtype("cpu") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert default_dtype("cuda") == torch.float32


def test_a_tokenizer_without_pad_token_pads_with_its_eos(tmp_path, smollm2_tokenizer):
    # batched generate (distill, bench's HF runs) pads: load_base gives such a tokenizer its eos
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from heads import load_base

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.pad_token = None
    config = LlamaConfig(**{**TINY, "vocab_size": len(tok), "pad_token_id": None})
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, tokenizer = load_base(str(tmp_path), device="cpu")
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_a_base_loaded_for_training_is_not_prepacked(tmp_path, smollm2_tokenizer):
    # prepacking keeps a second copy of every linear weight for frozen inference; a base loaded
    # to be trained (Medusa-2's LoRA) is left plain
    from transformers import LlamaConfig, LlamaForCausalLM

    from heads import load_base
    from heads.cpu import PackedLinear, can_prepack

    if not can_prepack():
        pytest.skip("no oneDNN packed linear in this torch build")
    config = LlamaConfig(**{**TINY, "vocab_size": len(smollm2_tokenizer)})
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    frozen, _ = load_base(str(tmp_path), device="cpu")
    assert any(isinstance(m, PackedLinear) for m in frozen.modules())
    trainable, _ = load_base(str(tmp_path), device="cpu", frozen=False)
    assert not any(isinstance(m, PackedLinear) for m in trainable.modules())
