"""Incremental detokenization and stop-string handling.

Text is produced by decoding a short window of tokens (a few already-printed ones for context, so
tokenizers that drop a word's leading space at the start of a decode still print it) and keeping
what the newest tokens add. A window that ends in U+FFFD is an incomplete UTF-8 character
(byte-level BPE splits characters across tokens): nothing is printed until it completes.

When stop strings are set, the last len(longest stop) - 1 characters are held back from the
stream until it is known they do not begin a stop string, so a stop string is never streamed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the API process detokenizes `output_processor`'s stand-ins and never imports torch
    from lmfoundry.runtime.engine.sequence import Sequence

CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(seq.num_prompt_tokens - CONTEXT_TOKENS, 0)

    def update(self, seq: Sequence) -> None:
        """Append to seq.output_text whatever the tokens up to the last one add."""
        if self.tokenizer is None:
            return
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.output_text += full[len(prefix) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(ids)

    def flush(self, seq: Sequence) -> None:
        """At the end, print what is left even if it ends in an incomplete character."""
        if self.tokenizer is None or seq.read_offset >= len(seq.token_ids):
            return
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        seq.output_text += full[len(prefix) :]
        seq.prefix_offset = seq.read_offset = len(ids)

    @staticmethod
    def find_stop(seq: Sequence, checked_chars: int) -> bool:
        """Truncate output_text at the first stop string that ends after `checked_chars`."""
        stops = seq.params.stop
        if not stops:
            return False
        start = max(0, checked_chars - max(map(len, stops)) + 1)
        best = None
        for s in stops:
            pos = seq.output_text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        pos, s = best
        seq.output_text = seq.output_text[: pos + len(s) if seq.params.include_stop_str_in_output else pos]
        return True

    @staticmethod
    def take_new_text(seq: Sequence) -> str:
        """Text not yet streamed, minus a possible stop-string beginning while still running."""
        end = len(seq.output_text)
        if not seq.is_finished and seq.params.stop:
            end = max(seq.num_emitted_chars, end - max(map(len, seq.params.stop)) + 1)
        text = seq.output_text[seq.num_emitted_chars : end]
        seq.num_emitted_chars = end
        return text
