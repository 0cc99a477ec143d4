"""scripts/bench.py with the chat template and system prompt the heads were trained with."""

import json

import pytest

from tests.scripts.conftest import copy_without_chat_template, heads_trained_under
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


PLAIN_TEMPLATE = (
    "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:{% endif %}"
)


@pytest.mark.filterwarnings("ignore:these heads were trained on")  # the base's copy
def test_as_trained_takes_the_prompts_the_heads_record(folders, tmp_path, capsys):
    """--as-trained benchmarks heads under the system prompt and chat template their config
    records, as if both were given as flags (the same prompt tokens); a flag given wins over
    what is recorded; heads of two recipes, or no heads, are refused before any work."""
    base = copy_without_chat_template(folders["base"], tmp_path / "no-template")
    heads = heads_trained_under(
        folders["medusa"],
        tmp_path / "heads",
        training_system_prompt="Réponds brièvement.",
        training_chat_template=PLAIN_TEMPLATE + "\n",  # a file's last newline, as read
    )
    prompts = _jsonl(tmp_path / "mt_bench.jsonl", MT_BENCH[:2])
    argv = ["--base", str(base), "--prompts", str(prompts), "--max-new-tokens", "4"]
    argv += ["--methods", "baseline,heads", "--heads", str(heads), "--threads", "1"]

    def run(name, *extra):
        assert bench.main([*argv, *extra, "--out", str(tmp_path / name)]) == 0
        return json.loads((tmp_path / name / "results.json").read_text())

    taken = run("as-trained", "--as-trained")
    assert 'as trained: the system prompt "Réponds brièvement."; the chat template' in (
        capsys.readouterr().err
    )
    assert taken["settings"]["system_prompt"] == "Réponds brièvement."
    assert taken["settings"]["chat_template"] == PLAIN_TEMPLATE + "\n"  # as recorded
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    flags = ["--system-prompt", "Réponds brièvement.", "--chat-template", str(template)]
    given = run("given", *flags)
    assert [r["prompt_tokens"] for r in taken["records"]] == [
        r["prompt_tokens"] for r in given["records"]
    ]
    assert all(r["identical"] for r in taken["records"])
    # a --system-prompt given wins; the template still comes from the heads
    own = run("own-system", "--as-trained", "--system-prompt", "Be brief.")
    assert own["settings"]["system_prompt"] == "Be brief."
    assert own["settings"]["chat_template"] == PLAIN_TEMPLATE + "\n"
    assert "as trained: the chat template they record" in capsys.readouterr().err

    same = heads_trained_under(heads, tmp_path / "same")
    other = heads_trained_under(
        folders["medusa"], tmp_path / "other", training_system_prompt="Be long."
    )
    bare = heads_trained_under(folders["medusa"], tmp_path / "bare")  # records neither
    for last, shown in ((other, '"Be long."'), (bare, "none")):
        three = [*argv, "--heads", str(heads), str(same), str(last), "--as-trained"]
        assert bench.main([*three, "--out", str(tmp_path / "x")]) == 2
        said = f'{heads} records "Réponds brièvement." as its training_system_prompt, {last} '
        assert said + f"{shown}: give --system-prompt" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before --out was made
    broken = heads_trained_under(heads, tmp_path / "broken", training_system_prompt=["Be brief."])
    assert (
        bench.main([*argv, "--heads", str(broken), "--as-trained", "--out", str(tmp_path / "x")])
        == 2
    )
    said = "bench failed: --heads: " + str(broken / "config.json")
    assert said + ": training_system_prompt is a list, not text" in capsys.readouterr().err
    no_heads = [a for a in argv if a not in ("--heads", str(heads))]
    with pytest.raises(SystemExit) as stop:
        bench.main([*no_heads, "--methods", "baseline", "--as-trained"])
    assert stop.value.code == 2 and "give --heads" in capsys.readouterr().err
