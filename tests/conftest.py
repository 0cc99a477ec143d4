"""Shared fixtures: the tiny random Llama (2 layers, H=64, V=256) and the embedded SmolLM2."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def user_prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """(1, T) ids of one user turn in the tokenizer's chat template, ready for the answer."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]


def make_tiny_llama(seed: int = 0, attn: str = "sdpa", **overrides) -> LlamaForCausalLM:
    """A frozen random Llama in fp32; `overrides` change TINY's fields."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.config.name_or_path = f"tiny-llama-{seed}"
    return model


def change_logits(model, transform) -> None:
    """`model`'s forward returns `transform(logits)` from now on: a base that changes its logits
    after the lm_head in a way headstart does not know."""
    forward = model.forward

    def changed(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = transform(out.logits)
        return out

    model.forward = changed


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The scripts' main set torch's thread count (--threads): give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    return make_tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct (fp32, CPU)."""
    from heads import load_base

    return load_base("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded SmolLM2 tokenizer only (ChatML template, eos `<|im_end|>`); no weights."""
    from transformers import AutoTokenizer

    from heads.base import resolve_base_path

    try:
        path, _ = resolve_base_path("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 2-layer Llama (H=64) saved with the embedded tokenizer and its chat template."""
    path = tmp_path_factory.mktemp("tiny-base")
    tok = smollm2_tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(
        **{
            **TINY,
            "vocab_size": len(tok),
            "max_position_embeddings": 1024,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "tie_word_embeddings": True,
        }
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def medusa_dir(tiny_llama, tmp_path):
    """A folder of fresh Medusa heads (2 heads, 1 layer) of the tiny Llama, and the heads."""
    from heads import MedusaConfig, MedusaHeads

    heads = MedusaHeads(
        MedusaConfig.from_base(tiny_llama.config, num_heads=2, num_layers=1)
    ).init_from_base(tiny_llama)
    heads.save_pretrained(tmp_path / "medusa")
    return tmp_path / "medusa", heads


class FakeHub:
    """`huggingface_hub.HfApi` as the Hub answers, recording what was pushed: creating a repo
    that exists fails unless exist_ok; each upload keeps the folder's files by repo."""

    def __init__(self) -> None:
        self.private: dict[str, bool | None] = {}  # repo_id -> private, as created
        self.folders: dict[str, Path] = {}  # repo_id -> the folder uploaded last
        self.files: dict[str, dict[str, bytes]] = {}  # repo_id -> {file name: bytes}
        self.unreachable = False  # no network: create_repo raises what requests would
        self.commits = 0
        self.branches: dict[str, set[str]] = {}  # repo_id -> branches made
        self.pulls: dict[str, dict[str, bytes]] = {}  # repo_id -> files of its last pull request

    def __call__(self, token=None) -> FakeHub:  # HfApi(token=...)
        return self

    def create_repo(self, repo_id, private=None, exist_ok=False) -> None:
        if self.unreachable:
            raise ConnectionError("Name or service not known")
        if repo_id in self.private and not exist_ok:
            raise OSError(f"409 Conflict: You already created this model repo: {repo_id}")
        self.private[repo_id] = private

    def create_branch(self, repo_id, branch, exist_ok=False) -> None:
        """A new branch starts from main, as on the Hub."""
        if branch not in self.branches.setdefault(repo_id, set()):
            self.files[f"{repo_id}@{branch}"] = dict(self.files.get(repo_id, {}))
        self.branches[repo_id].add(branch)

    def list_repo_files(self, repo_id, revision=None) -> list[str]:
        return sorted(self.files.get(self._ref(repo_id, revision), {}))

    def _ref(self, repo_id, revision) -> str:
        return repo_id if revision in (None, "main") else f"{repo_id}@{revision}"

    def upload_folder(
        self,
        folder_path,
        repo_id,
        commit_message,
        revision=None,
        create_pr=False,
        delete_patterns=None,
    ) -> str:
        """The repo keeps its other files, as the Hub does, but those `delete_patterns` match."""
        import fnmatch

        if revision not in (None, "main") and revision not in self.branches.get(repo_id, ()):
            raise OSError(f"404 Client Error: Invalid rev id: {revision}")
        ref = self._ref(repo_id, revision)
        kept = {
            name: data
            for name, data in self.files.get(ref, {}).items()
            if not any(fnmatch.fnmatch(name, p) for p in delete_patterns or ())
        }
        self.folders[repo_id] = Path(folder_path)
        uploaded = {p.name: p.read_bytes() for p in Path(folder_path).iterdir() if p.is_file()}
        self.commits += 1
        if create_pr:
            self.pulls[repo_id] = {**kept, **uploaded}
            return SimpleNamespace(
                commit_url=f"https://hub/{repo_id}/commit/{self.commits}",
                pr_url=f"https://hub/{repo_id}/discussions/{self.commits}",
            )
        self.files[ref] = {**kept, **uploaded}
        return f"https://hub/{repo_id}/commit/{self.commits}"

    def card(self, repo_id: str) -> str:
        return self.files[repo_id]["README.md"].decode()


@pytest.fixture
def fake_hub(monkeypatch) -> FakeHub:
    """The Hub, faked: `huggingface_hub.HfApi` answers from a FakeHub."""
    import huggingface_hub

    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", hub)
    return hub
