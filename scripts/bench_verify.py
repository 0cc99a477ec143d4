"""What verifying a token tree costs here, and how fast the decode loop runs at a known acceptance.

python scripts/bench_verify.py [--base smollm2-135m-instruct|random:llama3-8b|random:tiny|MODEL]
    [--dtype fp32|bf16] [--device D] [--attn sdpa|eager] [--prefix-tokens 512]
    [--sizes 1,2,4,8,16,32,64,128] [--repeats 20] [--shapes 0x1,2x1,4x1,4x4,6x10]
    [--prompts 4] [--prompt-tokens 64] [--max-new-tokens 128] [--out DIR]

1. Tree cost: one forward of N tree tokens (tree mask, lm_head over all N rows) over a cached
   prefix, for each N, median of --repeats, as a ratio to the 1-token forward. Speculation pays
   when tau * cost(1) > cost(N) + drafting (docs/bench.md): a CPU's cost grows with N, so small
   trees; a GPU's hardly does until the matmuls fill it, so trees of 32-64 nodes.
2. The loop: `SpeculativeGenerator` with an oracle drafter that knows the base's greedy output
   and proposes, per step, a tree of depth D and width W (per level W-1 wrong siblings, then the
   right token), so that each step accepts D tokens + the bonus: tau = D + 1 by construction.
   Timed against HF greedy `generate`, interleaved per prompt in one run (the order rotates).
   D = 0 is plain decoding through our loop, which shows the loop's own overhead. This is the
   speedup a drafter of that acceptance can give at most on this machine, drafting time aside;
   real heads reach what their tau allows (scripts/bench.py). The oracle follows HF's output,
   so in bf16, where a tree forward rounds differently from a 1-token one, a near-tie can part
   the two outputs: the identical rate is reported, and tau falls after a parting.

`random:NAME` builds a Llama with random weights in the shape of NAME (llama3-8b, smollm2-135m,
tiny), fine for timings and exactness; prompts are random token ids. Writes OUT/verify.json and
OUT/verify.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import bench_report  # noqa: E402  (scripts/ is not a package)

from heads import load_base  # noqa: E402
from heads.export import remove_made  # noqa: E402
from heads.placement import usable_device  # noqa: E402
from inference import (  # noqa: E402
    Draft,
    Drafter,
    SpeculativeGenerator,
    plain_generation_config,
    tree_from_parents,
)
from inference.mask import (  # noqa: E402
    grouped_kv_attention,
    tree_attention_mask,
    tree_position_ids,
)
from train.console import warnings_as_lines  # noqa: E402

FORMAT = "headstart-bench-verify-1"
SHAPES = {  # Llama configs for random:NAME (public configs' sizes)
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
}


class OracleDrafter(Drafter):
    """Knows the greedy continuation `truth` (prompt + output ids) and proposes a tree of depth
    `depth` in which each level holds `width - 1` wrong siblings, then the right token."""

    def __init__(self, truth: list[int], depth: int, width: int, vocab_size: int, device) -> None:
        self.truth, self.depth, self.width, self.vocab_size = truth, depth, width, vocab_size
        parents, parent = [-1], 0
        for _ in range(depth):
            parents += [parent] * width
            parent = len(parents) - 1  # the right token is the level's last node
        self.tree = tree_from_parents(parents, device=device)
        self.max_nodes = len(parents)
        self.device = device

    def propose(self, sequence: torch.Tensor, sampling) -> Draft:
        T = sequence.numel()
        right = self.truth[T : T + self.depth]
        right += [0] * (self.depth - len(right))  # past the known output: anything
        tokens = [int(sequence[-1])]
        for token in right:
            tokens += [(token + 1 + j) % self.vocab_size for j in range(self.width - 1)] + [token]
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return Draft(self.tree, ids, torch.zeros_like(ids, dtype=torch.bool))


def build_base(name: str, dtype: torch.dtype, device: torch.device, attn: str):
    """The frozen base: `random:SHAPE` weights, or any base `load_base` takes."""
    if not name.startswith("random:"):
        model, _ = load_base(name, dtype=dtype, device=device, attn_implementation=attn)
        # HF generate's truth from the base's own logits, as the verifier reads them
        model.generation_config = plain_generation_config(model)
        return model
    shape = name.removeprefix("random:")
    if shape not in SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; choose from {', '.join(SHAPES)}")
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192)
    config._attn_implementation = attn
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_tree_forwards(model, sizes: list[int], prefix_tokens: int, repeats: int) -> list[dict]:
    """Median seconds of one N-token tree forward (4-ary tree) over a cached prefix, per N."""
    device = model.device
    dtype = next(model.parameters()).dtype
    prefix = torch.randint(3, model.config.vocab_size, (1, prefix_tokens), device=device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix, cache=cache, use_cache=True)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    trees = {
        n: tree_from_parents([-1] + [(i - 1) // 4 for i in range(1, n)], device=device)
        for n in sizes
    }
    for rep in tqdm(range(repeats + 3), desc="tree cost", unit="round"):
        for n in sizes:  # interleaved, so noise hits every size alike
            tree = trees[n]
            tokens = torch.randint(3, model.config.vocab_size, (1, n), device=device)
            mask = positions = None
            if n > 1:
                mask = tree_attention_mask(tree, prefix_tokens, dtype)
                positions = tree_position_ids(tree, prefix_tokens)
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad(), grouped_kv_attention(device):  # as the decode loop's
                model(tokens, attention_mask=mask, position_ids=positions, cache=cache)
            _sync(device)
            if rep >= 3:  # the first rounds warm up kernels and allocators
                times[n].append(time.perf_counter() - t0)
            cache.crop(-n)  # back to the prefix (transformers 5: crop(-n) drops n tokens)
    one = statistics.median(times[1])
    return [
        {"nodes": n, "ms": 1000 * statistics.median(t), "vs_one_node": statistics.median(t) / one}
        for n, t in times.items()
    ]


def measure_parting(
    model, truth: torch.Tensor, ours: torch.Tensor, prompt_len: int
) -> tuple[float, float]:
    """Where our greedy output first parts from HF's: the base's logit gap between the two
    tokens there, and the median gap between its best two tokens over HF's output (how close
    a typical step is to a tie). A parting with a gap far above rounding is a bug."""
    t = int((ours != truth).nonzero()[0])
    with torch.no_grad():
        logits = model(truth[None]).logits[0].float()  # (T, V)
    gap = (logits[t - 1, truth[t]] - logits[t - 1, ours[t]]).abs().item()
    top2 = logits[prompt_len - 1 : -1].topk(2, dim=-1).values  # (new tokens, 2)
    return gap, (top2[:, 0] - top2[:, 1]).median().item()


def generate_with_oracle(model, ids, truth: list[int], shape, max_new_tokens: int):
    """Our greedy generation of `ids` with an OracleDrafter of `shape` (depth, width)."""
    oracle = OracleDrafter(truth, *shape, model.config.vocab_size, model.device)
    return SpeculativeGenerator(model, oracle, adaptive=False).generate(
        ids, max_new_tokens=max_new_tokens, eos_token_id=[]
    )


def time_decode_loop(
    model, shapes, prompts: int, prompt_tokens: int, max_new_tokens: int, seed: int
):
    """Per shape (D, W): median tokens/s, speedup vs HF greedy, tokens per step, identical
    rate, and the logit gaps where outputs parted (`measure_parting`)."""
    device = model.device
    model.generation_config.eos_token_id = None  # every run makes max_new_tokens tokens
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(seed)
    rows = {s: {"tps": [], "speedup": [], "tau": [], "identical": 0, "gaps": []} for s in shapes}
    typical_gaps = []
    hf_tps = []
    # Untimed, once per shape: the first forward of each tree size picks and loads its kernels
    # (on an H200 the first 61-node run was ~20% slower per step than later ones).
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_tokens), device=device)
    with torch.no_grad():
        truth = model.generate(ids, max_new_tokens=16, do_sample=False)[0].tolist()
    for shape in shapes:
        generate_with_oracle(model, ids, truth, shape, 16)
    for p in tqdm(range(prompts), desc="loop", unit="prompt"):
        ids = torch.randint(3, model.config.vocab_size, (1, prompt_tokens), generator=gen)
        ids = ids.to(device)
        with torch.no_grad():  # untimed: the truth the oracle follows, and a warm-up
            truth = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0]
        methods = [None, *shapes]
        methods = methods[p % len(methods) :] + methods[: p % len(methods)]
        seconds: dict = {}
        for m in methods:
            _sync(device)
            t0 = time.perf_counter()
            if m is None:
                with torch.no_grad():
                    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0]
            else:
                result = generate_with_oracle(model, ids, truth.tolist(), m, max_new_tokens)
                out = result.sequences[0]
            _sync(device)
            seconds[m] = time.perf_counter() - t0
            if m is not None:
                rows[m]["tau"].append(result.mean_accepted_length)
                if torch.equal(out, truth):
                    rows[m]["identical"] += 1
                else:
                    gap, typical = measure_parting(model, truth, out, prompt_tokens)
                    rows[m]["gaps"].append(gap)
                    typical_gaps.append(typical)
        hf_tps.append(max_new_tokens / seconds[None])
        for s in shapes:
            rows[s]["tps"].append(max_new_tokens / seconds[s])
            rows[s]["speedup"].append(seconds[None] / seconds[s])
    table = [{"method": "HF generate", "tokens_per_s": statistics.median(hf_tps)}]
    for (depth, width), r in rows.items():
        table.append(
            {
                "method": "plain decoding (our loop)" if depth == 0 else f"oracle {depth}x{width}",
                "depth": depth,
                "width": width,
                "nodes": 1 + depth * width,
                "tokens_per_s": statistics.median(r["tps"]),
                "speedup": statistics.median(r["speedup"]),
                "tau": statistics.median(r["tau"]),
                "identical": r["identical"] / prompts,
                "parting_gaps": r["gaps"],
            }
        )
    if typical_gaps:
        table[0]["median_top2_gap"] = statistics.median(typical_gaps)
    return table


def render_markdown(results: dict) -> str:
    lines = [
        f"# Tree verification: {results['base']}, {results['dtype']}, {results['device_name']}",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Tree forward over a {results['prefix_tokens']}-token cached prefix "
        f"(median of {results['repeats']}):",
        "",
        "| nodes | ms | vs 1 node |",
        "| ---: | ---: | ---: |",
    ]
    lines += [
        f"| {c['nodes']} | {c['ms']:.2f} | {c['vs_one_node']:.2f}x |" for c in results["cost"]
    ]
    lines += [
        "",
        f"Decode loop, {results['prompts']} random prompts of {results['prompt_tokens']} tokens, "
        f"{results['max_new_tokens']} new tokens, greedy, medians over prompts; the oracle's "
        "tau is D + 1 by construction:",
        "",
        "| method | nodes | tokens/s | speedup vs HF | tau | identical | gap at partings |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results["loop"]:
        if "speedup" not in r:
            lines.append(f"| {r['method']} | 1 | {r['tokens_per_s']:.1f} | 1.00x | 1.00 | | |")
            continue
        gaps = ", ".join(f"{g:.3g}" for g in r["parting_gaps"])
        lines.append(
            f"| {r['method']} | {r['nodes']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x "
            f"| {r['tau']:.2f} | {100 * r['identical']:.0f}% | {gaps} |"
        )
    if "median_top2_gap" in results["loop"][0]:
        lines += [
            "",
            "Gap at partings: the base's logit difference between HF's token and ours where the "
            "outputs first differ; for scale, the median gap between the base's best two tokens "
            f"over those outputs is {results['loop'][0]['median_top2_gap']:.3g}.",
        ]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        depth, _, width = item.partition("x")
        if not (depth.isdigit() and width.isdigit()) or int(width) < 1:
            raise argparse.ArgumentTypeError(f"shape {item!r}: want DEPTHxWIDTH, e.g. 4x1")
        shapes.append((int(depth), int(width)))
    return list(dict.fromkeys(shapes))  # a shape given twice is timed once


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--base", default="smollm2-135m-instruct", help="load_base name/path, or random:SHAPE")
    add("--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on GPU, else fp32")
    add("--device", default=None, help="default: cuda when available, else cpu")
    add("--attn", choices=("sdpa", "eager"), default="sdpa")
    add("--prefix-tokens", type=int, default=512)
    add("--sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128], help="tree sizes to time")
    add("--repeats", type=int, default=20, help="timed forwards per tree size")
    add("--shapes", type=_shapes, default=_shapes("0x1,2x1,4x1,4x4,6x10"), help="DxW oracles")
    add("--prompts", type=int, default=4)
    add("--prompt-tokens", type=int, default=64)
    add("--max-new-tokens", type=int, default=128)
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--out", default="runs/bench-verify")
    args = parser.parse_args(argv)
    counts = (args.repeats, args.prompts, args.prompt_tokens, args.prefix_tokens)
    if min(args.sizes, default=0) < 1 or min(*counts, args.max_new_tokens) < 1:
        parser.error(
            "--sizes, --repeats, --prompts, --prompt-tokens, --prefix-tokens and "
            "--max-new-tokens must be >= 1"
        )
    if 1 not in args.sizes:
        parser.error("--sizes must include 1: the other sizes' costs are given relative to it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = shlex.join(
        ["python", "scripts/bench_verify.py", *(sys.argv[1:] if argv is None else argv)]
    )
    made: list[Path] = []
    try:
        device = usable_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
            args.dtype or ("bf16" if device.type == "cuda" else "fp32")
        ]
        out, made = bench_report.make_out(args.out)
        model = build_base(args.base, dtype, device, args.attn)
        positions = model.config.max_position_embeddings
        for need, what in (
            (args.prefix_tokens + max(args.sizes), "--prefix-tokens plus the largest of --sizes"),
            (  # the largest oracle tree (and its root) still fits at the last step
                args.prompt_tokens + args.max_new_tokens + max(d * w for d, w in args.shapes) + 1,
                "--prompt-tokens plus --max-new-tokens plus the largest tree of --shapes",
            ),
        ):
            if need > positions:
                raise ValueError(
                    f"{what} ({need}) pass the base's context of {positions} positions; lower them"
                )
    except (OSError, ValueError) as e:
        remove_made(made)
        print(f"bench_verify failed: {e}", file=sys.stderr)
        return 2
    results = {
        "format": FORMAT,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": bench_report.machine_info(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "base": args.base,
        "dtype": str(dtype).removeprefix("torch."),
        "attn": args.attn,
        "prefix_tokens": args.prefix_tokens,
        "repeats": args.repeats,
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "cost": time_tree_forwards(model, args.sizes, args.prefix_tokens, args.repeats),
        "loop": time_decode_loop(
            model, args.shapes, args.prompts, args.prompt_tokens, args.max_new_tokens, args.seed
        ),
    }
    (out / "verify.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    text = render_markdown(results)
    (out / "verify.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out / 'verify.json'} and {out / 'verify.md'}")
    return 0


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        raise SystemExit(main())
