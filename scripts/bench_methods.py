"""The decoding methods `scripts/bench.py` measures, behind one call signature.

`baseline` and `hf-lookup` are Hugging Face `generate` (plain, and with prompt lookup); the
others are `inference.SpeculativeGenerator` with the n-gram drafter, a Medusa / EAGLE heads
folder, or a small draft model. Every method gets the same prompt ids, max_new_tokens, EOS ids
and sampling settings; `Method.generate(input_ids (1,T), seed) -> Run`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from heads import EagleDraft, MedusaHeads, load_base, load_heads
from heads.lora import base_as_served
from inference import (
    NgramDrafter,
    NgramTable,
    SpeculativeGenerator,
    make_drafter,
    plain_generation,
    plain_generation_config,
)
from inference.tree import PRESETS
from train.answering import eos_token_ids
from train.data import resolve_chat_template

METHODS = (
    "baseline",
    "hf-lookup",
    "ngram",
    "ngram+corpus",
    "heads",
    "heads+ngram",
    "heads+ngram+corpus",
    "draft",
)
CORPUS_METHODS = ("ngram+corpus", "heads+ngram+corpus")


class BenchError(ValueError):
    """Bad benchmark input: unknown method, missing option, mismatched heads or draft model."""


@dataclass
class Run:
    """One generation: the new token ids and, for our generator, its per-step statistics."""

    new_ids: list[int]
    accepted_lengths: list[int] | None = None  # None for HF methods (not observable)
    timings: dict[str, float] | None = None  # seconds: base, draft, other, total
    tree_sizes: list[int] | None = None  # nodes verified per step, the root included


@dataclass
class Method:
    name: str  # unique; a heads method is named after its folder
    kind: str  # baseline | hf-lookup | ngram | medusa | eagle1 | eagle3 | draft | medusa+ngram ...
    generate: Callable[..., Run]  # (input_ids (1,T), seed, max_new_tokens=None) -> Run
    device: torch.device
    greedy: bool
    options: dict = field(default_factory=dict)
    draft_depth: int | None = None  # most drafted tokens one step can accept
    path: str | None = None  # heads folder or draft model

    def info(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "path": self.path,
            "options": self.options,
            "draft_depth": self.draft_depth,
        }


def parse_methods(
    spec: str | None,
    heads: list[str],
    draft_model: str | None,
    corpus: str | None = None,
    draft_shape: bool = False,
) -> list[str]:
    """Method names to run, baseline first. `spec=None` means every method the options allow
    (each heads folder alone, not with the lookup). `draft_shape`: --draft-tokens or
    --draft-tree was given."""
    if spec is None:
        names = [
            n
            for n in METHODS
            if (n != "heads" or heads)
            and n not in ("heads+ngram", "heads+ngram+corpus")
            and (n != "draft" or draft_model)
            and (n != "ngram+corpus" or corpus)
        ]
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise BenchError(f"unknown methods {unknown}; valid: {', '.join(METHODS)}")
    for name in ("heads", "heads+ngram", "heads+ngram+corpus"):
        if name in names and not heads:
            raise BenchError(f"method '{name}' needs --heads DIR [DIR ...]")
    if heads and not {"heads", "heads+ngram", "heads+ngram+corpus"} & set(names):
        raise BenchError(
            "--heads given but no heads method ('heads', 'heads+ngram', ...) in --methods"
        )
    seen: dict[Path, str] = {}
    for folder in heads or ():
        key = Path(folder).resolve()
        if key in seen:
            raise BenchError(
                f"--heads names one folder twice ({seen[key]}, {folder}): give it once"
            )
        seen[key] = folder
    for name in CORPUS_METHODS:
        if name in names and not corpus:
            raise BenchError(
                f"method '{name}' needs --lookup-corpus (e.g. the distill output folder)"
            )
    if corpus and not set(CORPUS_METHODS) & set(names):
        raise BenchError(
            f"--lookup-corpus given but none of {', '.join(CORPUS_METHODS)} is in --methods"
        )
    if "draft" in names and not draft_model:
        raise BenchError("method 'draft' needs --draft-model")
    if draft_model and "draft" not in names:
        raise BenchError("--draft-model given but 'draft' is not in --methods")
    if draft_shape and "draft" not in names:
        raise BenchError(
            "--draft-tokens / --draft-tree shape the 'draft' method: give --draft-model too"
        )
    # The baseline is the reference for every speedup and identity check: always run, first.
    return ["baseline"] + [n for n in dict.fromkeys(names) if n != "baseline"]


def build_methods(names: list[str], args: argparse.Namespace):
    """Load the base (and heads, draft model); returns (base, tokenizer, methods)."""
    base, tokenizer = load_base(args.base, **load_options(args))
    # Medusa-2 heads are served on the base with their adapter merged: every method runs on
    # it, the baseline too (the model being made faster); results.json's settings name it.
    args.base_adapter_of = None
    if any(name.startswith("heads") for name in names):
        try:
            base, args.base_adapter_of = base_as_served(base, args.heads, "bench")
        except (ValueError, OSError) as e:
            raise BenchError(f"--heads: {e}") from e
    if getattr(args, "chat_template", None):  # every prompt is rendered with it
        tokenizer.chat_template = resolve_chat_template(tokenizer, args.chat_template)
    device = next(base.parameters()).device
    eos = stop_token_ids(base, tokenizer)
    settings = dict(
        max_new_tokens=args.max_new_tokens,
        eos=eos,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    greedy = args.temperature == 0
    corpus = build_lookup_table(args, tokenizer, eos) if set(CORPUS_METHODS) & set(names) else None
    methods: list[Method] = []
    for name in names:
        if name in ("baseline", "hf-lookup"):
            extra = {"prompt_lookup_num_tokens": args.lookup_tokens} if name == "hf-lookup" else {}
            run = hf_runner(base, tokenizer.pad_token_id, settings, extra)
            methods.append(Method(name, name, run, device, greedy, extra))
        elif name in ("ngram", "ngram+corpus"):
            with_corpus = corpus if name == "ngram+corpus" else None
            drafter = NgramDrafter(num_tokens=args.lookup_tokens, corpus=with_corpus)
            gen = SpeculativeGenerator(base, drafter)  # fixed --lookup-tokens, as before
            options = {"num_tokens": drafter.num_tokens, "max_ngram": drafter.max_ngram}
            if with_corpus is not None:
                options |= _corpus_info(args.lookup_corpus, with_corpus)
            run = _spec_runner(gen, settings)
            methods.append(Method(name, "ngram", run, device, greedy, options, args.lookup_tokens))
        elif name in ("heads", "heads+ngram", "heads+ngram+corpus"):
            taken = set(METHODS) | {m.name for m in methods}
            for folder, run_name in heads_names(args.heads).items():
                lookup_corpus = corpus if name == "heads+ngram+corpus" else None
                method = _heads_method(
                    folder, run_name, base, args, settings, greedy, name != "heads", lookup_corpus
                )
                stem, n = method.name, 1
                while method.name in taken:
                    n += 1
                    method.name = f"{stem}-{n}"
                taken.add(method.name)
                methods.append(method)
        elif name == "draft":
            model = _load_draft_model(args.draft_model, base, tokenizer, args)
            if args.draft_tree is None:
                flag = "--draft-tokens"  # the drafter's default chain when not given
                shape = {} if args.draft_tokens is None else {"num_tokens": args.draft_tokens}
            else:
                flag = "--draft-tree"
                shape = {"choices": _tree_choices(args.draft_tree, flag)}
            try:
                drafter = make_drafter(base, model, **shape)
            except ValueError as e:
                raise BenchError(f"{flag}: {e}") from e
            gen = SpeculativeGenerator(base, drafter, adaptive=False)
            if drafter.static is None:
                options, depth = {"num_tokens": drafter.num_tokens}, drafter.num_tokens
            else:
                depth = drafter.static.tree.depth
                options = {"tree": args.draft_tree, "nodes": drafter.max_nodes, "depth": depth}
            run = _spec_runner(gen, settings)
            methods.append(
                Method(name, name, run, device, greedy, options, depth, args.draft_model)
            )
    _say_unused_tree_options(args, {m.kind for m in methods})
    return base, tokenizer, methods


def _say_unused_tree_options(args: argparse.Namespace, kinds: set[str]) -> None:
    """Say on stderr which tree options no method of this run reads (they change nothing)."""
    unused = []
    if args.tree is not None and not any(k.startswith("medusa") for k in kinds):
        unused.append("--tree (Medusa heads)")
    if _eagle_options(args) and not any(k.startswith("eagle") for k in kinds):
        unused.append("--eagle-* (EAGLE heads)")
    if unused:
        print(
            f"bench: {' and '.join(unused)} ignored: no method of this run drafts with those "
            "heads (--methods, --heads)",
            file=sys.stderr,
        )


def heads_names(folders: list[str]) -> dict[str, str]:
    """Method names of heads folders (or Hub ids): the training run's folder (OUTPUT of a local
    OUTPUT/heads, where training writes them; not "heads"), with as many folders above it as
    tell runs of one name apart (`x/a/heads` and `y/a/heads`: `x/a` and `y/a`)."""
    parts = {}
    for folder in folders:
        path = Path(folder).resolve()
        if path.name == "heads" and path.parent.name and Path(folder).is_dir():
            path = path.parent
        parts[folder] = path.parts[1:]  # the root's "/" is no folder's name
    depth = dict.fromkeys(parts, 1)
    while True:
        names = {f: "/".join(p[-depth[f] :]) for f, p in parts.items()}
        clash = [f for f in parts if list(names.values()).count(names[f]) > 1]
        longer = [f for f in clash if depth[f] < len(parts[f])]
        if not longer:
            return names
        for f in longer:
            depth[f] += 1


def _heads_method(
    folder: str,
    name: str,
    base,
    args,
    settings: dict,
    greedy: bool,
    with_ngram: bool = False,
    corpus: NgramTable | None = None,
) -> Method:
    """A heads folder's method; `with_ngram`: its drafter and the n-gram drafter (with the
    `corpus` table when given) together, the union of their trees (`inference.UnionDrafter`)."""
    try:
        heads = load_heads(folder, base=base)
    except (ValueError, OSError) as e:
        raise BenchError(f"--heads {folder}: {e}") from e
    if with_ngram:
        name += "+ngram" if corpus is None else "+ngram+corpus"
        return _union_method(name, folder, heads, base, args, settings, greedy, corpus)
    device = next(base.parameters()).device
    if isinstance(heads, MedusaHeads):
        K = heads.config.num_heads
        if args.tree is None:  # the generator's default: adaptive over its arms
            gen = SpeculativeGenerator(base, heads)
            options = {"tree": "adaptive", "arms": gen.arms}
            depth = max(_arm_depth(arm, K) for arm in gen.arms)
        else:
            choices = _tree_choices(args.tree)  # its own message for JSON that does not parse
            try:
                gen = SpeculativeGenerator(base, heads, choices=choices)
            except ValueError as e:
                raise BenchError(f"--tree for {folder}: {e}") from e
            tree = gen.drafter.tree
            options = {"tree": args.tree, "nodes": tree.num_nodes, "depth": tree.depth}
            depth = tree.depth
        # depth: the most drafted tokens a step can accept (accept_at_least's columns)
        run = _spec_runner(gen, settings)
        return Method(name, "medusa", run, device, greedy, options, depth, folder)
    assert isinstance(heads, EagleDraft)
    try:
        gen = SpeculativeGenerator(base, heads, **_eagle_options(args))
    except ValueError as e:
        raise BenchError(f"EAGLE options for {folder}: {e}") from e
    drafter = gen.drafter
    depth = drafter.depth
    options = {"top_k": drafter.top_k, "depth": drafter.depth, "total_tokens": drafter.total_tokens}
    if gen.arms:  # no --eagle-* setting: adaptive over the generator's arms, as it runs them
        options = {"tree": "adaptive", "arms": gen.arms}
        depth = max(_arm_depth(arm, drafter.depth) for arm in gen.arms)
    elif drafter.static is not None:  # a static tree: its size and depth
        options = {"nodes": drafter.max_nodes, "depth": drafter.depth}
    kind = f"eagle{heads.config.version}"
    return Method(name, kind, _spec_runner(gen, settings), device, greedy, options, depth, folder)


def _arm_depth(arm: dict | None, configured: int) -> int:
    """The most drafted tokens one step of an adaptive arm can accept (`configured`: the
    drafter's depth, for an arm that keeps it)."""
    if arm is None:
        return 0
    if "depth" in arm:
        return arm["depth"]
    choices = arm.get("choices")
    if isinstance(choices, str):  # a preset's name
        choices = PRESETS.get(choices)
    if isinstance(choices, list | tuple):
        return max((len(path) for path in choices), default=0)
    return configured


def _union_method(
    name, folder, heads, base, args, settings: dict, greedy: bool, corpus: NgramTable | None
) -> Method:
    """Heads plus n-gram lookup (`--lookup-tokens`, with `corpus` when given): adaptive over
    the union's arms, unless `--tree` / `--eagle-*` fix the heads' settings (then both always
    run)."""
    ngram = NgramDrafter(num_tokens=args.lookup_tokens, corpus=corpus)
    medusa = isinstance(heads, MedusaHeads)
    if medusa:
        kind = "medusa+ngram"
        fixed = {} if args.tree is None else {"choices": _tree_choices(args.tree)}
    else:
        kind, fixed = f"eagle{heads.config.version}+ngram", _eagle_options(args)
    try:
        primary = make_drafter(base, heads, **fixed)
        gen = SpeculativeGenerator(base, [primary, ngram], adaptive=not fixed)
    except ValueError as e:
        raise BenchError(f"{name}: {e}") from e
    options = {"ngram_tokens": args.lookup_tokens, **fixed, "arms": gen.arms or "fixed"}
    if corpus is not None:
        options |= _corpus_info(args.lookup_corpus, corpus)
    depth = max(heads.config.num_heads if medusa else primary.depth, args.lookup_tokens)
    run = _spec_runner(gen, settings)
    return Method(name, kind, run, next(base.parameters()).device, greedy, options, depth, folder)


def build_lookup_table(args: argparse.Namespace, tokenizer, eos: list[int]) -> NgramTable:
    """The n-gram table of `--lookup-corpus` (answers in JSONL: a distill output folder)."""
    print(f"building the n-gram table of {args.lookup_corpus} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        table = NgramTable.from_jsonl(args.lookup_corpus, tokenizer, eos[0] if eos else None)
    except (ValueError, OSError) as e:
        raise BenchError(f"--lookup-corpus: {e}") from e
    print(
        f"  {table.num_tokens:,} answer tokens, {table.num_contexts:,} contexts kept "
        f"({time.perf_counter() - start:.0f} s)",
        file=sys.stderr,
    )
    if table.num_contexts == 0:
        raise BenchError(
            f"--lookup-corpus: {args.lookup_corpus} holds {table.num_tokens} answer tokens but no "
            f"context seen {table.min_count}+ times: give it more answers (e.g. a larger "
            "data.limit in scripts/distill.py)"
        )
    return table


def _corpus_info(path: str, table: NgramTable) -> dict:
    """What results.json records about a lookup corpus."""
    return {"corpus": path, **{f"corpus_{k}": v for k, v in table.info().items()}}


def _eagle_options(args: argparse.Namespace) -> dict:
    """The EAGLE tree settings given on the command line (`--eagle-*`)."""
    given = dict(
        top_k=args.eagle_top_k, depth=args.eagle_depth, total_tokens=args.eagle_total_tokens
    )
    return {k: v for k, v in given.items() if v is not None}


def _tree_choices(tree: str, flag: str = "--tree"):
    """--tree (or --draft-tree) as a preset name or JSON choices."""
    if tree.lstrip().startswith("["):
        try:
            return [tuple(c) for c in json.loads(tree)]
        except (json.JSONDecodeError, TypeError) as e:
            raise BenchError(f"{flag}: not a JSON list of choices: {e}") from e
    return tree


def load_options(args: argparse.Namespace) -> dict:
    """load_base's device, dtype and attention from bench's options."""
    return dict(device=args.device, dtype=args.dtype, attn_implementation=args.attn)


def _load_draft_model(name: str, base, tokenizer, args: argparse.Namespace):
    """The draft LM, refused unless its vocabulary is the base's, token for token (its
    embedding may be padded to fewer rows: Qwen2.5-0.5B's 151,936 for Qwen2.5-72B's 152,064)."""
    # the base's device, and the dtype and attention asked for it
    model, draft_tokenizer = load_base(
        name, **{**load_options(args), "device": next(base.parameters()).device}
    )
    rows = model.config.vocab_size
    if not len(draft_tokenizer) <= rows <= base.config.vocab_size or (
        draft_tokenizer.get_vocab() != tokenizer.get_vocab()
    ):
        raise BenchError(
            f"--draft-model {name} does not share the base's tokenizer (vocab size "
            f"{model.config.vocab_size} / {len(draft_tokenizer)} tokens vs the base "
            f"{_model_name(base)}: {base.config.vocab_size} / {len(tokenizer)} tokens)"
        )
    return model


def _model_name(model) -> str:
    return getattr(model.config, "name_or_path", "") or type(model).__name__


def stop_token_ids(base, tokenizer) -> list[int]:
    """The base's EOS ids (its generation_config's, else its config's), then those that end
    distill's answers too (`eos_token_ids`: the tokenizer's, the chat template's end of turn)."""
    eos = getattr(base.generation_config, "eos_token_id", None)
    if eos is None:
        eos = base.config.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    more = eos_token_ids(tokenizer, base.generation_config, tokenizer.chat_template)
    return ids + [t for t in more if t not in ids]


def hf_runner(base, pad_token_id: int, settings: dict, extra: dict) -> Callable[..., Run]:
    """HF `generate` (greedy, or sampling as `settings` say; `extra`: its other arguments, e.g.
    prompt lookup) as a method's `run(input_ids, seed, max_new_tokens=None) -> Run`."""
    sample = settings["temperature"] > 0
    # Explicit values, so that a checkpoint's generation_config cannot change the distribution.
    sampling = dict(temperature=settings["temperature"], top_p=settings["top_p"], top_k=0)
    plain = plain_generation_config(base)

    def run(input_ids: torch.Tensor, seed: int, max_new_tokens: int | None = None) -> Run:
        if sample:
            torch.manual_seed(seed)
        with plain_generation(base, plain):  # the base's own logits, as the verifier reads them
            out = base.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens or settings["max_new_tokens"],
                do_sample=sample,
                **(sampling if sample else {}),
                eos_token_id=settings["eos"],
                pad_token_id=pad_token_id,
                **extra,
            )
        return Run(out[0, input_ids.shape[1] :].tolist())  # (new,)

    return run


def _spec_runner(gen: SpeculativeGenerator, settings: dict) -> Callable[..., Run]:
    def run(input_ids: torch.Tensor, seed: int, max_new_tokens: int | None = None) -> Run:
        out = gen.generate(
            input_ids,
            max_new_tokens=max_new_tokens or settings["max_new_tokens"],
            temperature=settings["temperature"],
            top_p=settings["top_p"],
            seed=seed,
            eos_token_id=settings["eos"],
        )
        new = out.sequences[0, input_ids.shape[1] :].tolist()
        return Run(new, out.accepted_lengths, out.timings, out.tree_sizes)

    run.generator = gen  # bench's warm-up forgets what its policy measured there
    return run
