"""Chat with a base model that trained heads decode faster: each answer streams as its tokens
are verified, and a line after it gives the tokens, tokens/s and tau (tokens per verify step).
With --compare, HF greedy `generate` answers the same conversation too, timed, and the line adds
the speedup and whether the two answers are the same token for token.

    python scripts/chat.py --heads runs/smollm2-eagle/heads --lookup-corpus runs/smollm2-distill
    echo "Write a haiku about rain." | python scripts/chat.py --heads HEADS --compare

Without --heads the n-gram drafter (prompt lookup) drafts. Lines typed are user turns; `/reset`
starts a new conversation, `/quit` (or end of input, Ctrl-D) leaves; Ctrl-C stops an answer (or
its HF comparison), and at the prompt leaves.
The chat template and system prompt should be the ones the heads were trained with (the
recipe's data.chat_template and data.system_prompt; the tokenizer's own by default): heads whose
recipe set them record them in their config.json, --as-trained takes them from there, and chat
says when it is given others.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import as_trained  # noqa: E402
from bench import prompt_ids  # noqa: E402  (scripts/ is not a package)
from bench_methods import build_lookup_table, hf_runner, stop_token_ids  # noqa: E402

from heads import load_base, load_heads  # noqa: E402
from heads.base import input_device  # noqa: E402
from heads.checkpoint import resolve_folder  # noqa: E402
from heads.lora import base_as_served  # noqa: E402
from inference import NgramDrafter, SpeculativeGenerator  # noqa: E402
from train.console import warnings_as_lines  # noqa: E402
from train.data import ChatTemplateError, resolve_chat_template  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--base", default="smollm2-135m-instruct", help="HF id, local folder, .gguf or the embedded"
    )
    add("--heads", nargs="*", default=[], help="heads folders or Hub ids (several: their union)")
    add(
        "--lookup",
        action="store_true",
        help="n-gram prompt lookup beside the heads (always on without --heads)",
    )
    add(
        "--lookup-corpus",
        default=None,
        metavar="PATH",
        help="the lookup also reads these answers (a distill output folder); implies --lookup",
    )
    add("--max-new-tokens", type=int, default=512, help="per answer (default 512)")
    add("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    add("--top-p", type=float, default=1.0)
    add("--top-k", type=int, default=0)
    add(
        "--seed",
        type=int,
        default=0,
        help="of the first answer (default 0); each answer takes the next",
    )
    add("--system-prompt", default=None, metavar="TEXT", help="the conversation's system turn")
    add("--chat-template", default=None, metavar="TEMPLATE", help="Jinja string or .jinja file")
    add("--as-trained", action="store_true", help=as_trained.HELP)
    add("--compare", action="store_true", help="time HF greedy generate on every turn too")
    add(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the base's (auto: fp32 on a CPU, bf16 on a GPU, where greedy answers can part "
        "from HF's at near-ties; float32 for token-for-token identity)",
    )
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1 or args.top_k < 0:
        parser.error("need --temperature >= 0 (0: greedy), 0 < --top-p <= 1 and --top-k >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.compare and args.temperature > 0:
        parser.error("--compare times greedy decoding: leave --temperature at 0")
    as_trained.check_flag(parser, args)
    return args


def build_generator(
    args: argparse.Namespace, base, tokenizer, folders=None
) -> SpeculativeGenerator:
    """The heads of --heads (each loaded against `base`; from `folders`, where main has found
    them already), with the n-gram lookup when asked."""
    drafters = [load_heads(where, base=base) for where in folders or args.heads]
    if args.lookup or args.lookup_corpus or not drafters:
        corpus = None
        if args.lookup_corpus:  # an empty table is refused, as bench.py does
            corpus = build_lookup_table(args, tokenizer, stop_token_ids(base, tokenizer))
        drafters.append(NgramDrafter(corpus=corpus))
    return SpeculativeGenerator(base, drafters[0] if len(drafters) == 1 else drafters)


def answer(gen: SpeculativeGenerator, ids: torch.Tensor, args, tokenizer, eos, seed: int):
    """Stream one answer to stdout; returns (its token ids, seconds, tokens per verify step)."""
    stats: dict = {}
    new: list[int] = []
    shown = ""
    start = time.perf_counter()
    for step in gen.stream(
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=seed,
        eos_token_id=eos,
        stats=stats,
    ):
        new += step
        text = tokenizer.decode(new, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a character whose bytes are not all decoded yet
            print(text[len(shown) :], end="", flush=True)
            shown = text
    seconds = time.perf_counter() - start
    print(tokenizer.decode(new, skip_special_tokens=True)[len(shown) :], flush=True)
    steps = stats["accepted_lengths"]
    tau = sum(steps) / len(steps) if steps else 1.0
    return new, seconds, tau


def read_turns(prompt: str):
    """User turns: lines typed at a terminal (with a prompt), else the lines of stdin."""
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(prompt) if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not interactive and not line:
            return
        yield line.strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 come as lone surrogates
        sys.stdin.reconfigure(errors="surrogateescape")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.temperature == 0 and (args.top_p < 1 or args.top_k):
        print(
            "note: --top-p and --top-k shape sampling (--temperature > 0): greedy here",
            file=sys.stderr,
        )
    try:
        # a missing folder or an unreachable Hub id: before the base
        folders = {name: resolve_folder(name) for name in args.heads}
        if args.as_trained and (taken := as_trained.take_as_trained(args, list(folders.values()))):
            print(taken, file=sys.stderr)
        base, tokenizer = load_base(args.base, device=args.device, dtype=args.dtype)
        base, _ = base_as_served(base, folders.values(), "chat")  # Medusa-2: adapter merged
        # the template is needed for every turn: a tokenizer without one is said at once
        tokenizer.chat_template = resolve_chat_template(tokenizer, args.chat_template)
        gen = build_generator(args, base, tokenizer, list(folders.values()))
        for name, folder in folders.items():
            as_trained.note_training_prompts(name, folder, args, tokenizer.chat_template)
    except (ValueError, OSError) as e:  # a missing folder, heads of another base, no template
        print(f"chat failed: {e}", file=sys.stderr)
        return 2
    context = base.config.max_position_embeddings
    if args.max_new_tokens >= context:
        print(
            f"chat failed: --max-new-tokens {args.max_new_tokens} leaves no room for a message "
            f"in the base's context of {context} positions",
            file=sys.stderr,
        )
        return 2
    device = input_device(base)
    eos = stop_token_ids(base, tokenizer)
    greedy = dict(max_new_tokens=args.max_new_tokens, eos=eos, temperature=0.0, top_p=1.0)
    hf_greedy = hf_runner(base, tokenizer.pad_token_id, greedy, {})
    system = (  # "" too is a system turn, as training gives it
        [{"role": "system", "content": args.system_prompt}]
        if args.system_prompt is not None
        else []
    )
    messages = list(system)
    answered = 0
    print("/reset: a new conversation; /quit or Ctrl-D: leave", file=sys.stderr)
    for line in read_turns("> "):
        if line == "/quit":
            break
        if line == "/reset":
            messages = list(system)
            print("(a new conversation)", file=sys.stderr)
            continue
        if not line:
            continue
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # stdin's bytes were not UTF-8 (a Latin-1 file, say)
            print(
                "(not sent: the line is not UTF-8 text; convert the input to UTF-8, e.g. "
                "iconv -t utf-8, or set the terminal's encoding to UTF-8)",
                file=sys.stderr,
            )
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = prompt_ids(messages, tokenizer).to(device)  # (1, T)
        except ChatTemplateError as e:  # a template that raises on these messages
            print(f"chat failed: {e}", file=sys.stderr)
            return 2
        if ids.shape[1] + args.max_new_tokens > context:
            alone = prompt_ids([*system, messages[-1]], tokenizer).shape[1]
            if alone + args.max_new_tokens > context:  # /reset would not help
                what = f"this message alone has {alone} tokens"
                fix = "shorten it" if alone >= context else "shorten it or lower --max-new-tokens"
            else:
                what = f"the conversation has {ids.shape[1]} tokens"
                fix = "/reset to start anew, then send it again"
            print(
                f"(not sent: {what}, with --max-new-tokens {args.max_new_tokens} past the "
                f"base's context of {context} positions; {fix})",
                file=sys.stderr,
            )
            messages.pop()
            continue
        try:
            new, seconds, tau = answer(gen, ids, args, tokenizer, eos, args.seed + answered)
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the conversation
            print("\n(answer stopped and left out of the conversation)", file=sys.stderr)
            messages.pop()
            continue
        answered += 1
        messages.append(
            {"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)}
        )
        stats = (
            f"[{len(new)} tokens in {seconds:.1f} s: {len(new) / seconds:.1f} tok/s, tau {tau:.2f}"
        )
        if len(new) >= args.max_new_tokens and new[-1] not in eos:  # the answer had not ended
            stats += f"; cut at --max-new-tokens {args.max_new_tokens}"
        if args.compare:
            try:
                start = time.perf_counter()
                reference = hf_greedy(ids, 0).new_ids
                hf_seconds = time.perf_counter() - start
            except KeyboardInterrupt:  # the answer stands; only its comparison is left out
                stats += "; HF greedy stopped"
            else:
                same = "identical" if reference == new else "DIFFERENT from HF's"
                stats += (
                    f"; HF greedy {len(reference) / hf_seconds:.1f} tok/s, "
                    f"{(len(new) / seconds) / (len(reference) / hf_seconds):.2f}x, {same}"
                )
        print(stats + "]", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    with warnings_as_lines():  # a library warning as one line
        raise SystemExit(main())
