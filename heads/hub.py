"""Hugging Face Hub: model cards and uploads (downloads live in `checkpoint.resolve_folder`)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from heads.base import EMBEDDED_GGUF, EMBEDDED_NAME, hub_offline, is_repo_id


def headstart_card(card: Path) -> bool:
    """Whether a model card is one headstart wrote (not one written by hand)."""
    return "library_name: headstart" in card.read_text()


def hand_written_card(folder: Path, source: Path | None, config) -> str | None:
    """The model card written by hand (not by headstart) that heads saved to `folder` keep:
    the folder's own where it holds heads of the same kind for the same base (not an earlier
    run's other heads), else the one of the folder `source` they were loaded from."""
    from heads.config import same_base

    def by_hand(where: Path | None) -> str | None:
        card = None if where is None else Path(where) / "README.md"
        if card is None or not card.is_file() or headstart_card(card):
            return None
        return card.read_text()

    try:
        there = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        there = None
    mine = config.to_dict()
    same = (
        isinstance(there, dict)
        and all(there.get(k) == mine.get(k) for k in ("model_type", "architectures"))
        and same_base(str(there.get("base_model_name_or_path")), config.base_model_name_or_path)
    )
    return (by_hand(folder) if same else None) or by_hand(source)


def _usage(config, repo_id: str, sglang_layout: bool = False) -> tuple[str, str, str, str]:
    """(head kind, vLLM method, vLLM lines, SGLang lines) for a heads config; an engine that would not
    compute the heads as headstart does gets the reason instead of its lines (`engine_refusal`)."""
    from heads.eagle_config import engine_refusal

    base = config.base_model_name_or_path or "BASE"
    medusa = getattr(config, "model_type", "") == "medusa"
    if medusa:
        kind = (
            f"Medusa heads ({config.num_heads} heads x {config.num_hidden_layers} residual layers)"
        )
        method, tokens = "medusa", config.num_heads
        refusals = {
            "vllm": None,
            "sglang": "SGLang does not serve Medusa heads; use vLLM or headstart.",
        }
    else:
        kind = f"EAGLE-{config.version} draft layer"
        method, tokens = ("eagle3" if config.version == 3 else "eagle"), 5
        lead = {"vllm": "vLLM cannot serve these heads", "sglang": "SGLang cannot serve this draft"}
        refusals = {e: engine_refusal(config, e) for e in lead}
        refusals = {e: r and f"# {lead[e]}: {r}" for e, r in refusals.items()}
    served = base
    if getattr(config, "base_lora", ""):  # Medusa-2: the base with the heads' adapter merged
        served = "BASE_WITH_LORA_MERGED"
    vllm_path, vllm_export = repo_id, ""
    if sglang_layout:  # the SGLang export of an EAGLE-1 layer: vLLM reads the native layout
        vllm_path = "draft-vllm"
        vllm_export = (
            "# this folder is in SGLang's EAGLE-1 layout; vLLM reads headstart's: export first\n"
            "from heads.export import export_heads  # headstart\n"
            f'export_heads("{repo_id}", "vllm", "draft-vllm")\n'
        )
    vllm = refusals["vllm"] or (
        vllm_export + "from vllm import LLM\n"
        f'llm = LLM(model="{served}",\n'
        f'          speculative_config={{"method": "{method}", "model": "{vllm_path}", '
        f'"num_speculative_tokens": {tokens}}})'
    )
    if refusals["sglang"]:
        return kind, method, vllm, refusals["sglang"]
    path, sglang = repo_id, ""
    if config.version == 1 and not sglang_layout:
        path = "draft-sglang"
        sglang = (
            "# SGLang builds EAGLE-1 under its own architecture name, with an fc bias: "
            "export first\n"
            'python -c "from heads.export import export_heads; '
            f"export_heads('{repo_id}', 'sglang', 'draft-sglang')\"   # headstart\n"
        )
    sglang += (
        "# --dtype sets the draft's too: from its config alone SGLang would run a float32 draft "
        "in float16\n"
        f"python -m sglang.launch_server --model {base} --dtype bfloat16 --speculative-algorithm "
        f"{'EAGLE3' if config.version == 3 else 'EAGLE'} --speculative-draft-model-path "
        f"{path} --speculative-num-steps 5 --speculative-eagle-topk 8 "
        "--speculative-num-draft-tokens 32"
    )
    return kind, method, vllm, sglang


def model_card(config, repo_id: str = "REPO", sglang_layout: bool = False) -> str:
    """A README.md for a heads folder: base model, head type, and how to use it
    (`sglang_layout`: the folder is an EAGLE-1 layer's SGLang export)."""
    kind, method, vllm, sglang = _usage(config, repo_id, sglang_layout)
    base = config.base_model_name_or_path or "BASE"
    tag = "medusa" if method == "medusa" else "eagle"
    lora = getattr(config, "base_lora", "")
    merge, adapted = "", ""
    if lora:  # Medusa-2: the heads read the base with its LoRA adapter merged
        merge = (
            "from peft import PeftModel\n"
            f'base = PeftModel.from_pretrained(base, "{repo_id}", subfolder="{lora}")'
            ".merge_and_unload()\n"
        )
        adapted = (
            f"\nMedusa-2: the base was fine-tuned with the LoRA adapter in `{lora}/` beside the "
            "heads,\nwhich read its hidden states: serve them on the base with that adapter "
            "merged (below;\nfor vLLM, `save_pretrained` the merged base and give its folder as "
            "`BASE_WITH_LORA_MERGED`).\n"
        )
    prompts = _training_prompts(config) + _training_gguf(config)
    # The Hub refuses a card whose base_model is no repo id (a local folder, a GGUF's name)
    local = not is_repo_id(base) or Path(base).expanduser().exists()
    header = "" if local else f"base_model: {base}\n"
    return f"""---
{header}library_name: headstart
tags:
- speculative-decoding
- {tag}
- headstart
---

# {kind} for {base}

Draft heads for lossless speculative decoding of `{base}` (hidden size {config.base_hidden_size},
vocabulary {config.base_vocab_size}, {config.base_hidden_layers} layers), trained with
[headstart](https://pypi.org/project/headstart/). The base model's outputs are unchanged: greedy
decoding is token-for-token identical and sampling keeps the base's distribution.
{adapted}{prompts}
## headstart

```python
from heads import load_base, load_heads
from inference import SpeculativeGenerator

base, tokenizer = load_base("{base}")
{merge}heads = load_heads("{repo_id}", base=base)
gen = SpeculativeGenerator(base, heads)
ids = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello!"}}],
                                    add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"]
out = gen.generate(ids, max_new_tokens=256)
print(tokenizer.decode(out.sequences[0]), out.mean_accepted_length)
```

## vLLM

```python
{vllm}
```

## SGLang

```
{sglang}
```
"""


def _training_prompts(config) -> str:
    """The card's lines on the system prompt and chat template the heads learned under, where
    their training recipe set them (config.json's training_* keys)."""
    system = getattr(config, "training_system_prompt", None)
    template = getattr(config, "training_chat_template", None)
    said = (
        [f"the system prompt {json.dumps(system, ensure_ascii=False)}"]
        if system is not None
        else []
    )
    if template is not None:
        said.append("the chat template in config.json's `training_chat_template`")
    if not said:
        return ""
    return (
        f"\nThe heads learned from answers the base wrote under {' and '.join(said)}: they draft "
        "best\nunder the same (headstart's `scripts/chat.py` and `scripts/bench.py` take them "
        "with\n`--as-trained`).\n"
    )


def _training_gguf(config) -> str:
    """The card's line on the quantised weights the heads learned on (config.json's
    training_base_gguf), where the base was read from a GGUF file."""
    gguf = getattr(config, "training_base_gguf", None)
    if gguf is None:
        return ""
    embedded = (
        f' (headstart\'s `load_base("{EMBEDDED_NAME}")` loads\nthat file)'
        if gguf == EMBEDDED_GGUF
        else ""
    )
    return (
        f"\nThe heads learned on the base's weights as the GGUF file `{gguf}` holds them,\n"
        f"dequantised{embedded}: on other weights of this model (full precision, another\n"
        "quantisation) they draft a little differently, and the output is still the base's own.\n"
    )


class HubPushError(OSError):
    """The Hub would not take the heads (no network, no token, no write access)."""


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload headstart heads",
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Create `repo_id` if needed and upload a saved heads folder; returns the commit URL (with
    `create_pr`, the pull request's). `revision`: a branch, made from main when new, as
    transformers' push_to_hub makes it.

    The card uploaded names the repo it lives in; the folder's own keeps its placeholders, so
    the folder can be pushed to another repo too. Weights files at the repo's top that the
    folder lacks (a sharded or TGI-layout upload before) are deleted in the same commit: loaders
    read every top-level .safetensors file (the Hub's history keeps them)."""
    from huggingface_hub import HfApi

    folder = Path(folder).resolve()  # "." has no name and is its own parent
    api = HfApi(token=token)
    # A staged copy of hard links (same filesystem: no weights copied) with the card filled in.
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.push.") as tmp:
        staged = Path(tmp) / folder.name
        shutil.copytree(folder, staged, copy_function=_link_or_copy)
        card = staged / "README.md"
        if card.is_file():
            text = card.read_text()
            card.unlink()  # a link to the folder's own card: replaced, not written through
            card.write_text(
                text.replace('"REPO"', f'"{repo_id}"')
                .replace("path REPO", f"path {repo_id}")
                .replace("export_heads('REPO'", f"export_heads('{repo_id}'")
            )
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision is not None and not revision.startswith("refs/pr/"):
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            listed = api.list_repo_files(repo_id, revision=revision)
            info = api.upload_folder(
                folder_path=str(staged),
                repo_id=repo_id,
                commit_message=commit_message,
                revision=revision,
                create_pr=create_pr,
                delete_patterns=stale_weights(listed, staged) or None,
            )
        except Exception as e:  # network, auth, a name taken: huggingface_hub's and httpx's
            said = str(e).rstrip(". ")
            if not hub_offline():
                hint = "Check the network and your token (`hf auth login`, HF_TOKEN or token=)"
            elif "HF_HUB_OFFLINE" in said:  # huggingface_hub's own message says to unset it
                hint = ""
            else:
                hint = "HF_HUB_OFFLINE is set: unset it to push"
            raise HubPushError(
                f"could not push to the Hub repo {repo_id}: {type(e).__name__}: {said}. {hint}".strip()
            ) from e
    if create_pr and getattr(info, "pr_url", None):
        return str(info.pr_url)
    return str(getattr(info, "commit_url", info))


def stale_weights(listed: Iterable[str], folder: Path) -> list[str]:
    """Of a repo's files, the top-level weights (and shard index) that `folder` has not, as
    exact `delete_patterns` of an upload."""
    weights = (".safetensors", ".safetensors.index.json")
    return [
        glob.escape(name)
        for name in listed
        if "/" not in name and name.endswith(weights) and not (folder / name).exists()
    ]


def push_refused() -> str | None:
    """Why a push would fail before it is tried (offline mode, no token), or None: a training
    run with hub.repo_id asks before it starts, not after hours of work."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set: unset it to push"
    from huggingface_hub import get_token

    if get_token() is None:
        return "no Hugging Face token: log in with `hf auth login` or set HF_TOKEN"
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
