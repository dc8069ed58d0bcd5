"""Incremental detokenization and stop strings.

Byte-level BPE tokens can split a UTF-8 character; decoding such a prefix yields U+FFFD. Text
is emitted only up to a complete character, and the rest waits for the next token. Stop
strings are searched in the text produced so far, so one spanning token boundaries is found;
while streaming, the last (longest stop - 1) characters are held back, since they may turn
out to be the start of a stop string that must not reach the client.
"""

from __future__ import annotations

from mox.tokenizer import Tokenizer

INCOMPLETE_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""              # emitted so far (complete characters, before any stop)
        self.stopped = False

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; returns the newly complete text (empty while a character is split).
        `final`: the sequence ends here, so a split character is emitted as it decodes."""
        self.token_ids += token_ids
        full = self.tokenizer.decode(self.token_ids)
        if full.endswith(INCOMPLETE_CHAR) and not final:
            full = full.rstrip(INCOMPLETE_CHAR)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, len(self.text) - longest)
            hits = [i for i in (full.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                full, self.stopped = full[:min(hits)], True
            elif not final:
                full = full[:max(len(self.text), len(full) - (longest - 1))]
        if not full.startswith(self.text):      # a merge rewrote earlier text: emit nothing
            return ""
        delta, self.text = full[len(self.text):], full
        return delta
