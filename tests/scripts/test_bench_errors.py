"""scripts/bench.py's refusals: bad input and bases it cannot decode end with a message and exit
2, before anything is timed or written."""

import sys
from pathlib import Path

import pytest

from tests.scripts.test_bench import SHAREGPT, _jsonl, bench

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import os

from bench_methods import BenchError, _tree_choices, parse_methods  # noqa: E402  (not a package)

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_report import make_out  # noqa: E402  (scripts/ is not a package)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "'embedded:all' or 'hf:ORG/NAME:SPLIT', or 'humaneval'"),
        ("empty", "is empty"),
        ("malformed", "prompts.jsonl:3: invalid JSON"),
        ("other-base", "num_hidden_layers=3"),
        ("other-vocab", "does not share the base's tokenizer"),
        ("unknown-method", "unknown methods ['medusa']"),
        ("draft-without-model", "needs --draft-model"),
        ("draft-tree-without-model", "--draft-tokens / --draft-tree shape the 'draft' method"),
        ("draft-tree-malformed", "--draft-tree: choice (0, 0) needs its prefix (0,)"),
        ("draft-chain-empty", "--draft-tokens: num_tokens must be >= 1"),
        ("union-without-heads", "'heads+ngram' needs --heads"),
        ("corpus-method-without-corpus", "'ngram+corpus' needs --lookup-corpus"),
        ("corpus-without-answers", "--lookup-corpus: no assistant turns"),
        ("corpus-too-small", "no context seen 2+ times: give it more answers"),
        ("corpus-without-method", "--lookup-corpus given but none of"),
        ("bad-device", "device='foo' is no torch device"),
        ("tree-malformed", "bench failed: --tree: not a JSON list of choices"),
    ],
)
def test_bad_input_is_a_clear_error(folders, tmp_path, capsys, caplog, case, message):
    prompts = _jsonl(tmp_path / "prompts.jsonl", SHAREGPT[1:])
    one_answer = _jsonl(tmp_path / "answer.jsonl", SHAREGPT[:1])
    extra = {
        "missing": ["--prompts", str(tmp_path / "nope.jsonl")],
        "empty": ["--prompts", str(_jsonl(tmp_path / "empty.jsonl", []))],
        "malformed": [],
        "other-base": ["--heads", str(folders["other-medusa"])],
        "other-vocab": ["--draft-model", str(folders["small"])],
        "unknown-method": ["--methods", "baseline,medusa"],
        "draft-without-model": ["--methods", "draft"],
        "draft-tree-without-model": ["--draft-tree", "cpu-8"],
        "draft-tree-malformed": ["--draft-model", str(folders["base"]), "--draft-tree", "[[0, 0]]"],
        "draft-chain-empty": ["--draft-model", str(folders["base"]), "--draft-tokens", "0"],
        "union-without-heads": ["--methods", "ngram,heads+ngram"],
        "corpus-method-without-corpus": ["--methods", "ngram+corpus"],
        "corpus-without-answers": ["--methods", "ngram+corpus", "--lookup-corpus", str(prompts)],
        "corpus-too-small": ["--methods", "ngram+corpus", "--lookup-corpus", str(one_answer)],
        "corpus-without-method": ["--methods", "ngram", "--lookup-corpus", str(one_answer)],
        "bad-device": ["--device", "foo"],
        "tree-malformed": ["--heads", str(folders["medusa"]), "--tree", "[[0],"],
    }[case]
    if case == "malformed":
        prompts.write_text(prompts.read_text() + '{"prompt": "unfinished\n')
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--max-new-tokens", "4"]
    assert bench.main([*argv, "--out", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "out").exists()  # made for the run, removed again: nothing left
    if case in ("malformed", "empty"):  # what a record looks like, and no "skipping" first
        assert 'JSON object such as {"prompt": "..."}, {"turns": ["..."]}' in err
        assert not [r for r in caplog.records if "skipping" in r.getMessage()]


def test_a_base_the_generator_refuses_is_a_clear_error(tmp_path, smollm2_tokenizer, capsys):
    from transformers import MistralConfig, MistralForCausalLM

    tok = smollm2_tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = MistralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,  # a cache that keeps its last 16 keys cannot be cut back
        pad_token_id=tok.pad_token_id,
        **ids,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    prompts = _jsonl(tmp_path / "prompts.jsonl", SHAREGPT[1:])
    argv = ["--base", str(tmp_path / "base"), "--prompts", str(prompts), "--methods", "ngram"]
    capsys.readouterr()
    assert bench.main([*argv, "--max-new-tokens", "4", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "bench failed: " in err and "sliding" in err and "Traceback" not in err


def test_an_out_that_is_a_file_is_refused_before_the_base_loads(folders, tmp_path, capsys):
    prompts = _jsonl(tmp_path / "prompts.jsonl", SHAREGPT)
    (tmp_path / "out").write_text("notes")
    argv = ["--base", str(tmp_path / "no-base"), "--prompts", str(prompts)]
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'out'} is a file: give a folder" in err and "no-base" not in err
    assert (tmp_path / "out").read_text() == "notes"


def test_a_heads_folder_that_is_not_there_is_said_before_the_base_loads(
    tmp_path, capsys, monkeypatch
):
    """A big base can take minutes to load: a mistyped --heads is said before it."""
    monkeypatch.setattr(bench.bench_methods, "build_methods", lambda *a: pytest.fail("base loaded"))
    prompts = _jsonl(tmp_path / "prompts.jsonl", SHAREGPT)
    argv = ["--base", "smollm2-135m-instruct", "--prompts", str(prompts), "--heads", "/nope"]
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "bench failed: heads folder not found: /nope" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    run = tmp_path / "run"  # a training run's folder, its heads in run/heads
    (run / "heads").mkdir(parents=True)
    (run / "heads/config.json").write_text("{}")
    argv[-1] = str(run)
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert f"{run} is a training run's folder: its heads are in {run}/heads" in (
        capsys.readouterr().err
    )


def test_a_refused_run_keeps_an_out_folder_that_was_there(folders, tmp_path):
    prompts = _jsonl(tmp_path / "prompts.jsonl", SHAREGPT)
    (tmp_path / "out").mkdir()
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts)]
    argv += ["--heads", str(folders["other-medusa"])]  # refused once the base has loaded
    assert bench.main([*argv, "--out", str(tmp_path / "out" / "new" / "run")]) == 2
    assert (tmp_path / "out").is_dir() and not any((tmp_path / "out").iterdir())


def test_ctrl_c_says_so_in_a_line_and_removes_the_folder_it_made(
    folders, tmp_path, capsys, monkeypatch
):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_bench", interrupted)
    prompts = _jsonl(tmp_path / "prompts.jsonl", SHAREGPT)
    argv = ["--base", str(folders["base"]), "--prompts", str(prompts), "--methods", "ngram"]
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert "bench interrupted: nothing written (the results are written once every" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_the_readmes_mt_bench_file_missing_says_where_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--prompts", "mt_bench.jsonl", "--base", "never-loaded"]) == 2
    err = capsys.readouterr().err
    assert "'hf:ORG/NAME:SPLIT', or 'humaneval'; save MT-bench's questions first: curl -Lo" in err


def test_the_methods_run_are_the_baseline_first_then_each_one_asked_once():
    assert parse_methods("ngram,baseline,ngram,hf-lookup", [], None) == [
        "baseline",
        "ngram",
        "hf-lookup",
    ]
    # by default: every method the options allow, each heads folder alone
    everything = parse_methods(None, ["runs/h"], "draft/model", "answers.jsonl")
    assert everything == ["baseline", "hf-lookup", "ngram", "ngram+corpus", "heads", "draft"]


@pytest.mark.parametrize(
    "methods, heads, draft_model, message",
    [
        ("baseline,ngram", ["runs/h"], None, "--heads given but no heads method"),
        (
            "baseline,ngram",
            [],
            "draft/model",
            "--draft-model given but 'draft' is not in --methods",
        ),
        ("heads", [], None, "method 'heads' needs --heads DIR"),
    ],
)
def test_an_option_without_its_method_and_a_method_without_its_option_are_refused(
    methods, heads, draft_model, message
):
    with pytest.raises(BenchError, match=message):
        parse_methods(methods, heads, draft_model)


def test_a_tree_that_is_json_but_no_list_of_paths_is_a_bench_error():
    assert _tree_choices("[[0], [1], [0, 0]]") == [(0,), (1,), (0, 0)]
    assert _tree_choices("cpu-8") == "cpu-8"  # a preset's name
    for bad in ("[1, 2]", "[[0],", "[null]"):
        with pytest.raises(BenchError, match=r"^--draft-tree: not a JSON list of choices"):
            _tree_choices(bad, "--draft-tree")


def test_a_refused_run_removes_only_the_empty_folders_it_made(tmp_path):
    """Another run may write beside this one meanwhile: what it wrote, and the folder above
    both, stay."""
    from bench_report import make_out

    from heads.export import remove_made

    out, made = make_out(tmp_path / "runs" / "a")
    assert made == [tmp_path / "runs" / "a", tmp_path / "runs"] and out.is_dir()
    (tmp_path / "runs" / "b").mkdir()
    (tmp_path / "runs" / "b" / "results.json").write_text("{}")
    remove_made(made)
    assert not out.exists() and (tmp_path / "runs" / "b" / "results.json").read_text() == "{}"
    assert make_out(tmp_path / "runs")[1] == []  # there already: nothing to remove


@pytest.mark.parametrize("missing", [os.W_OK, os.X_OK], ids=["no-write", "no-search"])
def test_an_out_folder_missing_write_or_search_permission_is_refused(
    tmp_path, monkeypatch, missing
):
    (tmp_path / "runs").mkdir()
    # as for a folder of mode 0o500 (no write) or 0o600 (no search), which root would pass
    monkeypatch.setattr("os.access", lambda path, mode: not mode & missing)
    with pytest.raises(OSError, match=r"--out .*runs is not writable by this user: give a folder"):
        make_out(tmp_path / "runs")
    monkeypatch.undo()
    assert make_out(tmp_path / "runs") == (tmp_path / "runs", [])
