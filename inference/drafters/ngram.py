"""n-gram prompt lookup: propose the continuation of the latest earlier occurrence of the
sequence's last n tokens (Saxena 2023, "Prompt Lookup Decoding"; HF `prompt_lookup_num_tokens`).
No model, no training; strong on copy-heavy tasks (summarisation, code edits, RAG).

With a corpus (`NgramTable`, e.g. the base's own self-distilled answers) the lookup also
proposes what the base most often wrote after the same words elsewhere, in the spirit of REST
(He et al. 2024, "Retrieval-Based Speculative Decoding"): a small model's answers repeat their
phrasing from prompt to prompt, and a table of them costs microseconds per step to query.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from inference.draft import Draft, Drafter, Sampling


class NgramTable:
    """The most frequent next token after every context of 1..max_ngram tokens in a corpus.

    A backoff n-gram model of the corpus, greedy only: `continuation` extends a sequence token
    by token from its longest context that the table holds. Only confident contexts are held:
    seen before their best follower at least `min_count` times, which is at least `min_share`
    of what followed them (on a CPU an unconfident guess costs more in verification than it
    gains; on a GPU, where tree nodes are nearly free, lower both). Where a long context was
    dropped, a shorter one that was kept still answers: replayed on MT-bench that drafted
    better than stopping there (docs/bench.md). Build it from token ids
    (`NgramTable(sequences)`) or from answers on disk (`from_jsonl`). Memory: at most one dict
    entry per distinct context (17 MB for 110k tokens, built in 2 s).
    """

    def __init__(
        self,
        sequences: Iterable[list[int]],
        max_ngram: int = 4,
        min_count: int = 2,
        min_share: float = 0.5,
    ) -> None:
        if max_ngram < 1 or min_count < 1 or not 0.0 <= min_share <= 1.0:
            raise ValueError(
                "need max_ngram >= 1, min_count >= 1 and 0 <= min_share <= 1; got "
                f"max_ngram={max_ngram}, min_count={min_count}, min_share={min_share}"
            )
        self.max_ngram, self.min_count, self.min_share = max_ngram, min_count, min_share
        counts = [Counter() for _ in range(max_ngram + 1)]  # counts[n][(context..., next)]
        self.num_tokens = 0
        for seq in sequences:
            seq = [int(t) for t in seq]  # tensor elements would hash by identity
            self.num_tokens += len(seq)
            for n in range(1, max_ngram + 1):
                counts[n].update(tuple(seq[i : i + n + 1]) for i in range(len(seq) - n))
        # next_token[n][context] = its most frequent follower (ties: the one seen first)
        self.next_token: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        for n in range(1, max_ngram + 1):
            best: dict[tuple[int, ...], tuple[int, int]] = {}  # context -> (token, count)
            total: Counter = Counter()
            for gram, count in counts[n].items():
                context = gram[:-1]
                total[context] += count
                if count > best.get(context, (0, 0))[1]:
                    best[context] = (gram[-1], count)
            self.next_token[n] = {
                context: token
                for context, (token, count) in best.items()
                if count >= min_count and count >= min_share * total[context]
            }

    @property
    def num_contexts(self) -> int:
        return sum(len(table) for table in self.next_token)

    def info(self) -> dict:
        """Size and settings, for reports (bench results, replays)."""
        return {
            "tokens": self.num_tokens,
            "contexts": self.num_contexts,
            "max_ngram": self.max_ngram,
            "min_count": self.min_count,
            "min_share": self.min_share,
        }

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_id: int | None = None,
        **options,
    ) -> NgramTable:
        """The assistant turns of JSONL conversations: a file, or a folder of `*.jsonl` (the
        output folder of `scripts/distill.py`). Records hold ShareGPT `conversations`
        (`from`: gpt / assistant) or OpenAI `messages` (`role`: assistant). Each answer is
        tokenized on its own and, unless its record says `"finished": false` (distill's mark
        for an answer cut at max_new_tokens), ends with `eos_token_id` (the end-of-turn token),
        so that the table also learns where answers end. `options` go to the constructor."""
        path = Path(path)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files or not files[0].exists():
            raise FileNotFoundError(
                f"no JSONL answers at {path} (a .jsonl file or a folder of them)"
            )
        answers: list[tuple[str, bool]] = []  # (text, whether it ended by itself)
        for file in files:
            with open(file, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{file}:{line_no}: not JSON ({e.msg})") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{file}:{line_no}: a record must be a JSON object")
                    texts = _assistant_texts(record)
                    ended = [True] * len(texts)
                    if texts and record.get("finished") is False:
                        ended[-1] = False  # distill cut the last answer at max_new_tokens
                    answers += zip(texts, ended)
        if not answers:
            raise ValueError(
                f"no assistant turns in {path}: expected ShareGPT 'conversations' (from: gpt) or "
                "OpenAI 'messages' (role: assistant), e.g. the output folder of scripts/distill.py"
            )
        end = [] if eos_token_id is None else [eos_token_id]
        ids = tokenizer([text for text, _ in answers], add_special_tokens=False)["input_ids"]
        return cls((a + end if ended else a for a, (_, ended) in zip(ids, answers)), **options)

    def match(self, sequence: list[int]) -> int:
        """Length of the longest suffix of `sequence` held as a context (0: none)."""
        for n in range(min(self.max_ngram, len(sequence)), 0, -1):
            if tuple(sequence[-n:]) in self.next_token[n]:
                return n
        return 0

    def continuation(self, sequence: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens, each the corpus' most frequent follower of the longest
        context it holds (the sequence so far plus the tokens already proposed)."""
        seq, out = list(sequence), []
        for _ in range(num_tokens):
            n = self.match(seq)
            if n == 0:
                break
            token = self.next_token[n][tuple(seq[-n:])]
            out.append(token)
            seq.append(token)
        return out


def _assistant_texts(record: dict) -> list[str]:
    turns = record.get("conversations") or record.get("messages") or []
    texts = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        who = str(turn.get("from", turn.get("role", ""))).lower()
        text = turn.get("value", turn.get("content"))
        if who in ("gpt", "assistant") and isinstance(text, str) and text:
            texts.append(text)
    return texts


class NgramDrafter(Drafter):
    """Chain drafter from prompt lookup; every node is a point mass.

    Args:
        num_tokens: chain length.
        max_ngram, min_ngram: suffix lengths looked up in the sequence, longest first.
        corpus: an `NgramTable`; where its longest matching context (up to the table's own
            max_ngram, at least min_ngram) is longer than the sequence's own match (or the
            sequence has none), its continuation is proposed instead. The sequence wins ties:
            text the prompt or answer already holds is the better guess.
    """

    def __init__(
        self,
        num_tokens: int = 4,
        max_ngram: int = 3,
        min_ngram: int = 1,
        corpus: NgramTable | None = None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError("need 1 <= min_ngram <= max_ngram and num_tokens >= 1")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.corpus = corpus
        self.max_nodes = 1 + num_tokens

    def configure(self, num_tokens: int) -> None:
        self.num_tokens, self.max_nodes = num_tokens, 1 + num_tokens

    def default_arms(self, device: torch.device) -> list[dict | None]:
        return [None, {"num_tokens": 3}, {"num_tokens": 6 if device.type == "cpu" else 10}]

    def propose(self, sequence: torch.Tensor, sampling: Sampling) -> Draft:
        return Draft.chain(int(sequence[-1]), self.lookup(sequence), sequence.device)

    def lookup(self, sequence: torch.Tensor) -> list[int]:
        """The up-to-`num_tokens` tokens that followed the latest earlier match of the longest
        matching suffix n-gram (n from max_ngram down to min_ngram), or the corpus'
        continuation where its match is longer; [] when nothing matches."""
        seq = sequence.cpu()
        follow, n = self._lookup_sequence(seq)
        if self.corpus is not None:
            tail = seq[-self.corpus.max_ngram :].tolist()  # the corpus reads the suffix alone
            if self.corpus.match(tail) > max(n, self.min_ngram - 1):
                return self.corpus.continuation(tail, self.num_tokens)
        return follow

    def _lookup_sequence(self, seq: torch.Tensor) -> tuple[list[int], int]:
        """Compared in tensors, one pass per n: a Python loop over a long sequence's positions
        cost ~5 ms a step at 8,000 tokens."""
        T = seq.numel()
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            # every earlier n-gram that has a follower (starts 0 .. T-n-1) against the suffix
            found = (seq[: T - 1].unfold(0, n, 1) == seq[T - n :]).all(1).nonzero()
            if found.numel():
                start = int(found[-1]) + n  # latest occurrence first
                return seq[start : start + self.num_tokens].tolist(), n
        return [], 0
