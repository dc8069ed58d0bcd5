"""Incremental detokenization and stop strings.

Text is decoded over a window that starts at the last token already turned into text, and
only the new tokens' part is taken from it (vLLM's offsets): a SentencePiece token decodes
with its leading space only after another token, and decoding the whole output again at every
token costs O(n^2). Byte-level BPE tokens can split a UTF-8 character; decoding such a window
ends in U+FFFD, and it waits for the next token. Text once produced is never rewritten: where
a later token turns earlier bytes invalid (a sampled byte-fallback `<0xNN>` after a character
made of such bytes), the window's new part is taken by length, as vLLM takes it, rather than
ending the output. Stop strings are searched in the text produced so far, so one spanning
token boundaries is found; while streaming, the last (longest stop - 1) characters are held
back, since they may turn out to be the start of a stop string that must not reach the client.
"""

from __future__ import annotations

from mox.tokenizer import Tokenizer

INCOMPLETE_CHAR = "\ufffd"


# Prompt tokens the first window starts with (vLLM's 5): a SentencePiece word's space shows
# only after another token, so the output's first word keeps its space (" Paris", not "Paris")
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...],
                 prompt_ids: list[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        # the output's tokens follow the prompt's tail, which is context, never text
        self.token_ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.decoded = ""           # every token's text so far (append-only)
        self.text = ""              # emitted so far: a prefix of `decoded`, before any stop
        self.stopped = False
        self._window = 0            # the window's first token: the last one already decoded
        self._read = len(self.token_ids)    # tokens up to here are in `decoded`

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; returns the newly complete text (empty while a character is split).
        `final`: the sequence ends here, so a split character is emitted as it decodes."""
        self.token_ids += token_ids
        self._decode(final)
        full = self.decoded
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, len(self.text) - longest)
            hits = [i for i in (full.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                full, self.stopped = full[:min(hits)], True
            elif not final:
                full = full[:max(len(self.text), len(full) - (longest - 1))]
        delta, self.text = full[len(self.text):], full
        return delta

    def _decode(self, final: bool) -> None:
        """Append the new tokens' text to `decoded`, unless it ends mid-character (and the
        sequence goes on)."""
        if self._read == len(self.token_ids):
            return
        before = self.tokenizer.decode(self.token_ids[self._window:self._read])
        after = self.tokenizer.decode(self.token_ids[self._window:])
        if (after.endswith(INCOMPLETE_CHAR) and not final) or len(after) <= len(before):
            # no text yet: the window stays where it is (a skipped special token must not
            # become its first token, which would lose the next SentencePiece word's space)
            return
        self.decoded += after[len(before):]
        self._window, self._read = self._read, len(self.token_ids)
