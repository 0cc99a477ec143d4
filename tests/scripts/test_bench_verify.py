"""scripts/bench_verify.py on a random tiny Llama: the files it writes, an oracle whose tau is
D + 1 exactly, exact greedy output, and the logit gap it reports where two outputs part."""

import json
import sys
from pathlib import Path

import torch

from tests.conftest import make_tiny_llama

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import bench_verify  # noqa: E402  (scripts/ is not a package)


def test_bench_verify_writes_costs_and_exact_oracle_runs(tmp_path):
    out = tmp_path / "verify"
    argv = ["--base", "random:tiny", "--sizes", "1,3,9", "--repeats", "2", "--prompts", "2"]
    # 31 new tokens: the prefill's token, then 30 = 10 steps of 3, 6 of 5, or 30 of 1.
    argv += ["--shapes", "0x1,2x1,4x3", "--max-new-tokens", "31", "--out", str(out)]
    assert bench_verify.main(argv) == 0
    results = json.loads((out / "verify.json").read_text())
    assert [c["nodes"] for c in results["cost"]] == [1, 3, 9]
    assert results["cost"][0]["vs_first"] == 1.0 and all(c["ms"] > 0 for c in results["cost"])
    hf, *ours = results["loop"]
    assert hf["method"] == "HF generate" and hf["tokens_per_s"] > 0
    assert [(r["nodes"], r["tau"]) for r in ours] == [(1, 1.0), (3, 3.0), (13, 5.0)]
    assert all(r["identical"] == 1.0 and r["parting_gaps"] == [] for r in ours)
    assert "| oracle 4x3 | 13 |" in (out / "verify.md").read_text()


def test_parting_margin_is_the_logit_gap_where_outputs_first_differ():
    model = make_tiny_llama()
    truth = torch.randint(3, 256, (20,))
    ours = truth.clone()
    ours[12] = (truth[12] + 7) % 256
    ours[15] = (truth[15] + 1) % 256  # a later difference does not count
    gap, typical = bench_verify.parting_margin(model, truth, ours)
    logits = model(truth[None, :12]).logits[0, -1]
    assert abs(gap - (logits[truth[12]] - logits[ours[12]]).abs().item()) < 1e-5
    assert typical > 0


def test_oracle_tree_holds_the_right_token_last_on_each_level():
    truth = list(range(10, 30))
    oracle = bench_verify.OracleDrafter(truth, depth=2, width=3, vocab_size=256, device="cpu")
    draft = oracle.propose(torch.tensor(truth[:5]), None)
    assert draft.tree.parents.tolist() == [-1, 0, 0, 0, 3, 3, 3]
    assert draft.tokens.tolist() == [14, 16, 17, 15, 17, 18, 16]
