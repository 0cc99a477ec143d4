"""Fixtures of the script tests: a tiny base saved with the embedded tokenizer, and heads for it."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from tests.conftest import make_tiny_llama


def _tiny(tok, **overrides):
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    ids["pad_token_id"] = tok.pad_token_id
    return make_tiny_llama(
        0, "sdpa", vocab_size=len(tok), max_position_embeddings=2048, **ids, **overrides
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_tokenizer) -> dict[str, Path]:
    """A tiny base saved with the SmolLM2 tokenizer, fresh heads for it, and mismatched ones."""
    root = tmp_path_factory.mktemp("bench")
    tok = smollm2_tokenizer
    base = _tiny(tok)
    paths = {name: root / name for name in ("base", "medusa", "eagle3", "other-medusa", "small")}
    base.save_pretrained(paths["base"])
    tok.save_pretrained(paths["base"])
    base.config.name_or_path = str(paths["base"])  # the heads record the base bench loads
    cfg = MedusaConfig.from_base(base.config, num_heads=2)
    MedusaHeads(cfg).init_from_base(base).save_pretrained(paths["medusa"])
    eagle = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=1024))
    eagle.set_vocab_map(torch.arange(1024))
    eagle.save_pretrained(paths["eagle3"])
    other = _tiny(tok, num_hidden_layers=3)
    cfg = MedusaConfig.from_base(other.config, num_heads=2)
    MedusaHeads(cfg).init_from_base(other).save_pretrained(paths["other-medusa"])
    small = make_tiny_llama(1)  # vocab 256: not the base's tokenizer
    small.save_pretrained(paths["small"])
    tok.save_pretrained(paths["small"])
    return paths


def copy_without_chat_template(base: Path, out: Path) -> Path:
    """A copy of the base folder `base` whose tokenizer has no chat template."""
    shutil.copytree(base, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def heads_trained_under(heads: Path, out: Path, **recorded) -> Path:
    """A copy of the heads folder `heads` whose config.json records `recorded`
    (training_system_prompt=..., training_chat_template=...), as a recipe that set them writes."""
    shutil.copytree(heads, out)
    config = json.loads((out / "config.json").read_text())
    config.update(recorded)
    (out / "config.json").write_text(json.dumps(config))
    return out
