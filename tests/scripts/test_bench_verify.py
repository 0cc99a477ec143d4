"""scripts/bench_verify.py on a random tiny Llama: the files it writes, an oracle whose tau is
D + 1 exactly, exact greedy output, and the logit gap it reports where two outputs part."""

import json
import sys
import types
from pathlib import Path

import pytest
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


class FakeClock:
    """A perf_counter that moves only when told."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def tiny():
    return bench_verify.build_base("random:tiny", torch.float32, torch.device("cpu"), "sdpa")


def test_oracle_max_nodes_is_the_size_of_the_trees_it_proposes():
    truth = list(range(10, 40))
    for depth, width in ((0, 1), (2, 3), (4, 1)):
        oracle = bench_verify.OracleDrafter(truth, depth, width, vocab_size=256, device="cpu")
        draft = oracle.propose(torch.tensor(truth[:5]), None)
        assert oracle.max_nodes == draft.tree.num_nodes == len(draft.tokens) == 1 + depth * width


def test_decode_loop_figures_come_from_the_timed_seconds(monkeypatch):
    """HF generate takes 4 s, each oracle run 1 s: tokens/s and speedups follow exactly."""
    model = tiny()
    clock = FakeClock()
    monkeypatch.setattr(
        bench_verify, "time", types.SimpleNamespace(perf_counter=clock.perf_counter)
    )
    hf_generate, oracle_generate = model.generate, bench_verify.generate_with_oracle

    def slow_hf(*args, **kwargs):
        clock.now += 4.0
        return hf_generate(*args, **kwargs)

    def fast_oracle(*args, **kwargs):
        clock.now += 1.0
        return oracle_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", slow_hf)
    monkeypatch.setattr(bench_verify, "generate_with_oracle", fast_oracle)
    # 13 new tokens: the prefill's, then 12 = 4 steps of 3 (2x1) or 12 of 1 (0x1)
    table = bench_verify.time_decode_loop(model, [(0, 1), (2, 1)], 2, 8, 13, seed=0)
    hf, plain, oracle = table
    assert hf == {"method": "HF generate", "tokens_per_s": pytest.approx(13 / 4)}
    for row, tau in ((plain, 1.0), (oracle, 3.0)):
        assert row["tokens_per_s"] == pytest.approx(13.0)
        assert row["speedup"] == pytest.approx(4.0)
        assert row["tau"] == pytest.approx(tau) and row["identical"] == 1.0


def test_tree_cost_is_the_median_of_the_timed_rounds_relative_to_one_node(monkeypatch):
    """A forward of N tokens takes N ms, 100 times that in the 3 warm-up rounds."""
    model = tiny()
    clock = FakeClock()
    monkeypatch.setattr(
        bench_verify, "time", types.SimpleNamespace(perf_counter=clock.perf_counter)
    )
    forward, calls = model.forward, {}

    def timed(input_ids, *args, **kwargs):
        n = input_ids.shape[1]
        calls[n] = calls.get(n, 0) + 1
        clock.now += n * 0.001 * (100 if calls[n] <= 3 else 1)
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", timed)
    cost = bench_verify.time_tree_forwards(model, [1, 2, 8], prefix_tokens=16, repeats=1)
    assert [c["nodes"] for c in cost] == [1, 2, 8]
    assert [c["ms"] for c in cost] == pytest.approx([1.0, 2.0, 8.0])
    assert [c["vs_one_node"] for c in cost] == pytest.approx([1.0, 2.0, 8.0])


def test_markdown_gives_the_identical_rate_in_percent():
    results = {
        "base": "random:tiny",
        "dtype": "float32",
        "device_name": "CPU",
        "command": "c",
        "prefix_tokens": 16,
        "repeats": 1,
        "prompts": 2,
        "prompt_tokens": 8,
        "max_new_tokens": 13,
        "cost": [{"nodes": 1, "ms": 1.0, "vs_one_node": 1.0}],
        "loop": [
            {"method": "HF generate", "tokens_per_s": 3.25},
            {
                "method": "oracle 2x1",
                "depth": 2,
                "width": 1,
                "nodes": 3,
                "tokens_per_s": 13.0,
                "speedup": 4.0,
                "tau": 3.0,
                "identical": 0.5,
                "parting_gaps": [0.25],
            },
        ],
    }
    text = bench_verify.render_markdown(results)
    assert "| oracle 2x1 | 3 | 13.0 | 4.00x | 3.00 | 50% | 0.25 |" in text


def _stub_timings(monkeypatch):
    monkeypatch.setattr(
        bench_verify,
        "time_tree_forwards",
        lambda *a: [{"nodes": 1, "ms": 1.0, "vs_one_node": 1.0}],
    )
    monkeypatch.setattr(
        bench_verify,
        "time_decode_loop",
        lambda *a: [{"method": "HF generate", "tokens_per_s": 1.0}],
    )


def test_default_dtype_on_a_cpu_is_fp32(tmp_path, monkeypatch):
    import json

    _stub_timings(monkeypatch)
    out = tmp_path / "v"
    assert bench_verify.main(["--base", "random:tiny", "--device", "cpu", "--out", str(out)]) == 0
    assert json.loads((out / "verify.json").read_text())["dtype"] == "float32"


def test_a_run_that_just_fits_the_context_runs_and_its_oracle_keeps_its_tau(tmp_path, monkeypatch):
    """need == the base's positions is allowed, and every step of the oracle then verifies its
    whole tree (tau = D + 1); one position fewer is refused."""
    import json

    build = bench_verify.build_base
    positions = {"n": 0}

    def small_context(*args):
        model = build(*args)
        model.config.max_position_embeddings = positions["n"]
        return model

    monkeypatch.setattr(bench_verify, "build_base", small_context)
    out = tmp_path / "v"
    argv = ["--base", "random:tiny", "--device", "cpu", "--dtype", "fp32", "--sizes", "1,2"]
    argv += ["--repeats", "1", "--prompts", "1", "--prompt-tokens", "8", "--prefix-tokens", "8"]
    argv += ["--max-new-tokens", "13", "--shapes", "2x3", "--out", str(out)]
    positions["n"] = 8 + 13 + 6 + 1  # prompt + new tokens + the tree past its root + 1
    assert bench_verify.main(argv) == 0
    (row,) = json.loads((out / "verify.json").read_text())["loop"][1:]
    assert row["tau"] == 3.0 and row["identical"] == 1.0
    positions["n"] -= 1
    assert bench_verify.main([*argv[:-1], str(tmp_path / "w")]) == 2
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sizes", "2,4"], "--sizes must include 1"),
        (["--shapes", "2x0"], "want DEPTHxWIDTH"),
        (["--shapes", "2"], "want DEPTHxWIDTH"),
    ],
)
def test_usage_errors(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_verify.main(["--base", "random:tiny", "--out", str(tmp_path / "v"), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--base", "/no/such/base"], "bench_verify failed: base model folder not found"),
        (["--base", "random:nope"], "bench_verify failed: unknown random shape 'nope'"),
        (["--device", "foo"], "bench_verify failed: device='foo' is no torch device"),
        (["--out", "FILE"], "bench_verify failed: --out FILE is a file: give a folder"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_any_timing(
    flags, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    Path("FILE").write_text("notes")
    monkeypatch.setattr(bench_verify, "time_tree_forwards", lambda *a: pytest.fail("timed"))
    argv = ["--base", "random:tiny", "--device", "cpu", "--out", "new/verify", *flags]
    assert bench_verify.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not Path("new").exists() and Path("FILE").read_text() == "notes"
