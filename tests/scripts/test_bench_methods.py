"""The methods bench builds, on the tiny base of tests/scripts/conftest.py: what each records
(options, names), the names of heads folders (a run's OUTPUT/heads, folders of one name), a
union with a fixed tree, sampling that follows the seed each run is given and is not truncated
by the base's generation_config, and a draft model with more rows than the base refused."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

from heads import MedusaConfig, MedusaHeads
from tests.conftest import make_tiny_llama

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import bench  # noqa: E402  (scripts/ is not a package)
import bench_methods  # noqa: E402


def _build(folders, names, *flags):
    args = bench.parse_args(["--base", str(folders["base"]), "--prompts", "embedded", *flags])
    return bench_methods.build_methods(names, args)


def test_only_hf_lookup_looks_up_the_prompt(folders):
    _, _, methods = _build(folders, ["baseline", "hf-lookup"], "--lookup-tokens", "3")
    assert [(m.name, m.options) for m in methods] == [
        ("baseline", {}),
        ("hf-lookup", {"prompt_lookup_num_tokens": 3}),
    ]


def test_heads_methods_are_named_after_the_run_and_never_after_another_method(folders, tmp_path):
    # OUTPUT/heads is named after OUTPUT; runs of one name by the folders above them; a run
    # named as a method ("ngram") gets -2, or the next number free, so that every method's
    # records stay apart
    run_heads = tmp_path / "my-run" / "heads"
    named = [tmp_path / "ngram-2", tmp_path / "ngram", tmp_path / "a" / "x", tmp_path / "b" / "x"]
    for folder in (run_heads, *named):
        shutil.copytree(folders["medusa"], folder)
    heads = ["--heads", str(run_heads), *map(str, named)]
    _, _, methods = _build(folders, ["baseline", "heads"], *heads)
    names = [m.name for m in methods]
    assert names == ["baseline", "my-run", "ngram-2", "ngram-3", "a/x", "b/x"]


def test_a_union_with_a_fixed_tree_runs_both_drafters_every_step(folders):
    tree = "[[0], [1], [0, 0]]"
    flags = ["--heads", str(folders["medusa"]), "--tree", tree]
    _, _, methods = _build(folders, ["baseline", "heads+ngram"], *flags)
    union = methods[-1]
    assert (union.name, union.kind, union.draft_depth) == ("medusa+ngram", "medusa+ngram", 4)
    assert union.options == {"ngram_tokens": 4, "choices": [(0,), (1,), (0, 0)], "arms": "fixed"}
    assert union.generate.generator.arms is None


def test_sampled_runs_follow_the_seed_they_are_given(folders):
    # the same seed gives the same tokens whatever ran before; another seed, others
    flags = ["--temperature", "1.0", "--max-new-tokens", "6"]
    base, tokenizer, methods = _build(folders, ["baseline", "ngram"], *flags)
    prompt = torch.tensor([tokenizer("Name a colour.")["input_ids"]])
    for method in methods:
        first = method.generate(prompt, seed=1).new_ids
        assert method.generate(prompt, seed=2).new_ids != first, method.name
        assert method.generate(prompt, seed=1).new_ids == first, method.name


def test_hf_sampling_draws_from_the_whole_top_p_distribution(folders, monkeypatch):
    # top_k=0 given explicitly: the base's generation_config top_k (HF's default 50, Qwen's
    # 20) would truncate what the baseline samples from, and the speculative methods'
    flags = ["--temperature", "0.7", "--top-p", "0.9", "--max-new-tokens", "2"]
    base, tokenizer, methods = _build(folders, ["baseline", "hf-lookup"], *flags)
    base.generation_config.top_k = 20
    seen, generate = [], base.generate

    def spy(**kwargs):
        seen.append(kwargs)
        return generate(**kwargs)

    monkeypatch.setattr(base, "generate", spy)
    prompt = torch.tensor([tokenizer("Name a colour.")["input_ids"]])
    for method in methods:
        method.generate(prompt, seed=0)
    assert [(k["do_sample"], k.get("top_k"), k["top_p"], k["temperature"]) for k in seen] == [
        (True, 0, 0.9, 0.7)
    ] * 2


def test_a_draft_model_with_more_rows_than_the_base_does_not_share_its_tokenizer(folders, tmp_path):
    # the same tokenizer, but 64 rows past the base's vocabulary: its logits could not be set
    # beside the base's
    base, tokenizer, _ = _build(folders, ["baseline"])
    wider = make_tiny_llama(
        0,
        vocab_size=base.config.vocab_size + 64,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
    )
    wider.save_pretrained(tmp_path / "wider")
    tokenizer.save_pretrained(tmp_path / "wider")
    args = bench.parse_args(["--prompts", "embedded"])
    with pytest.raises(bench_methods.BenchError, match="does not share the base's tokenizer"):
        bench_methods._load_draft_model(str(tmp_path / "wider"), base, tokenizer, args)


def test_a_medusa_methods_depth_is_what_its_trees_can_accept_not_its_head_count(folders, tmp_path):
    # accept_at_least has one column per drafted token a step can accept: a --tree of one
    # level on 2 heads has one; 4 heads adaptive, their deepest arm's (on a CPU, two levels)
    flags = ["--heads", str(folders["medusa"])]
    _, _, methods = _build(folders, ["baseline", "heads"], *flags, "--tree", "[[0], [1]]")
    assert (methods[-1].options["depth"], methods[-1].draft_depth) == (1, 1)
    base, _, _ = _build(folders, ["baseline"])
    four = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=4)).init_from_base(base)
    four.save_pretrained(tmp_path / "four")
    _, _, methods = _build(folders, ["baseline", "heads"], "--heads", str(tmp_path / "four"))
    deepest = [max(map(len, a["choices"])) for a in methods[-1].options["arms"] if a]
    assert methods[-1].draft_depth == max(deepest) == 2


def test_a_speculative_run_gives_each_steps_tree_size_plain_steps_one_node(folders):
    args = bench.parse_args(["--base", str(folders["base"]), "--prompts", "embedded"])
    _, _, methods = bench_methods.build_methods(["baseline", "ngram"], args)
    ngram = methods[-1]
    prompt = torch.tensor([[5, 6, 7, 8, 9]])  # no n-gram repeats: the first step drafts nothing
    run = ngram.generate(prompt, 0, max_new_tokens=12)
    own = ngram.generate.generator.generate(prompt, max_new_tokens=12, seed=0)
    assert run.new_ids == own.sequences[0, 5:].tolist()
    assert run.tree_sizes == own.tree_sizes and len(run.tree_sizes) == len(run.accepted_lengths)
    assert run.tree_sizes[0] == 1 and run.accepted_lengths[0] == 1
