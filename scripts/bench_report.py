"""The records, aggregates, markdown report and PNG plots of `scripts/bench.py` results, and
the benchmark scripts' --out folder (`make_out`)."""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections import Counter
from pathlib import Path

import torch

from heads.export import make_folders
from train.precision import cpu_has_bf16

PLOTS = {
    "tau": "tau_by_category.png",
    "speedup": "speedup.png",
    "accepted": "accepted_lengths.png",
    "heads": "medusa_head_accuracy.png",
}


def make_out(out: str | Path) -> tuple[Path, list[Path]]:
    """`--out`, made before anything is timed (a folder that cannot be written loses no
    timings), and the folders this made, deepest first, which `heads.export.remove_made`
    removes again should the run stop before writing to them."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise OSError(f"--out {out} is a file: give a folder to write the results into")
    made = make_folders(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(f"--out {out} is not writable by this user: give a folder you can write")
    return path, made


def machine_info() -> dict:
    """CPU model, cores, torch threads, bf16 instructions and GPU: what a reader needs to weigh
    the timings (a CPU without AVX512 or bf16 ran the demo's benchmark at half the speed)."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "cpu_bf16": cpu_has_bf16(),
        "gpu": gpu,
        "platform": platform.platform(),
    }


def make_record(p, turn, method, prompt_tokens, timed, baseline) -> dict:
    """One (prompt, turn, method) record: tokens, seconds and tokens/s of the timed run of
    median tokens/s (the lower middle one of an even count); tau and the accepted-length
    histogram and the plain steps among them over every run's steps (an adaptive generator's
    trees may differ from run to run); identical only when every run's tokens equal the
    baseline's. Greedy runs repeat the same tokens; sampled ones need not (the adaptive policy
    carries over from run to run), so one run's tokens are never divided by another's time.
    `p`: a bench.BenchPrompt; `timed`: (seconds, bench_methods.Run) per timed run; `baseline`:
    the baseline's record of that prompt and turn (None: this is the baseline's)."""
    seconds = [s for s, _ in timed]
    rates = [len(r.new_ids) / s if s > 0 else math.inf for s, r in timed]
    middle = sorted(range(len(timed)), key=rates.__getitem__)[(len(timed) - 1) // 2]
    median, out = timed[middle]
    new = len(out.new_ids)
    record = {
        "prompt": p.index,
        "id": p.id,
        "source": p.source,
        "category": p.category,
        "turn": turn,
        "method": method.name,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new,
        "seconds": median,
        "seconds_runs": seconds,
        "tokens_per_s": new / median if median > 0 else None,
        "tau": 1.0 if method.kind == "baseline" else None,
        # the prefill's token is no verify step, as in the accepted lengths of ours
        "steps": float(max(new - 1, 0)) if method.kind == "baseline" else None,
        "speedup": 1.0,
        "identical": True if method.greedy else None,
        "other_share": None,
        "accepted_lengths": None,
        "plain_steps": None,
        "_ids": out.new_ids,
    }
    if out.accepted_lengths is not None:
        accepted = [n for _, r in timed for n in r.accepted_lengths]
        steps = len(accepted)
        record["tau"] = sum(accepted) / steps if steps else None
        record["steps"] = steps / len(timed)  # per run
        hist = Counter(accepted)
        record["accepted_lengths"] = {str(k): hist[k] for k in sorted(hist)}
        # steps that verified the root alone (drafting nothing to accept), over every run as the
        # histogram
        record["plain_steps"] = sum(n == 1 for _, r in timed for n in r.tree_sizes or ())
        shares = [r.timings["other"] / r.timings["total"] for _, r in timed if r.timings["total"]]
        record["other_share"] = statistics.median(shares) if shares else None
    if baseline is not None:
        base_tps, tps = baseline["tokens_per_s"], record["tokens_per_s"]
        record["speedup"] = tps / base_tps if base_tps and tps is not None else None
        if method.greedy:
            record["identical"] = all(r.new_ids == baseline["_ids"] for _, r in timed)
    return record


def summarize(records: list[dict], methods: list[dict]) -> dict:
    """Aggregates per method, overall and per category (see `aggregate`)."""
    baseline = {(r["prompt"], r["turn"]): r for r in records if r["method"] == "baseline"}
    categories = sorted({r["category"] for r in records})
    summary: dict = {"overall": {}, "by_category": {c: {} for c in categories}}
    for method in methods:
        rows = [r for r in records if r["method"] == method["name"]]
        summary["overall"][method["name"]] = aggregate(rows, baseline, method)
        for c in categories:
            in_c = [r for r in rows if r["category"] == c]
            summary["by_category"][c][method["name"]] = aggregate(in_c, baseline, method)
    return summary


def aggregate(rows: list[dict], baseline: dict, method: dict) -> dict:
    """One method over some records.

    tau pools every verify step (Spec-Bench's mean accepted tokens, bonus included);
    speedup_overall is the method's total tokens/s over the baseline's on the same prompts
    (= total baseline time / total method time when the outputs are identical).
    """
    tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    base_rows = [baseline[(r["prompt"], r["turn"])] for r in rows]
    base_tokens = sum(r["new_tokens"] for r in base_rows)
    base_seconds = sum(r["seconds"] for r in base_rows)
    tps = tokens / seconds if seconds > 0 else None
    base_tps = base_tokens / base_seconds if base_seconds > 0 else None
    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in (r["accepted_lengths"] or {}).items()})
    steps = sum(hist.values())
    if method["kind"] == "baseline":
        tau = 1.0
    else:
        tau = sum(k * v for k, v in hist.items()) / steps if steps else None
    # results.json files before plain_steps lack it: every step counted as drafted
    plain = sum(r.get("plain_steps") or 0 for r in rows)
    drafted = steps - plain
    at_least = None
    if drafted and method["draft_depth"]:
        # Share of the steps that drafted which accepted >= k drafted tokens (a length counts
        # the bonus; a plain step's is 1, so it adds to no k)
        at_least = [
            sum(v for length, v in hist.items() if length - 1 >= k) / drafted
            for k in range(1, method["draft_depth"] + 1)
        ]
    return {
        "records": len(rows),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tps,
        "tau": tau,
        "tau_mean_per_prompt": _mean(r["tau"] for r in rows),
        "speedup_median": _median(r["speedup"] for r in rows),
        "speedup_mean": _mean(r["speedup"] for r in rows),
        "speedup_overall": tps / base_tps if tps is not None and base_tps else None,
        "identical_rate": _mean(r["identical"] for r in rows),
        "other_share_mean": _mean(r["other_share"] for r in rows),
        "accepted_lengths": {str(k): hist[k] for k in sorted(hist)} if steps else None,
        "drafted_share": drafted / steps if steps and method["kind"] != "baseline" else None,
        "accept_at_least": at_least,
    }


def _mean(values) -> float | None:
    values = [float(v) for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(results: dict) -> str:
    """method x [tau, tok/s, speedup, identical %] over all prompts."""
    lines = [
        "| method | kind | tau | tok/s | speedup (median) | speedup (overall) | identical |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in results["methods"]:
        a = results["summary"]["overall"][m["name"]]
        lines.append(
            f"| {m['name']} | {m['kind']} | {_fmt(a['tau'])} | {_fmt(a['tokens_per_s'], '.1f')} "
            f"| {_fmt(a['speedup_median'], '.2f', 'x')} | {_fmt(a['speedup_overall'], '.2f', 'x')} "
            f"| {identical_share(a['identical_rate'], a['records'])} |"
        )
    return "\n".join(lines)


def skipped_note(prompts: dict) -> str:
    """'; N more read, skipped: ...' when some prompts read did not fit the base's context."""
    skipped = prompts.get("read", prompts["count"]) - prompts["count"]
    return f"; {skipped} more read, skipped: past the base's context" if skipped > 0 else ""


def identical_share(rate: float | None, records: int) -> str:
    """100% only when every output was identical; else the count, never rounded up to 100%."""
    if rate is None:
        return "n/a"
    if rate == 1:
        return "100%"
    same = round(rate * records)
    return f"{math.floor(1000 * same / records) / 10:.1f}% ({same}/{records})"


def category_table(results: dict) -> str:
    """tau / median speedup per method (columns) and category (rows)."""
    names = [m["name"] for m in results["methods"]]
    lines = [
        "| category | " + " | ".join(f"{n}: tau / speedup" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for category, per_method in results["summary"]["by_category"].items():
        cells = [
            f"{_fmt(per_method[n]['tau'])} / {_fmt(per_method[n]['speedup_median'], '.2f', 'x')}"
            for n in names
        ]
        lines.append(
            f"| {category} ({per_method[names[0]]['records']}) | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def markdown(results: dict) -> str:
    machine, s = results["machine"], results["settings"]
    device = machine["gpu"] or f"{machine['cpu']}, {machine['cpus_usable']} cores usable"
    if not machine["gpu"] and "cpu_bf16" in machine:  # results.json files before it lack it
        device += ", " + ("bf16 instructions" if machine["cpu_bf16"] else "no bf16 instructions")
    decoding = (
        "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-p {s['top_p']}"
    )
    prompts = results["prompts"]
    turns = "first user turn" if prompts["turns"] == "first" else "every user turn, in context"
    adapter = s.get("base_adapter_of")  # results.json files before it lack it
    merged = f" with the LoRA adapter of the Medusa-2 heads `{adapter}` merged" if adapter else ""
    return "\n".join(
        [
            f"# Speculative decoding benchmark: `{results['base']}`{merged}",
            "",
            f"{results['date']} on {device} ({machine['torch_threads']} torch threads); torch "
            f"{results['versions']['torch']}, transformers {results['versions']['transformers']}.",
            f"{prompts['count']} prompts from `{prompts['source']}` ({turns}"
            f"{skipped_note(prompts)}), max_new_tokens {s['max_new_tokens']}, {decoding}, "
            f"{s['runs']} timed run(s) per prompt (median), methods interleaved per prompt.",
            "",
            markdown_table(results),
            "",
            "tau: mean tokens per verify step of the base, bonus token included (Spec-Bench's "
            "mean accepted tokens; HF prompt lookup does not expose it). Speedup: tokens/s over "
            f"HF `generate` ({'greedy' if s['temperature'] == 0 else 'sampling alike'}) on the "
            "same prompt (median over prompts; overall = total "
            "tokens/s ratio). Identical: output equal to the baseline token for token in "
            "every timed run (greedy only); tau pools every timed run's steps.",
            "",
            "## Per category",
            "",
            category_table(results),
            "",
            "## Reproduce",
            "",
            "```bash",
            results["command"],
            "```",
            "",
        ]
    )


def write_plots(results: dict, out: Path) -> list[Path]:
    """PNG plots next to results.json; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    overall = results["summary"]["overall"]
    written = []

    def save(fig, key: str) -> None:
        fig.tight_layout()
        fig.savefig(out / PLOTS[key], dpi=120)
        plt.close(fig)
        written.append(out / PLOTS[key])

    # tau per category, grouped bars per method.
    with_tau = [m["name"] for m in methods if overall[m["name"]]["tau"] is not None]
    groups = {**results["summary"]["by_category"], "overall": overall}
    fig, ax = plt.subplots(figsize=(_grouped_width(len(groups), len(with_tau)), 4))
    _grouped_bars(ax, list(groups), with_tau, lambda g, n: groups[g][n]["tau"])
    ax.set_ylabel("tau (tokens per verify step)")
    ax.set_title("Mean accepted tokens per category")
    save(fig, "tau")

    # Speedup per method: median over prompts (bar) and overall (marker).
    names = [m["name"] for m in methods]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(names)), 4))
    ax.bar(names, [overall[n]["speedup_median"] or 0 for n in names], label="median")
    ax.plot(names, [overall[n]["speedup_overall"] or 0 for n in names], "kD", label="overall")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("speedup vs HF generate")
    ax.tick_params(axis="x", labelrotation=30)
    for label in ax.get_xticklabels():  # long names ("demo-eagle+ngram+corpus") side by side
        label.set_horizontalalignment("right")
    ax.legend()
    save(fig, "speedup")

    # Accepted-length histogram (share of verify steps) per speculative method.
    spec = [n for n in names if overall[n]["accepted_lengths"]]
    if spec:
        seen = {int(k) for n in spec for k in overall[n]["accepted_lengths"]}
        lengths = list(range(min(seen), max(seen) + 1))  # a length no step gained: a gap

        def share(length, n):
            hist = overall[n]["accepted_lengths"]
            return hist.get(str(length), 0) / sum(hist.values())

        fig, ax = plt.subplots(figsize=(_grouped_width(len(lengths), len(spec)), 4))
        _grouped_bars(ax, lengths, spec, share)
        ax.set_xlabel("tokens gained per verify step (bonus included)")
        ax.set_ylabel("share of verify steps")
        save(fig, "accepted")

    # Medusa: share of the steps that drafted accepting >= k drafted tokens: head k-1 was right
    medusa = [m["name"] for m in methods if m["kind"] == "medusa"]
    medusa = [n for n in medusa if overall[n]["accept_at_least"]]
    if medusa:
        fig, ax = plt.subplots(figsize=(6, 4))
        depth = max(len(overall[n]["accept_at_least"]) for n in medusa)
        for n in medusa:
            acc = overall[n]["accept_at_least"]
            ax.plot(range(1, len(acc) + 1), acc, "o-", label=n)
        ax.set_xticks(range(1, depth + 1))
        ax.set_xlabel("k: head k-1 accepted, with every head before it")
        ax.set_ylabel("share of drafting steps")
        ax.set_title("Medusa heads accepted in the decode loop (plain steps left out)")
        ax.set_ylim(0, 1)
        ax.legend()
        save(fig, "heads")
    return written


def _grouped_width(groups: int, series: int) -> float:
    """Inches for a plot of grouped bars, its legend beside them."""
    return max(6.0, groups * max(0.8, 0.2 * series)) + 2.5


def _grouped_bars(ax, groups: list, series: list[str], value) -> None:
    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [value(g, name) or 0 for g in groups], width, label=name)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups], rotation=30, ha="right")
    if series:  # beside the bars, not over them
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
