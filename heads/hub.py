"""Hugging Face Hub: model cards and uploads (downloads live in `checkpoint.resolve_folder`)."""

from __future__ import annotations

from pathlib import Path


def _usage(config) -> tuple[str, str, str, str]:
    """(head kind, vLLM method, vLLM extra, SGLang line) for a heads config."""
    if getattr(config, "model_type", "") == "medusa":
        return (
            f"Medusa heads ({config.num_heads} heads x {config.num_hidden_layers} residual layers)",
            "medusa",
            f'"num_speculative_tokens": {config.num_heads}',
            "SGLang does not serve Medusa heads; use vLLM or headstart.",
        )
    base = config.base_model_name_or_path or "BASE"
    if config.version == 3:
        return (
            "EAGLE-3 draft layer",
            "eagle3",
            '"num_speculative_tokens": 5',
            f"python -m sglang.launch_server --model {base} --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path REPO --speculative-num-steps 5 "
            "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32",
        )
    return (
        "EAGLE-1 draft layer",
        "eagle",
        '"num_speculative_tokens": 5',
        "# SGLang builds EAGLE-1 under its own architecture name, with an fc bias: export first\n"
        'python -c "from heads.export import export_heads; '
        "export_heads('REPO', 'sglang', 'draft-sglang')\"   # headstart\n"
        f"python -m sglang.launch_server --model {base} --speculative-algorithm EAGLE "
        "--speculative-draft-model-path draft-sglang --speculative-num-steps 5 "
        "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32",
    )


def model_card(config, repo_id: str = "REPO") -> str:
    """A README.md for a heads folder: base model, head type, and how to use it."""
    kind, method, extra, sglang = _usage(config)
    base = config.base_model_name_or_path or "BASE"
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
from vllm import LLM
llm = LLM(model="{base}",
          speculative_config={{"method": "{method}", "model": "{repo_id}", {extra}}})
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
