"""scripts/bench_distill.py with the model, the generators and the clock stubbed: the batches it
runs, the figures it reports, its defaults and its usage errors (its end-to-end run:
tests/scripts/test_distill.py)."""

import json
import queue
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import bench_distill  # noqa: E402  (scripts/ is not a package)


class Stubs:
    """build, transformers_generator, fresh_items and distill.run_batch, recorded; each batch
    takes 1 s of a fake monotonic clock and gives 10 tokens per prompt."""

    def __init__(self, monkeypatch, prompts=6):
        self.now, self.batches, self.args = 0.0, [], []
        self.prompts = prompts
        monkeypatch.setattr(bench_distill, "build", self.build)
        monkeypatch.setattr(bench_distill, "transformers_generator", self.generator)
        monkeypatch.setattr(bench_distill, "fresh_items", self.items)
        monkeypatch.setattr(bench_distill.distill, "run_batch", self.run_batch)
        monkeypatch.setattr(bench_distill, "time", types.SimpleNamespace(monotonic=self.clock))

    def clock(self):
        return self.now

    def build(self, args):
        self.args.append(args)
        model = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
        return "recipe", model, "tokenizer", "template", [2]

    def generator(self, model, tokenizer, recipe, eos_ids, **kwargs):
        return tuple(sorted(kwargs.items()))

    def items(self, recipe, tokenizer, template):  # file order, lengths 3, 8, 1, 6, 5, 2
        lengths = [3, 8, 1, 6, 5, 2][: self.prompts]
        return [types.SimpleNamespace(first_prompt_ids=[0] * n) for n in lengths]

    def run_batch(self, items, generate, tokenizer, template, recipe):
        self.batches.append((generate, [len(i.first_prompt_ids) for i in items]))
        self.now += 1.0
        return 10 * len(items)


def test_main_runs_the_unbatched_baseline_and_each_batched_setting(tmp_path, monkeypatch):
    stubs = Stubs(monkeypatch)
    out = tmp_path / "bench.json"
    argv = ["--prompts", "6", "--unbatched", "2", "--batch-size", "3"]
    assert bench_distill.main([*argv, "--chunk-tokens", "4", "0", "--out", str(out)]) == 0
    plain, chunk4, chunk0 = (
        (("static_cache", False),),
        (("chunk_tokens", 4),),
        (("chunk_tokens", 0),),
    )
    assert stubs.batches == [
        (chunk4, [3, 8]),  # warm-ups
        (plain, [3]),
        (plain, [8]),  # the baseline: the first --unbatched prompts, one at a time
        (plain, [3]),
        (chunk4, [8, 6, 5]),  # batched: length-sorted batches of --batch-size
        (chunk4, [3, 2, 1]),
        (chunk0, [8, 6, 5]),
        (chunk0, [3, 2, 1]),
    ]
    results = json.loads(out.read_text())
    assert results["unbatched"] == {
        "prompts": 2,
        "batch_size": 1,
        "tokens": 20,
        "seconds": 2.0,
        "tokens_per_s": 10.0,
    }
    threads = torch.get_num_threads()
    assert results["batched"] == [
        {
            "prompts": 6,
            "batch_size": 3,
            "tokens": 60,
            "seconds": 2.0,
            "tokens_per_s": 30.0,
            "chunk_tokens": chunk,
            "processes": 1,
            "threads_per_process": threads,
        }
        for chunk in (4, 0)
    ]
    assert results["speedup"] == {
        "batch 3, chunk 4, 1 process(es)": 3.0,
        "batch 3, chunk 0, 1 process(es)": 3.0,
    }
    assert results["dtype"] == "float32" and stubs.args[0].dtype == "float32"  # the default


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--processes", "0"], "--batch-size and --processes must be >= 1"),
        (["--unbatched", "0"], "--unbatched, --max-new-tokens"),
        (["--batch-size", "4", "0"], "--batch-size and --processes must be >= 1"),
        (["--prompts", "-1"], "--prompts, --unbatched"),
        (["--max-new-tokens", "0"], "--max-new-tokens, --batch-size"),
        (["--chunk-tokens", "-1"], "--chunk-tokens must be >= 0"),
    ],
)
def test_usage_errors_before_the_base_loads(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(bench_distill, "build", lambda args: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as stop:
        bench_distill.main(flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err


class ThreadProcess(threading.Thread):
    """A multiprocessing.Process stand-in that runs its target in a thread."""

    def __init__(self, target, args):
        super().__init__(target=self._run, args=(target, args))
        self.exitcode = None

    def _run(self, target, args):
        try:
            target(*args)
            self.exitcode = 0
        except BaseException:
            self.exitcode = 1

    def terminate(self):
        pass


def test_processes_split_the_sorted_prompts_and_time_from_first_start_to_last_end(monkeypatch):
    Stubs(monkeypatch)
    context = types.SimpleNamespace(
        Barrier=threading.Barrier, Queue=queue.Queue, Process=ThreadProcess
    )
    monkeypatch.setattr(bench_distill, "mp", types.SimpleNamespace(get_context=lambda _: context))
    threads = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # fewer threads than processes
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    shares = {}

    def measure(items, generate, tokenizer, template, recipe, batch_size):
        lengths = [len(i.first_prompt_ids) for i in items]
        shares[lengths[0]] = lengths
        first = lengths[0] == 8  # rank 0 starts at 10 and ends at 14, rank 1 at 11 and 20
        return {
            "prompts": len(items),
            "tokens": 10 * len(items),
            "start": 10.0 if first else 11.0,
            "end": 14.0 if first else 20.0,
        }

    monkeypatch.setattr(bench_distill, "measure", measure)
    args = types.SimpleNamespace()
    run = bench_distill.measure_processes(args, batch_size=2, processes=2, chunk=4)
    assert shares == {8: [8, 5, 2], 6: [6, 3, 1]}  # length-sorted, then strided
    assert threads == [1, 1]  # at least one thread each
    assert run == {
        "prompts": 6,
        "batch_size": 2,
        "chunk_tokens": 4,
        "processes": 2,
        "threads_per_process": 1,
        "tokens": 60,
        "seconds": 10.0,
        "tokens_per_s": 6.0,
    }
