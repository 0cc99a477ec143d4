"""train/corpus.py and the text-corpus half of train.features.load_examples: teacher-forced
text beside the distilled answers, rendered as assistant turns, capped, never held out."""

from pathlib import Path

import pytest

from train import corpus
from train.config import load_recipe
from train.corpus import (
    CHUNK_WORDS,
    as_conversation,
    chunk_documents,
    corpus_chunks,
    embedded_documents,
    file_documents,
)
from train.features import corpus_examples, load_examples

ROOT = Path(__file__).resolve().parents[2]

WRAPPED = """The "assert" statement
**********************

Assert statements are a convenient way to insert debugging
assertions into a program, and this paragraph is wrapped at
sixty columns like Python's own reference text.

   assert_stmt ::= "assert" expression
   if not expression: raise AssertionError
"""


def test_chunks_unwrap_paragraphs_keep_code_and_drop_heading_rules():
    chunks = chunk_documents([("assert", WRAPPED * 20)])
    assert len(chunks) >= 2 and all(title == "assert" for title, _ in chunks)
    body = chunks[0][1]
    assert "****" not in body
    assert "debugging assertions into a program" in body  # the wrapped lines are joined
    assert '   assert_stmt ::= "assert" expression\n   if not expression' in body  # code kept
    for _, text in chunks[:-1]:
        assert CHUNK_WORDS <= len(text.split()) < CHUNK_WORDS + 60


def test_embedded_corpus_is_offline_and_sizeable():
    docs = embedded_documents()
    assert sum(len(text.split()) for _, text in docs) > 20_000
    assert any("Python topic" in title for title, _ in docs)
    turn = as_conversation(("the Python topic 'assert'", "Text."))
    assert turn[0]["role"] == "user" and turn[1] == {"role": "assistant", "content": "Text."}


def _recipe(tiny_task, tmp_path, *overrides):
    return load_recipe(
        ROOT / "recipes" / "tiny-medusa.yaml", tiny_task.overrides(tmp_path) + list(overrides)
    )


def test_text_corpus_examples_are_assistant_turns_and_capped(
    tiny_task, tmp_path, smollm2_tokenizer
):
    corpus = tmp_path / "notes"
    corpus.mkdir()
    words = " ".join(f"word{i}" for i in range(400))
    (corpus / "first-note.txt").write_text(words, encoding="utf-8")
    (corpus / "second.md").write_text("Short tail. " * 60, encoding="utf-8")
    recipe = _recipe(tiny_task, tmp_path, f"training.text_corpus=[{corpus}]")
    distilled, text = load_examples(recipe, smollm2_tokenizer)
    assert len(distilled) == 40 and len(text) == 2
    for example in text:
        targets = [t for t, m in zip(example["input_ids"], example["loss_mask"]) if m]
        answer = smollm2_tokenizer.decode(targets)
        assert answer.startswith(("word0", "Short tail.")), answer[:40]
        prompt = smollm2_tokenizer.decode(example["input_ids"][: example["loss_mask"].index(1)])
        assert "Tell me about" in prompt and "<|im_start|>assistant" in prompt
    capped = load_examples(
        _recipe(
            tiny_task, tmp_path, f"training.text_corpus=[{corpus}]", "training.text_max_tokens=10"
        ),
        smollm2_tokenizer,
    )[1]
    assert len(capped) == 1  # the first chunk already passes the cap


def test_missing_text_corpus_is_clear(tiny_task, tmp_path, smollm2_tokenizer):
    recipe = _recipe(tiny_task, tmp_path, f"training.text_corpus=[{tmp_path / 'absent.txt'}]")
    with pytest.raises(FileNotFoundError, match="absent.txt: no such file or folder"):
        load_examples(recipe, smollm2_tokenizer)


def test_a_three_character_heading_rule_is_dropped():
    # the shortest underline (3 characters) is a rule too
    assert corpus._unwrap("Notes\n---\n\nBody text.\n\n***\n") == ["Notes", "Body text."]
    assert corpus._unwrap("a --- b\n\n--") == ["a --- b", "--"]  # not a rule on its own line


def test_a_short_tail_is_dropped_and_a_long_one_kept():
    # a tail under a quarter of the chunk size is left out
    body = " ".join(["word"] * 20)
    short_tail = chunk_documents([("t", body + "\n\n" + "tail " * 4)], words=20)
    assert short_tail == [("t", body)]
    long_tail = chunk_documents([("t", body + "\n\n" + "tail " * 5)], words=20)
    assert len(long_tail) == 2 and long_tail[1][1].split() == ["tail"] * 5


def test_chunks_of_several_files_come_in_a_seeded_shuffle(tmp_path):
    # a token cap takes a mix of the sources, not the first file's chunks
    for i in range(6):
        (tmp_path / f"doc_{i}.txt").write_text(
            "\n\n".join(f"doc{i} paragraph {j} " + "word " * 200 for j in range(3))
        )
    chunks = corpus_chunks([str(tmp_path)], seed=0)
    in_file_order = chunk_documents(file_documents(tmp_path))
    assert sorted(chunks) == sorted(in_file_order) and len(chunks) == 18
    assert chunks != in_file_order
    assert corpus_chunks([str(tmp_path)], seed=0) == chunks
    assert corpus_chunks([str(tmp_path)], seed=1) != chunks


def test_a_file_name_becomes_a_title_in_words(tmp_path):
    # underscores and hyphens are spaces in the title the user turn asks about
    (tmp_path / "release_notes-v2.md").write_text("Text.")
    assert file_documents(tmp_path) == [("release notes v2", "Text.")]


def test_text_max_tokens_counts_targets_not_prompt_tokens(tmp_path, smollm2_tokenizer):
    corpus = tmp_path / "notes.txt"
    paragraphs = (" ".join(f"word{p}x{i}." for i in range(120)) for p in range(20))
    corpus.write_text("\n\n".join(paragraphs), encoding="utf-8")
    settings = [f"training.text_corpus=[{corpus}]"]
    every = corpus_examples(load_recipe(None, settings), smollm2_tokenizer)
    assert len(every) >= 3
    first = sum(every[0]["loss_mask"])
    assert first < len(every[0]["input_ids"])  # a prompt in front of the answer
    # One target past the first chunk's: the second chunk is taken, and no third
    capped = corpus_examples(
        load_recipe(None, [*settings, f"training.text_max_tokens={first + 1}"]), smollm2_tokenizer
    )
    assert capped == every[:2]
