"""scripts/bench.py with the chat template and system prompt the heads were trained with."""

import json

from tests.scripts.conftest import copy_without_chat_template
from tests.scripts.test_bench import MT_BENCH, _jsonl, bench


def test_the_chat_template_and_system_prompt_of_training_are_given_as_flags(
    folders, tmp_path, capsys
):
    """Heads trained with a recipe's data.chat_template / data.system_prompt are benchmarked
    with them: a base whose tokenizer has no template runs with --chat-template, and
    --system-prompt replaces every prompt's system turn (its tokens are in each prompt)."""
    base = copy_without_chat_template(folders["base"], tmp_path / "no-template")
    prompts = _jsonl(tmp_path / "mt_bench.jsonl", MT_BENCH[:2])
    argv = ["--base", str(base), "--prompts", str(prompts), "--max-new-tokens", "4"]
    argv += ["--methods", "baseline,ngram", "--threads", "1"]
    assert bench.main([*argv, "--out", str(tmp_path / "none")]) == 2
    assert "has no chat template" in capsys.readouterr().err
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant:{% endif %}"
    )
    runs = {}
    for name, extra in {
        "own": [],
        "system": ["--system-prompt", "Answer in one short line."],
    }.items():
        out = tmp_path / name
        assert bench.main([*argv, "--chat-template", str(template), *extra, "--out", str(out)]) == 0
        runs[name] = json.loads((out / "results.json").read_text())
    assert runs["system"]["settings"]["system_prompt"] == "Answer in one short line."
    assert runs["own"]["settings"]["chat_template"] == str(template)
    for own, system in zip(runs["own"]["records"], runs["system"]["records"]):
        assert system["identical"] and own["identical"]
        assert system["prompt_tokens"] > own["prompt_tokens"] + 4  # the system turn's tokens


def test_every_method_stops_where_the_template_closes_a_turn(smollm2_tokenizer):
    # as distill ends the answers the heads learn from, also where the base's generation_config
    # names another EOS only (the methods would otherwise answer the user's next turn too)
    from bench_methods import stop_token_ids

    from tests.conftest import make_tiny_llama

    base = make_tiny_llama(vocab_size=len(smollm2_tokenizer))
    base.generation_config.eos_token_id = 0  # <|endoftext|>
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(base, smollm2_tokenizer) == [0, im_end]
    base.generation_config.eos_token_id = [im_end, 0]
    assert stop_token_ids(base, smollm2_tokenizer) == [im_end, 0]
