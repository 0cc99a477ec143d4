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
    argv = ["--base", "random:tiny", "--device", "cpu", "--dtype", "fp32", "--sizes", "1,3,9"]
    argv += ["--repeats", "2", "--prompts", "2"]
    # 31 new tokens: the prefill's token, then 30 = 10 steps of 3, 6 of 5, or 30 of 1.
    argv += ["--shapes", "0x1,2x1,4x3,2x1", "--max-new-tokens", "31", "--out", str(out)]
    assert bench_verify.main(argv) == 0
    results = json.loads((out / "verify.json").read_text())
    assert [c["nodes"] for c in results["cost"]] == [1, 3, 9]
    assert all(c["ms"] > 0 for c in results["cost"])
    hf, *ours = results["loop"]
    assert hf["method"] == "HF generate" and hf["tokens_per_s"] > 0
    assert [(r["nodes"], r["tau"]) for r in ours] == [(1, 1.0), (3, 3.0), (13, 5.0)]
    assert all(r["identical"] == 1.0 and r["parting_gaps"] == [] for r in ours)
    assert "| oracle 4x3 | 13 |" in (out / "verify.md").read_text()  # 2x1 given twice, run once


def test_bench_verify_refuses_runs_past_the_context_before_timing(tmp_path, capsys):
    import pytest

    base = ["--base", "random:tiny", "--device", "cpu", "--out", str(tmp_path / "v")]
    positions = 8192  # random:SHAPE's context
    # the default shapes' largest tree is 6x10: 60 nodes past the root; near the end of the
    # context the generator would decode plainly, and the oracle's tau would not be measured
    room = ["--prompt-tokens", str(positions - 128 - 60), "--max-new-tokens", "128"]
    for flags, message, need in (
        (room, "largest tree of --shapes", positions + 1),
        (
            ["--prefix-tokens", str(positions), "--sizes", "1,2"],
            "largest of --sizes",
            positions + 2,
        ),
    ):
        assert bench_verify.main([*base, *flags]) == 2
        assert f"{message} ({need}) pass the base's context" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()
    for flag in ("--prefix-tokens", "--max-new-tokens"):
        with pytest.raises(SystemExit) as stop:
            bench_verify.main([*base, flag, "0"])
        assert stop.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_measure_parting_gives_the_logit_gap_where_outputs_first_differ():
    model = make_tiny_llama()
    truth = torch.randint(3, 256, (20,))
    ours = truth.clone()
    ours[12] = (truth[12] + 7) % 256
    ours[15] = (truth[15] + 1) % 256  # a later difference does not count
    gap, typical = bench_verify.measure_parting(model, truth, ours, prompt_len=8)
    logits = model(truth[None]).logits[0]
    assert abs(gap - (logits[11, truth[12]] - logits[11, ours[12]]).abs().item()) < 1e-5
    top2 = logits[7:-1].topk(2).values  # the 12 positions that predict output tokens
    assert abs(typical - (top2[:, 0] - top2[:, 1]).median().item()) < 1e-5


def test_oracle_tree_holds_the_right_token_last_on_each_level():
    truth = list(range(10, 30))
    oracle = bench_verify.OracleDrafter(truth, depth=2, width=3, vocab_size=256, device="cpu")
    draft = oracle.propose(torch.tensor(truth[:5]), None)
    assert draft.tree.parents.tolist() == [-1, 0, 0, 0, 3, 3, 3]
    assert draft.tokens.tolist() == [14, 16, 17, 15, 17, 18, 16]
