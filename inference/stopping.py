"""When generation stops, as HF `generate` decides it: after `max_new_tokens`, at an EOS token,
or at the token that completes a stop string (matched in the decoded text, also one that
begins in the prompt)."""

from __future__ import annotations

from collections.abc import Sequence


class Stopping:
    """Cuts each step's new tokens where generation ends, and keeps those generated.

    Args:
        prompt: the prompt's token ids (its tail is decoded before the answer's: a chat prompt
            ends in "assistant\\n", so "\\n\\n" may end one token in; HF reads the whole
            sequence's tail too, and only a match that ends in a new token's text stops).
        max_new_tokens: the most tokens generated.
        eos: the EOS ids, the last token kept when one comes.
        stop_strings: checked strings (empty: none), decoded with `tokenizer`.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        eos: set[int],
        stop_strings: Sequence[str],
        tokenizer,
    ) -> None:
        self.max_new_tokens, self.eos = max_new_tokens, eos
        self.stop_strings, self.tokenizer = stop_strings, tokenizer
        self.generated: list[int] = []
        self.finished = False  # by EOS or a stop string (not max_new_tokens)
        # The text is read in a window of the last tokens, decoded anew at each step (the whole
        # answer's would cost time quadratic in its length). A stop string may begin in the prompt,
        # and a match ends in a new token: the window holds twice the longest string's length in
        # UTF-8 bytes (not characters: byte-level tokens spell an emoji in up to 4), so a match
        # never reaches its first token, whose text may read otherwise alone (a SentencePiece
        # token's leading space, a character's bytes cut off).
        self.window = 2 * max((len(s.encode()) for s in stop_strings), default=0)
        self.tail = list(prompt[-self.window :]) if stop_strings else []

    def _text(self, new: list[int]) -> str:
        return self.tokenizer.decode(self.tail + new)

    @staticmethod
    def _length(text: str) -> int:
        """The text's length without the U+FFFD that stand for a character whose bytes are still
        coming (an emoji's over byte-level tokens): the token that completes it may leave the
        text no longer, and a stop string ending in it must still be found."""
        return len(text.rstrip("\ufffd"))

    def cut(self, new: list[int]) -> tuple[list[int], bool]:
        """`new` cut at max_new_tokens, EOS or a stop string, and kept; whether to stop."""
        done = False
        room = self.max_new_tokens - len(self.generated)
        if len(new) >= room:
            new, done = new[:room], True
        for i, t in enumerate(new):
            if t in self.eos:
                new, done, self.finished = new[: i + 1], True, True
                break
        if self.stop_strings:  # stop at the token that completes a stop string, as HF does
            end = self._length(self._text([]))  # a match must pass the text already read
            for i in range(len(new)):
                text = self._text(new[: i + 1])
                if any(text.find(s, max(end - len(s) + 1, 0)) >= 0 for s in self.stop_strings):
                    new, done, self.finished = new[: i + 1], True, True
                    break
                end = self._length(text)
            self.tail = (self.tail + new)[-self.window :]
        self.generated.extend(new)
        return new, done
