"""Hugging Face Hub: model cards and uploads (downloads live in `checkpoint.resolve_folder`)."""

from __future__ import annotations

from pathlib import Path


def _usage(config) -> tuple[str, str, str, str]:
    """(head kind, vLLM method, vLLM extra, SGLang line) for a heads config; an engine that would
    not compute the heads as headstart does gets the reason instead (`engine_refusal`)."""
    from heads.eagle_config import engine_refusal

    if getattr(config, "model_type", "") == "medusa":
        return (
            f"Medusa heads ({config.num_heads} heads x {config.num_hidden_layers} residual layers)",
            "medusa",
            f'"num_speculative_tokens": {config.num_heads}',
            "SGLang does not serve Medusa heads; use vLLM or headstart.",
        )
    base = config.base_model_name_or_path or "BASE"
    kind, method = ("EAGLE-3", "eagle3") if config.version == 3 else ("EAGLE-1", "eagle")
    refusal = engine_refusal(config, "sglang")
    if refusal:
        sglang = f"# SGLang cannot serve this draft: {refusal}"
    else:
        path = "REPO"
        sglang = ""
        if config.version == 1:
            sglang = (
                "# SGLang builds EAGLE-1 under its own architecture name, with an fc bias: "
                "export first\n"
                'python -c "from heads.export import export_heads; '
                "export_heads('REPO', 'sglang', 'draft-sglang')\"   # headstart\n"
            )
            path = "draft-sglang"
        sglang += (
            f"python -m sglang.launch_server --model {base} --speculative-algorithm "
            f"{'EAGLE3' if config.version == 3 else 'EAGLE'} --speculative-draft-model-path "
            f"{path} --speculative-num-steps 5 --speculative-eagle-topk 8 "
            "--speculative-num-draft-tokens 32"
        )
    return f"{kind} draft layer", method, '"num_speculative_tokens": 5', sglang


def model_card(config, repo_id: str = "REPO") -> str:
    """A README.md for a heads folder: base model, head type, and how to use it."""
    from heads.eagle_config import engine_refusal

    kind, method, extra, sglang = _usage(config)
    base = config.base_model_name_or_path or "BASE"
    refusal = None if method == "medusa" else engine_refusal(config, "vllm")
    vllm = (
        f"# vLLM cannot serve these heads: {refusal}"
        if refusal
        else "from vllm import LLM\n"
        f'llm = LLM(model="{base}",\n'
        f'          speculative_config={{"method": "{method}", "model": "{repo_id}", {extra}}})'
    )
    tag = "medusa" if method == "medusa" else "eagle"
    return f"""---
base_model: {base}
library_name: headstart
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

## headstart

```python
from heads import load_base, load_heads
from inference import SpeculativeGenerator

base, tokenizer = load_base("{base}")
heads = load_heads("{repo_id}", base=base)
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
{sglang.replace("REPO", repo_id)}
```
"""


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload headstart heads",
) -> str:
    """Create `repo_id` if needed and upload a saved heads folder; returns the commit URL."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    card = folder / "README.md"
    if card.is_file():  # the card names the repo it lives in
        card.write_text(
            card.read_text()
            .replace('"REPO"', f'"{repo_id}"')
            .replace("path REPO", f"path {repo_id}")
            .replace("export_heads('REPO'", f"export_heads('{repo_id}'")
        )
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(
        folder_path=str(folder), repo_id=repo_id, commit_message=commit_message
    )
    return str(getattr(info, "commit_url", info))
