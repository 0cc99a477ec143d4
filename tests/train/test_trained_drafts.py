"""Decoding with drafts trained on the tiny task of conftest.py: they know the base's answers, so
most drafted paths are accepted whole. The invariant tests of tests/inference draft at random
and accept few tokens (an untrained EAGLE draft almost none); here every step accepts several,
so the draft's cache and feature feed after a multi-token acceptance, and Medusa's state after
one, are exercised: the output is the base's greedy one, the accepted paths are long, and each
tree is what the draft predicts from the whole sequence (computed afresh, without its cache)."""

from __future__ import annotations

import io
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from heads import load_heads
from heads.lora import with_heads_adapter
from inference import EagleDrafter, MedusaDrafter, SpeculativeGenerator
from tests.inference.test_drafter_trees import check_eagle_drafts, check_medusa_drafts, proposals
from tests.train.conftest import SYSTEM_PROMPT, letter_prompt, load_tiny_base

NEW_TOKENS = 30  # the answers end at EOS after 24 letters
# name: (run, generator options, a path at least this long accepted, least tau over the
# prompts). The path is each tree's depth and the bonus token, but for EAGLE-3's six deep (five
# and the bonus) one less: trained two deep, it accepted five at most. Each least tau is
# 0.25-0.6 under the one measured.
CASES = {
    "medusa-chain": ("medusa", {"choices": "chain-2"}, 3, 2.3),
    "medusa-tree": ("medusa", {"choices": [(0,), (1,), (0, 0), (0, 1), (1, 0)]}, 3, 2.3),
    "eagle1-dynamic": ("eagle1", {"top_k": 2, "depth": 3, "total_tokens": 8}, 4, 2.9),
    "eagle1-deep": ("eagle1", {"top_k": 2, "depth": 5, "total_tokens": 12}, 6, 3.6),
    "eagle1-static": (
        "eagle1",
        {"choices": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (1, 0)]},
        4,
        2.9,
    ),
    "eagle3-chain": ("eagle3", {"top_k": 1, "depth": 3, "total_tokens": 4}, 4, 2.9),
    "eagle3-dynamic": ("eagle3", {"top_k": 2, "depth": 3, "total_tokens": 8}, 4, 3.2),
    "eagle3-deep": ("eagle3", {"top_k": 2, "depth": 5, "total_tokens": 12}, 5, 3.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_trained_drafts_give_the_base_greedy_output_on_long_accepted_paths(
    name, request, tiny_task
):
    kind, options, long_path, least_tau = CASES[name]
    out = request.getfixturevalue(f"{kind}_run")[0]
    base = load_tiny_base(tiny_task)
    heads = load_heads(out / "heads", base=base)
    gen = SpeculativeGenerator(base, heads, adaptive=False, **options)
    tokenizer = AutoTokenizer.from_pretrained(tiny_task.base_dir)
    taus, paths = [], []
    for letter in "aceh":
        prompt = letter_prompt(tokenizer, letter)
        ref = base.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        got = gen.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(got.sequences, ref), (name, letter)
        taus.append(got.mean_accepted_length)
        paths.extend(got.accepted_lengths)
    assert max(paths) >= long_path and min(taus) >= least_tau, (name, taus, paths)


@pytest.mark.parametrize("kind", ["medusa", "eagle1", "eagle3"])
def test_trained_drafts_draft_after_long_accepted_paths_what_they_predict(kind, request, tiny_task):
    # The tree checks of tests/inference/test_drafter_trees.py, on steps that follow paths of
    # 2-4 accepted tokens (the drafter feeds them all to its draft, or reads the last's state).
    out = request.getfixturevalue(f"{kind}_run")[0]
    base = load_tiny_base(tiny_task)
    heads = load_heads(out / "heads", base=base)
    prompt = letter_prompt(AutoTokenizer.from_pretrained(tiny_task.base_dir), "c")
    if kind == "medusa":
        drafter = MedusaDrafter(heads, [(0,), (1,), (0, 0), (0, 1), (1, 0)])
    else:
        drafter = EagleDrafter(heads, base, top_k=2, depth=3, total_tokens=8)
    gen = SpeculativeGenerator(base, drafter, adaptive=False)
    seen, accepted = proposals(type(drafter), gen, prompt, max_new_tokens=16)
    # every step but the first (no letter yet) and the last took drafted tokens
    assert min(accepted[1:-1]) >= 2 and max(accepted) >= 3, accepted
    if kind == "medusa":
        check_medusa_drafts(heads, base, seen, ranks=2)
    else:
        check_eagle_drafts(drafter, base, seen, top_k=2, depth=3)


def test_medusa2_heads_draft_on_the_base_with_their_adapter_merged(medusa2_run, tiny_task):
    """Medusa-2 heads are served on the base with their LoRA merged (`with_heads_adapter`, as
    scripts/eval_heads.py scores them): the output is that base's greedy one, and the heads,
    trained on it, draft its answers."""
    heads_dir = medusa2_run[0] / "heads"
    with pytest.warns(UserWarning, match="Medusa-2 heads were trained on the base with the LoRA"):
        heads = load_heads(heads_dir, base=load_tiny_base(tiny_task))
    merged = with_heads_adapter(load_tiny_base(tiny_task), heads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the merged base is the one they read
        heads = load_heads(heads_dir, base=merged)
    plain = load_tiny_base(tiny_task)
    tokenizer = AutoTokenizer.from_pretrained(tiny_task.base_dir)
    gen = SpeculativeGenerator(merged, heads, adaptive=False, choices="chain-2")
    changed = 0
    for letter in "bdg":
        prompt = letter_prompt(tokenizer, letter)
        ref = merged.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        got = gen.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(got.sequences, ref), letter
        assert got.mean_accepted_length >= 2.2, (letter, got.accepted_lengths)  # 2.5 measured
        before = plain.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        changed += not torch.equal(before, ref)
    assert changed  # the adapter changed the base's answers: the heads followed the new ones


@pytest.mark.slow
def test_chat_and_bench_serve_medusa2_heads_on_their_merged_base(
    medusa2_run, tiny_task, tmp_path, monkeypatch, capsys
):
    """scripts/chat.py, bench.py and bench_arms.py given Medusa-2 heads decode with the base
    their adapter is merged into, and say so: the answer is that base's greedy one (not the plain
    base's), bench's baseline is that base, and two Medusa-2 folders are refused."""
    scripts = str(Path(__file__).parents[2] / "scripts")
    monkeypatch.syspath_prepend(scripts)
    import bench
    import bench_arms
    import chat

    heads_dir = medusa2_run[0] / "heads"
    tokenizer = AutoTokenizer.from_pretrained(tiny_task.base_dir)
    plain = load_tiny_base(tiny_task)
    merged = with_heads_adapter(load_tiny_base(tiny_task), load_heads(heads_dir))

    def answer(model, letter: str) -> str:
        prompt = letter_prompt(tokenizer, letter)
        ids = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        return tokenizer.decode(ids[0, prompt.shape[1] :], skip_special_tokens=True)

    # a question the adapter changed the answer to: the one served tells the bases apart
    letter = next(x for x in "abcdefgh" if answer(plain, x) != answer(merged, x))
    base = ["--base", str(tiny_task.base_dir), "--threads", "1"]
    turn = f"Recite the letters from '{letter}'."
    monkeypatch.setattr(sys, "stdin", io.StringIO(turn + "\n"))
    argv = [*base, "--heads", str(heads_dir), "--system-prompt", SYSTEM_PROMPT, "--compare"]
    assert chat.main([*argv, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    out, err = capsys.readouterr()
    assert out == answer(merged, letter) + "\n"
    assert f"chat: the base with the LoRA adapter of the Medusa-2 heads {heads_dir}" in err
    assert "identical" in err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": turn, "category": "letters"}) + "\n")
    argv = [*base, "--prompts", str(prompts), "--system-prompt", SYSTEM_PROMPT, "--runs", "1"]
    argv += ["--max-new-tokens", str(NEW_TOKENS), "--methods", "heads", "--tree", "chain-2"]
    argv += ["--heads", str(heads_dir), "--out", str(tmp_path / "bench")]
    assert bench.main(argv) == 0
    assert "bench: the base with the LoRA adapter of the Medusa-2 heads" in capsys.readouterr().err
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["settings"]["base_adapter_of"] == str(heads_dir)
    title = (tmp_path / "bench" / "results.md").read_text().splitlines()[0]
    assert title.endswith(f"with the LoRA adapter of the Medusa-2 heads `{heads_dir}` merged")
    (record,) = [r for r in results["records"] if r["method"] != "baseline"]
    assert record["identical"] and record["tau"] >= 2.0, record  # 2.23 measured
    argv_arms = [*base, "--prompts", str(prompts), "--max-new-tokens", "8", "--heads"]
    argv_arms += [str(heads_dir), "--arms", '[{"choices": "chain-2"}]', "--out", str(tmp_path)]
    assert bench_arms.main(argv_arms) == 0
    assert "bench_arms: the base with the LoRA adapter" in capsys.readouterr().err
    arms = json.loads((tmp_path / "arms.json").read_text())
    assert arms["base_adapter_of"] == str(heads_dir)
    # two Medusa-2 folders: refused (a copy of the same heads stands for another run's)
    other = tmp_path / "other-heads"
    shutil.copytree(heads_dir, other)
    assert bench.main([*argv[:-2], str(other), "--out", str(tmp_path / "b2")]) == 2
    assert "each trained beside its own LoRA adapter" in capsys.readouterr().err
