"""scripts/bench.py's figures computed by hand: a record's tokens/s, speedup, tau and time
shares from its timed runs, and the report's aggregates, tables and plots from the records
(the figures the README's results are read from)."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (scripts/ is not a package)
import bench_report  # noqa: E402
from bench_methods import Method, Run, _arm_depth  # noqa: E402

PROMPT = bench.BenchPrompt(0, 0, "c", "x", [], ["Hi"])


def timings(other: float, draft: float = 0.05) -> dict:
    return {"base": 1.0 - other - draft, "draft": draft, "other": other, "total": 1.0}


def test_a_record_takes_the_run_of_median_speed_and_divides_by_the_baselines():
    greedy = Method("baseline", "baseline", None, torch.device("cpu"), True)
    base = bench_report.make_record(PROMPT, 0, greedy, 5, [(0.2, Run(list(range(10))))], None)
    assert (base["tokens_per_s"], base["speedup"], base["steps"]) == (50.0, 1.0, 9.0)
    sampled = Method("m", "ngram", None, torch.device("cpu"), False)
    timed = [  # 100 tokens/s, 133/s, 25/s: the first run is the median one; the last plain
        (0.10, Run(list(range(10)), [2] * 5, timings(other=0.1), [4] * 5)),
        (0.15, Run(list(range(20)), [4] * 5, timings(other=0.2, draft=0.3), [4] * 5)),
        (0.20, Run(list(range(5)), [1] * 5, timings(other=0.6), [1] * 5)),
    ]
    record = bench_report.make_record(PROMPT, 0, sampled, 5, timed, base)
    assert (record["new_tokens"], record["seconds"]) == (10, 0.10)
    assert record["tokens_per_s"] == pytest.approx(100.0)  # not 10 / the median time (0.15)
    assert record["speedup"] == pytest.approx(2.0)  # 100 tokens/s against the baseline's 50
    assert record["tau"] == pytest.approx(35 / 15) and record["steps"] == 5.0
    assert record["accepted_lengths"] == {"1": 5, "2": 5, "4": 5}
    assert record["plain_steps"] == 5  # over every run, as the histogram
    assert record["other_share"] == pytest.approx(0.2)  # the median over runs of other/total
    assert record["identical"] is None  # sampled: never compared


def test_every_method_is_compared_with_the_baseline_not_the_method_before(smollm2_tokenizer):
    def method(name: str, kind: str, out: Run) -> Method:
        return Method(name, kind, lambda ids, seed, **_: out, torch.device("cpu"), True)

    step = timings(other=0.1)
    methods = [
        method("baseline", "baseline", Run([1, 2, 3, 4])),
        method("parting", "ngram", Run([1, 2, 3, 9], [2, 2], step)),
        method("same", "ngram", Run([1, 2, 3, 4], [2, 2], step)),
    ]
    records = bench.run_bench([PROMPT], methods, smollm2_tokenizer, 1, 0)
    identical = {r["method"]: r["identical"] for r in records}
    assert identical == {"baseline": True, "parting": False, "same": True}


def test_an_embedded_prompt_is_in_its_categorys_name():
    prompts = bench.read_prompts("embedded", k_per_category=1)
    assert len(prompts) > 1 and not any(p.category in ("embedded", "all") for p in prompts)
    assert len({p.category for p in prompts}) == len(prompts)


def row(
    method, prompt, turn, category, tokens, seconds, speedup, tau, hist, identical=True, plain=0
):
    return {
        "method": method,
        "prompt": prompt,
        "turn": turn,
        "category": category,
        "source": "questions.jsonl",
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "speedup": speedup,
        "tau": tau,
        "accepted_lengths": hist,
        "plain_steps": plain if hist else None,
        "identical": identical,
        "other_share": 0.1 if hist else None,
    }


METHODS = [
    {"name": "baseline", "kind": "baseline", "draft_depth": None},
    {"name": "heads", "kind": "medusa", "draft_depth": 2},
    {"name": "sampled", "kind": "ngram", "draft_depth": 1},
]


@pytest.fixture
def records() -> list[dict]:
    """Three prompts in two categories, the first with two turns (the second turn's baseline
    twice as slow); the Medusa method 2x, 4x, 1x and 10x as fast, one output not identical
    (and 12 tokens there, 10 of its 12 steps plain), its own tau per record 2, 2, 1 and 2.75."""
    return [
        row("baseline", 0, 0, "a", 10, 1.0, 1.0, 1.0, None),
        row("baseline", 0, 1, "a", 10, 2.0, 1.0, 1.0, None),
        row("baseline", 1, 0, "a", 10, 1.0, 1.0, 1.0, None),
        row("baseline", 2, 0, "b", 10, 1.0, 1.0, 1.0, None),
        row("heads", 0, 0, "a", 10, 0.5, 2.0, 2.0, {"1": 2, "3": 2}),
        row("heads", 0, 1, "a", 10, 0.5, 4.0, 2.0, {"2": 5}),
        row("heads", 1, 0, "a", 12, 1.2, 1.0, 1.0, {"1": 12}, identical=False, plain=10),
        row("heads", 2, 0, "b", 10, 0.1, 10.0, 2.75, {"3": 3, "2": 1}),
        row("sampled", 0, 0, "a", 10, 0.5, 2.0, 1.5, {"1": 1, "2": 1}, identical=None),
    ]


def test_the_aggregates_pool_steps_and_time_and_take_each_turns_own_baseline(records):
    summary = bench_report.summarize(records, METHODS)
    heads = summary["overall"]["heads"]
    assert heads["records"] == 4 and heads["new_tokens"] == 42
    assert heads["tokens_per_s"] == pytest.approx(42 / 2.3)
    # total tokens/s over the baseline's on the same prompts and turns (40 tokens in 5 s)
    assert heads["speedup_overall"] == pytest.approx((42 / 2.3) / (40 / 5.0))
    assert heads["speedup_median"] == pytest.approx(3.0)  # of 1, 2, 4, 10
    assert heads["speedup_mean"] == pytest.approx(4.25)
    # every verify step pooled: lengths 1 x14, 2 x6, 3 x5
    assert heads["tau"] == pytest.approx(41 / 25)
    assert heads["tau_mean_per_prompt"] == pytest.approx(7.75 / 4)
    assert heads["accepted_lengths"] == {"1": 14, "2": 6, "3": 5}
    # of the 15 steps that drafted (10 plain ones drafted nothing): >= 1, >= 2 drafted accepted
    assert heads["accept_at_least"] == pytest.approx([11 / 15, 5 / 15])
    assert heads["drafted_share"] == pytest.approx(15 / 25)
    assert heads["identical_rate"] == 0.75
    assert summary["overall"]["sampled"]["identical_rate"] is None  # never compared
    assert summary["overall"]["baseline"]["tau"] == 1.0
    assert list(summary["by_category"]) == ["a", "b"]
    b = summary["by_category"]["b"]["heads"]
    assert (b["records"], b["speedup_median"], b["tau"]) == (1, 10.0, 2.75)
    a = summary["by_category"]["a"]["heads"]
    assert a["records"] == 3 and a["speedup_overall"] == pytest.approx((32 / 2.2) / (30 / 4.0))


def results_of(records: list[dict]) -> dict:
    return {"methods": METHODS, "summary": bench_report.summarize(records, METHODS)}


def test_the_tables_show_the_aggregates_they_name(records):
    table = bench_report.markdown_table(results_of(records)).splitlines()
    assert table[2] == "| baseline | baseline | 1.00 | 8.0 | 1.00x | 1.00x | 100% |"
    assert table[3] == "| heads | medusa | 1.64 | 18.3 | 3.00x | 2.28x | 75.0% (3/4) |"
    assert table[4] == "| sampled | ngram | 1.50 | 20.0 | 2.00x | 2.00x | n/a |"
    rows = bench_report.category_table(results_of(records)).splitlines()
    assert rows[0] == (
        "| category | baseline: tau / speedup | heads: tau / speedup | sampled: tau / speedup |"
    )
    assert rows[2] == "| a (3) | 1.00 / 1.00x | 1.43 / 2.00x | 1.50 / 2.00x |"
    assert rows[3] == "| b (1) | 1.00 / 1.00x | 2.75 / 10.00x | n/a / n/a |"


def test_an_identical_share_counts_outputs_and_a_skipped_note_only_skipped_prompts():
    share = bench_report.identical_share
    assert share(29 / 100, 100) == "29.0% (29/100)"  # 29/100 * 100 is 28.999...
    assert share(199 / 200, 200) == "99.5% (199/200)"
    assert bench_report.skipped_note({"read": 5, "count": 5}) == ""
    assert bench_report.skipped_note({"count": 5}) == ""
    assert bench_report.skipped_note({"read": 7, "count": 5}).startswith("; 2 more read")


def test_the_plots_draw_the_aggregates(records, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # kept open to be read
    results = results_of(records)
    written = bench_report.write_plots(results, tmp_path)
    assert [p.name for p in written] == [
        "tau_by_category.png",
        "speedup.png",
        "accepted_lengths.png",
        "medusa_head_accuracy.png",
    ]

    def heights(figure) -> list[float]:
        return [bar.get_height() for bar in figure.axes[0].patches]

    overall, by_category = results["summary"]["overall"], results["summary"]["by_category"]
    tau, speedup, accepted, heads = figures
    groups = [by_category["a"], by_category["b"], overall]  # series by series, group by group
    want = [g[n]["tau"] or 0 for n in ("baseline", "heads", "sampled") for g in groups]
    assert heights(tau) == pytest.approx(want)
    assert heights(speedup) == pytest.approx([1.0, 3.0, 2.0])  # the medians
    assert list(speedup.axes[0].lines[0].get_ydata()) == pytest.approx(
        [overall[n]["speedup_overall"] for n in ("baseline", "heads", "sampled")]
    )
    # shares of steps gaining 1, 2, 3 tokens: the Medusa method's, then the sampled one's
    assert heights(accepted) == pytest.approx([14 / 25, 6 / 25, 5 / 25, 0.5, 0.5, 0.0])
    assert list(heads.axes[0].lines[0].get_ydata()) == pytest.approx([11 / 15, 5 / 15])
    assert list(heads.axes[0].get_xticks()) == [1, 2]  # heads are counted, not measured
    monkeypatch.undo()
    for figure in figures:
        plt.close(figure)


def test_the_accepted_lengths_plot_leaves_a_gap_for_a_length_no_step_gained(figures, tmp_path):
    records = [
        row("baseline", 0, 0, "a", 10, 1.0, 1.0, 1.0, None),
        row("heads", 0, 0, "a", 10, 0.5, 2.0, 2.5, {"1": 2, "4": 2}),
    ]
    bench_report.write_plots(results_of(records), tmp_path)
    accepted = figures[2].axes[0]
    assert [bar.get_height() for bar in accepted.patches] == [0.5, 0.0, 0.0, 0.5]
    assert [t.get_text() for t in accepted.get_xticklabels()] == ["1", "2", "3", "4"]


def test_an_arms_depth_is_the_most_tokens_one_of_its_steps_can_accept():
    assert _arm_depth(None, 4) == 0  # plain decoding
    assert _arm_depth({"top_k": 4, "depth": 2, "total_tokens": 6}, 4) == 2
    assert _arm_depth({"choices": [[0], [1], [0, 0], [0, 0, 1]]}, 4) == 3
    assert _arm_depth({"num_tokens": 3}, 5) == 5  # keeps the drafter's own


HEADS_METHODS = [
    {"name": "baseline", "kind": "baseline", "draft_depth": None},
    {"name": "heads", "kind": "medusa", "draft_depth": 2},
]


def heads_row(method: str, prompt: int, category: str, hist: dict | None) -> dict:
    return {
        "method": method,
        "prompt": prompt,
        "turn": 0,
        "category": category,
        "new_tokens": 10,
        "seconds": 1.0 if method == "baseline" else 0.5,
        "speedup": 1.0 if method == "baseline" else 2.0,
        "tau": None if hist is None else 2.0,
        "accepted_lengths": hist,
        "identical": True,
        "other_share": None,
    }


HEADS_RECORDS = [
    heads_row("baseline", 0, "a", None),
    heads_row("baseline", 1, "b", None),
    heads_row("heads", 0, "a", {"1": 2, "3": 2}),
    heads_row("heads", 1, "b", {"2": 4}),
]


def heads_results(machine: dict) -> dict:
    return {
        "base": "tiny",
        "date": "2026-12-07",
        "machine": machine,
        "versions": {"torch": "2.9", "transformers": "5.0"},
        "settings": {"temperature": 0, "top_p": 1.0, "max_new_tokens": 8, "runs": 1},
        "prompts": {"count": 2, "source": "questions.jsonl", "turns": "all"},
        "command": "python scripts/bench.py",
        "methods": HEADS_METHODS,
        "summary": bench_report.summarize(HEADS_RECORDS, HEADS_METHODS),
    }


def test_the_report_names_the_machine_also_from_a_results_json_without_cpu_bf16():
    """results.json files written before `cpu_bf16` was recorded still render: the line says
    nothing about bf16 then, rather than failing."""
    machine = {"gpu": None, "cpu": "Xeon", "cpus_usable": 8, "torch_threads": 4}
    old = bench_report.markdown(heads_results(machine)).splitlines()
    assert old[2] == (
        "2026-12-07 on Xeon, 8 cores usable (4 torch threads); torch 2.9, transformers 5.0."
    )
    assert old[3].startswith("2 prompts from `questions.jsonl` (every user turn, in context)")
    new = bench_report.markdown(heads_results({**machine, "cpu_bf16": False})).splitlines()
    assert new[2].startswith("2026-12-07 on Xeon, 8 cores usable, no bf16 instructions (4 torch")
    gpu = bench_report.markdown(heads_results({**machine, "gpu": "H100", "cpu_bf16": True}))
    assert gpu.splitlines()[2].startswith("2026-12-07 on H100 (4 torch threads)")


@pytest.fixture
def figures(monkeypatch):
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # kept open to be read
    yield kept
    monkeypatch.undo()
    for figure in kept:
        plt.close(figure)


def test_grouped_bars_are_centred_on_their_groups_tick(figures, tmp_path):
    """Each group's bars (one per method) sit side by side around the group's tick."""
    bench_report.write_plots(heads_results({"gpu": None}), tmp_path)
    ax = figures[0].axes[0]  # tau by category: groups a, b, overall; series baseline, heads
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "overall"]
    assert list(ax.get_xticks()) == [0, 1, 2]
    centres = [bar.get_x() + bar.get_width() / 2 for bar in ax.patches]
    assert centres == pytest.approx([-0.2, 0.8, 1.8, 0.2, 1.2, 2.2])  # series by series


def test_a_medusa_method_without_verify_steps_draws_no_head_accuracy_plot(figures, tmp_path):
    """max_new_tokens 1: the prefill gives every token, no step is verified; the report still
    draws the other plots."""
    steps_none = [{**r, "accepted_lengths": None} for r in HEADS_RECORDS]
    run = heads_results({"gpu": None})
    run["summary"] = bench_report.summarize(steps_none, HEADS_METHODS)
    assert run["summary"]["overall"]["heads"]["accept_at_least"] is None
    written = bench_report.write_plots(run, tmp_path)
    assert [p.name for p in written] == ["tau_by_category.png", "speedup.png"]


def test_the_head_plot_has_a_tick_for_each_head_of_the_deepest_medusa_method(figures, tmp_path):
    methods = [
        HEADS_METHODS[0],
        {"name": "two", "kind": "medusa", "draft_depth": 2},
        {"name": "three", "kind": "medusa", "draft_depth": 3},
    ]
    hist = {"1": 1, "3": 2}
    rows = [heads_row(m["name"], 0, "a", hist if m["draft_depth"] else None) for m in methods]
    summary = bench_report.summarize(rows, methods)
    bench_report.write_plots({"methods": methods, "summary": summary}, tmp_path)
    heads = figures[-1].axes[0]
    assert list(heads.get_xticks()) == [1, 2, 3]
    # of the steps that drafted, 2 of 3 accepted >= 1 and >= 2 drafted tokens, none 3
    assert [list(line.get_ydata()) for line in heads.lines] == [
        pytest.approx([2 / 3, 2 / 3]),
        pytest.approx([2 / 3, 2 / 3, 0.0]),
    ]


def test_a_step_that_verified_one_drafted_token_is_no_plain_step():
    greedy = Method("lookup", "ngram", None, torch.device("cpu"), True)
    timings = {"base": 0.8, "draft": 0.1, "other": 0.1, "total": 1.0}
    timed = [  # root alone, root and one token, root and three; then the same again
        (0.1, Run(list(range(5)), [1, 2, 2], timings, [1, 2, 4])),
        (0.1, Run(list(range(5)), [1, 2, 2], timings, [1, 2, 4])),
    ]
    record = bench_report.make_record(
        bench.BenchPrompt(0, 0, "c", "x", [], ["Hi"]), 0, greedy, 5, timed, None
    )
    assert record["plain_steps"] == 2 and record["accepted_lengths"] == {"1": 2, "2": 4}
