"""train/answering.py: the ids that end an answer and distill's generation backends, on a tiny
random Llama that uses the embedded tokenizer (tests/conftest.py's tiny_base)."""

import copy
import importlib.util
import sys
import types

import pytest
import torch

from heads.base import load_base
from train.answering import (
    eos_token_ids,
    split_answer,
    static_cache_length,
    tensor_parallel_size,
    transformers_generator,
    use_vllm,
    vllm_generator,
)
from train.config import load_recipe
from train.distilled import DistillError


def test_split_answer_marks_finished():
    assert split_answer([5, 6, 2, 9, 9], eos_ids=[2]) == ([5, 6], True)
    assert split_answer([5, 6, 7], eos_ids=[2]) == ([5, 6, 7], False)
    assert split_answer([0, 3], eos_ids=[2, 0]) == ([], True)


def test_eos_ids_merge_tokenizer_and_generation_config(smollm2_tokenizer):
    class Config:
        eos_token_id = [7, 2]

    assert eos_token_ids(smollm2_tokenizer, Config()) == [2, 7]
    assert eos_token_ids(smollm2_tokenizer, None) == [2]


def test_eos_ids_take_the_token_the_template_ends_a_turn_with(smollm2_tokenizer, caplog):
    """A base whose EOS is not its end-of-turn token (the template closes turns with <|im_end|>,
    EOS is <|endoftext|>) would answer past its turn: the template's token ends answers too."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.eos_token = "<|endoftext|>"
    template = tok.chat_template
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    with caplog.at_level("WARNING", logger="distill"):
        assert eos_token_ids(tok, None, template) == sorted([tok.eos_token_id, im_end])
    assert "'<|im_end|>'" in caplog.text and "not among the base's EOS ids" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="distill"):  # already an EOS id: nothing to say
        assert eos_token_ids(smollm2_tokenizer, None, template) == [im_end]
    assert caplog.text == ""
    # A template that refuses the probe (it wants a system turn): the EOS ids alone, said so
    wants_system = "{{ raise_exception('a system turn first') }}"
    with caplog.at_level("WARNING", logger="distill"):
        assert eos_token_ids(tok, None, wants_system) == [tok.eos_token_id]
    assert "end-of-turn token was not found (the chat template cannot render" in caplog.text
    assert "a system turn first" in caplog.text


def test_static_and_dynamic_cache_give_the_same_greedy_answers(tiny_base):
    """bench_distill's batch-1 baseline (HF's default cache) answers as the distill path does."""
    recipe = load_recipe(None, ["data.max_new_tokens=8"])  # the settings it reads
    model, tok = load_base(str(tiny_base))
    eos = eos_token_ids(tok, model.generation_config)
    prompts = [tok(f"Question {i}: a colour?")["input_ids"] for i in range(3)]
    prompts[1] = prompts[1][:4]  # unequal lengths: left padding in the batch
    static = transformers_generator(model, tok, recipe, eos)
    dynamic = transformers_generator(model, tok, recipe, eos, static_cache=False)
    batched = static(prompts)
    assert all(len(ids) > 0 for ids, _ in batched)
    assert batched == [dynamic([p])[0] for p in prompts]


def test_logits_settings_of_the_generation_config_do_not_change_the_answers(tiny_base):
    """A base whose generation_config penalises repeats (Qwen2.5-Instruct's 1.05) still
    answers with its own greedy tokens: those the verifier accepts from its plain logits."""
    recipe = load_recipe(None, ["data.max_new_tokens=12"])  # the settings it reads
    model, tok = load_base(str(tiny_base))
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9]]
    want = transformers_generator(model, tok, recipe, [])(prompts)
    model.generation_config.repetition_penalty = 2.0
    model.generation_config.no_repeat_ngram_size = 2
    assert transformers_generator(model, tok, recipe, [])(prompts) == want
    assert model.generation_config.repetition_penalty == 2.0  # the base's own, given back
    penalised = model.generate(torch.tensor(prompts[:1]), max_new_tokens=12, do_sample=False)
    assert penalised[0, 5:].tolist() != want[0][0]  # the settings would have changed them


def test_rows_that_end_leave_the_batch_between_chunks(tiny_base):
    """Chunked generation (ended rows dropped from the batch and the static cache every 2
    tokens) answers as one call over the whole batch, and as each prompt alone."""
    recipe = load_recipe(None, ["data.max_new_tokens=9"])  # the settings it reads
    model, tok = load_base(str(tiny_base))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (6 + i,), generator=g).tolist() for i in range(6)]
    free = transformers_generator(model, tok, recipe, [], chunk_tokens=0)(prompts)
    # A random model rarely ends by itself: end-of-turn ids taken from its answers, so that one
    # row ends at its first token change and another before its first token.
    r, j = next(
        (r, j)
        for r, (ids, _) in enumerate(free)
        for j in range(1, len(ids))
        if ids[j] != ids[j - 1]
    )
    other = next(q for q, (ids, _) in enumerate(free) if q != r and ids[0] not in free[r][0])
    eos = [free[r][0][j], free[other][0][0]]
    one_call = transformers_generator(model, tok, recipe, eos, chunk_tokens=0)
    chunked = transformers_generator(model, tok, recipe, eos, chunk_tokens=2)
    alone = transformers_generator(model, tok, recipe, eos, static_cache=False)
    calls = []  # (batch rows, max_new_tokens) of every generate call
    generate = model.generate

    def recording(**kwargs):
        calls.append((kwargs["input_ids"].shape[0], kwargs["max_new_tokens"]))
        return generate(**kwargs)

    model.generate = recording
    answers = chunked(prompts)
    model.generate = generate
    assert [n for _, n in calls] == [2, 2, 2, 2, 1]  # 9 new tokens, 2 per call
    rows = [b for b, _ in calls]
    assert rows[0] == 6 and rows[1] < 6 and rows == sorted(rows, reverse=True)
    assert (len(answers[r][0]), len(answers[other][0])) == (j, 0)
    assert answers[r][1] and answers[other][1]
    assert any(not finished for _, finished in answers)  # a row ran to max_new_tokens
    assert answers == one_call(prompts) == [alone([p])[0] for p in prompts]


def test_vllm_generator_with_a_stand_in_engine(monkeypatch):
    """The vLLM path without vLLM: a stand-in module records what the generator asks for."""
    import types

    seen = {}

    class SamplingParams:
        def __init__(self, **kwargs):
            seen["params"] = kwargs

    class LLM:
        def __init__(self, **kwargs):
            seen["llm"] = kwargs

        def generate(self, prompts, params, use_tqdm):
            seen["prompts"] = prompts
            out = types.SimpleNamespace
            return [
                out(outputs=[out(token_ids=[5, 6, 2])]),  # stopped at EOS
                out(outputs=[out(token_ids=[7, 8, 9])]),  # cut by max_tokens
            ]

    monkeypatch.setitem(
        sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams)
    )
    recipe = load_recipe(None, ["data.temperature=0.5", "data.max_new_tokens=3"])
    generate = vllm_generator("some/model", recipe, eos_ids=[2])
    assert generate([[1, 2, 3], [4]]) == [([5, 6], True), ([7, 8, 9], False)]
    assert seen["prompts"] == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4]}]
    assert seen["params"]["temperature"] == 0.5 and seen["params"]["max_tokens"] == 3
    assert seen["params"]["stop_token_ids"] == [2]
    assert seen["llm"]["model"] == "some/model" and seen["llm"]["max_model_len"] == 2048


def test_sampled_answers_draw_from_the_whole_top_p_distribution(tiny_base, monkeypatch):
    # top_k=0 given explicitly, so that a checkpoint's generation_config top_k (Qwen's 20,
    # HF's default 50) cannot truncate the distribution the heads are trained on
    recipe = load_recipe(None, ["data.temperature=0.7", "data.top_p=0.9", "data.max_new_tokens=4"])
    model, tok = load_base(str(tiny_base))
    model.generation_config.top_k = 20
    seen = []
    real = model.generate

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    answers = transformers_generator(model, tok, recipe, [tok.eos_token_id])([[5, 6, 7], [8, 9]])
    assert len(answers) == 2 and seen
    for kwargs in seen:
        assert kwargs["do_sample"] is True
        assert (kwargs.get("top_k"), kwargs["top_p"], kwargs["temperature"]) == (0, 0.9, 0.7)


def test_the_vllm_engine_takes_the_seed_it_is_given(monkeypatch):
    # an explicit seed (one per sample of a prompt) reaches the engine; else data.seed
    seen = []

    class LLM:
        def __init__(self, **kwargs):
            seen.append(kwargs)

    monkeypatch.setitem(
        sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **k: k)
    )
    recipe = load_recipe(None, ["data.temperature=0.5", "data.seed=3"])
    vllm_generator("some/model", recipe, eos_ids=[2], seed=11)
    vllm_generator("some/model", recipe, eos_ids=[2])
    assert [kwargs["seed"] for kwargs in seen] == [11, 3]


def test_the_templates_end_of_turn_is_added_beside_generation_config_eos_ids(smollm2_tokenizer):
    # also when the generation_config names EOS ids of its own (none of them the turn end)
    import copy

    from train.answering import eos_token_ids

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.eos_token = "<|endoftext|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    class Config:
        eos_token_id = [tok.eos_token_id, 7]

    ids = eos_token_ids(tok, Config(), tok.chat_template)
    assert ids == sorted({tok.eos_token_id, 7, im_end})


def _machine(monkeypatch, vllm: bool, gpu: bool) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if vllm else None) if name == "vllm" else find_spec(name, *a),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)


def _backend(name: str):
    return load_recipe(None, [f"data.backend={name}"])


@pytest.mark.parametrize("vllm, gpu", [(False, False), (True, False), (False, True)])
def test_auto_answers_with_transformers_unless_vllm_can_run(monkeypatch, vllm, gpu):
    _machine(monkeypatch, vllm, gpu)
    assert use_vllm(_backend("auto")) is False
    assert use_vllm(_backend("transformers")) is False
    with pytest.raises(DistillError, match="data.backend=vllm but vLLM is not installed or no GPU"):
        use_vllm(_backend("vllm"))


def test_auto_answers_with_vllm_where_it_is_installed_and_a_gpu_is_visible(monkeypatch):
    _machine(monkeypatch, vllm=True, gpu=True)
    assert use_vllm(_backend("auto")) is True
    assert use_vllm(_backend("vllm")) is True
    assert use_vllm(_backend("transformers")) is False


def test_vllm_splits_the_base_over_a_number_of_gpus_that_divides_its_heads(caplog):
    """vLLM refuses a tensor-parallel size that does not divide the attention heads (or fit the
    key / value heads): Qwen2.5-7B (28 and 4) goes over 4 of 8 GPUs, Llama-3-8B (32, 8) all 8."""
    assert tensor_parallel_size(8, (32, 8)) == 8 and not caplog.text
    assert tensor_parallel_size(8, (64, 8)) == 8 and tensor_parallel_size(16, (32, 8)) == 16
    assert tensor_parallel_size(8, (28, 4)) == 4  # 7 divides 28 but is no multiple of 4
    assert "over 4 of the 8 GPUs: tensor parallelism must divide its 28 attention" in caplog.text
    assert tensor_parallel_size(0, (28, 4)) == 1 and tensor_parallel_size(8, None) == 8


def test_a_compiled_static_cache_takes_a_length_of_a_few_buckets():
    # on a GPU transformers compiles the static-cache step once per cache length
    assert [static_cache_length(n, compiled=True) for n in (1, 256, 257, 1300)] == [
        256,
        256,
        512,
        1536,
    ]
    assert static_cache_length(1300, compiled=False) == 1300  # a CPU: exactly what it needs
