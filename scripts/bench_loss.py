"""The soft-label loss: train.losses.soft_target_ce against the log-softmax formula it replaced.

python scripts/bench_loss.py [--rows 4096] [--vocab 128256] [--dtype bfloat16|float32] [--runs 2]

Each run of each method is a fresh process (so that its peak memory is its own): random logits
(rows, vocab) in `--dtype` that require grad, the targets a softmax of other random logits in
fp32, every row's own target; it times one forward and backward and samples the process's
resident memory every 2 ms. "memory" is the peak above what the inputs took. Prints one line
per run and checks that both methods give the same loss.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train.losses import soft_target_ce  # noqa: E402

METHODS = {
    "log_softmax": lambda z, t, rows: -(t[rows] * z.float().log_softmax(-1)).sum(),
    "soft_target_ce": soft_target_ce,
}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(method: str, rows: int, vocab: int, dtype: str) -> str:
    """One run in this process: 'loss seconds peak_bytes'."""
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab) * 3).to(getattr(torch, dtype)).requires_grad_()
    targets = torch.randn(rows, vocab).softmax(-1)
    index = torch.arange(rows)
    gc.collect()
    start, peak, done = resident_bytes(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    loss = METHODS[method](logits, targets, index)
    loss.backward()
    seconds = time.perf_counter() - t0
    peak[0] = max(peak[0], resident_bytes())
    done.set()
    watcher.join()
    return f"{float(loss.detach())!r} {seconds} {max(peak[0] - start, 0)}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=4096, help="target rows (tokens)")
    p.add_argument("--vocab", type=int, default=128256, help="V (Llama 3's: 128256)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--runs", type=int, default=2, help="runs per method, interleaved")
    p.add_argument("--one", choices=list(METHODS), help=argparse.SUPPRESS)  # a child run
    args = p.parse_args(argv)
    if args.one:
        print(measure(args.one, args.rows, args.vocab, args.dtype))
        return
    size = args.rows * args.vocab
    print(
        f"{args.rows} rows x {args.vocab} vocab, {args.dtype} logits "
        f"({size * getattr(torch, args.dtype).itemsize / 2**30:.2f} GiB), fp32 targets; "
        f"forward + backward, {torch.get_num_threads()} threads"
    )
    losses = {}
    for run in range(args.runs):
        for method in METHODS:
            child = [sys.executable, __file__, "--one", method, "--rows", str(args.rows)]
            child += ["--vocab", str(args.vocab), "--dtype", args.dtype]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            loss, seconds, peak = out.split()
            losses.setdefault(method, float(loss))
            print(
                f"run {run + 1} {method:>15}: {float(seconds):6.2f} s, "
                f"memory {int(peak) / 2**30:5.2f} GiB, loss {float(loss):.6g}"
            )
    a, b = losses.values()
    if abs(a - b) > 1e-4 * abs(a):
        sys.exit(f"the two losses differ: {a} against {b}")


if __name__ == "__main__":
    main()
