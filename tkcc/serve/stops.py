"""When a request stops, and the text it streams: max_tokens, end-of-sequence ids, stop strings.

``TextStop`` is fed each generated id (in the scheduler thread, so a stop is
decided before the next step is spent) and returns the text to stream and
whether the request is finished. A stop string is matched on the decoded
text, across token boundaries: text that could be the start of a stop string
is held back until it is known not to be one, and the text returned ends
before the stop string (OpenAI's semantics). The id that completed it still
counts as a generated token.
"""
from __future__ import annotations


class TextStop:
    def __init__(self, tokenizer, max_tokens: int, stop: list[str] | None = None, context=()):
        self.stream = tokenizer.incremental(context)
        self.eos = tokenizer.eos_token_ids
        self.max_tokens = int(max_tokens)
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""       # all text decoded so far (until a stop string, exclusive)
        self.sent = 0        # characters of self.text already returned
        self.count = 0
        self.finish: str | None = None

    def push(self, tok: int) -> tuple[str, str | None]:
        """One generated id -> (text to emit now, finish reason or None)."""
        self.count += 1
        if tok in self.eos:
            return self._end("stop", flush=True)
        self.text += self.stream.push(tok)
        if self._stopped():
            return self._end("stop")
        if self.count >= self.max_tokens:
            self.text += self.stream.flush()
            return self._end("stop" if self._stopped() else "length")
        safe = len(self.text) - self._hold if self.stop else len(self.text)
        if safe <= self.sent:
            return "", None
        out, self.sent = self.text[self.sent:safe], safe
        return out, None

    def end(self, reason: str) -> str:
        """The request ended for another reason (cancelled, timed out): the text still held back."""
        return self._end(reason, flush=True)[0]

    def _stopped(self) -> bool:
        if not self.stop:
            return False
        # only the new tail can hold a first occurrence (earlier text was checked already)
        start = max(0, self.sent - self._hold - 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def _end(self, reason: str, flush: bool = False) -> tuple[str, str]:
        self.finish = reason
        if flush:
            self.text += self.stream.flush()
            self._stopped()
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out, reason
