"""Tokenizers for serving: the model directory's own (Hugging Face), or bytes for random-weight models.

``load_tokenizer(model_dir, vocab_size)`` loads the tokenizer of a local HF
model directory with ``transformers.AutoTokenizer`` (``local_files_only``:
the server never reaches a hub) and checks that its ids fit the model. The
built-in models have random weights and no tokenizer; they get
``ByteTokenizer``: the UTF-8 bytes of the text are the token ids 0..255, so
the model needs a vocabulary of at least 256 ids. A generated id >= 256 (the
random models emit any id of their vocabulary) has no byte; it is shown as
``<|id|>`` in the text, and its id is returned in ``token_ids`` as is.

Every tokenizer gives ``incremental()``: a detokenizer fed one id at a time
that returns the text to emit so far, never half a UTF-8 character, as
streaming clients expect.
"""
from __future__ import annotations

import codecs
import os

from tkcc.errors import TkccError

# what a chat is turned into when the tokenizer has no chat template (the byte tokenizer, bare HF dirs)
PLAIN_ROLE_PREFIX = "{role}: "
PLAIN_GENERATION_PROMPT = "assistant: "


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (random-weight models); ids >= 256 decode as ``<|id|>``."""

    name = "bytes"
    eos_token_ids: frozenset = frozenset()
    chat_template = None

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise TkccError(f"the byte tokenizer needs a vocabulary of at least 256 ids (bytes 0..255); this model "
                            f"has {vocab_size}; serve it with a tokenizer of its own (--tokenizer DIR)")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return _ByteStream().feed_all(ids)

    def incremental(self, context=()) -> "_ByteStream":
        del context  # bytes need no left context
        return _ByteStream()


class _ByteStream:
    """Incremental byte decoding: a multi-byte character is emitted when its last byte arrives."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tok: int) -> str:
        if 0 <= tok < 256:
            return self._dec.decode(bytes((tok,)))
        return self._dec.decode(b"", final=True) + f"<|{tok}|>"

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

    def feed_all(self, ids) -> str:
        return "".join(self.push(int(t)) for t in ids) + self.flush()


class HFTokenizer:
    """A ``transformers`` tokenizer loaded from a local model directory."""

    def __init__(self, tok, vocab_size: int, source: str):
        self.tok = tok
        self.name = source
        self.vocab_size = int(vocab_size)
        self.chat_template = getattr(tok, "chat_template", None)
        eos = tok.eos_token_id
        ids = eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        self.eos_token_ids = frozenset(int(i) for i in ids)
        n = len(tok)
        if n > vocab_size:
            raise TkccError(f"tokenizer {source} has {n} ids but the model's vocabulary is {vocab_size}: its ids "
                            "would index past the embedding")

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat(self, messages: list[dict]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def incremental(self, context=()) -> "_WindowStream":
        return _WindowStream(self, list(context)[-5:])


class _WindowStream:
    """Incremental detokenisation as vLLM does it: decode a short window and emit what it added.

    A token's text can depend on its left neighbour (SentencePiece's leading space), and a byte-fallback
    token can be half a character; so the window ``ids[prefix:]`` is decoded against ``ids[prefix:read]``
    and only a delta that does not end in U+FFFD is emitted. Cost: two decodes of a few tokens per token.
    """

    def __init__(self, tok: HFTokenizer, context: list[int]):
        self.tok = tok
        self.ids = list(context)
        self.prefix, self.read = 0, len(self.ids)

    def push(self, tok: int) -> str:
        self.ids.append(int(tok))
        if tok in self.tok.eos_token_ids:
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


def plain_chat_text(messages: list[dict]) -> str:
    """A chat as plain text for tokenizers without a chat template: one ``role: content`` line each."""
    lines = [PLAIN_ROLE_PREFIX.format(role=m["role"]) + m["content"] for m in messages]
    return "\n".join(lines) + "\n" + PLAIN_GENERATION_PROMPT


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt: the tokenizer's chat template if it has one, else ``plain_chat_text``."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat"):
        return tokenizer.apply_chat(messages)
    return tokenizer.encode(plain_chat_text(messages))


def load_tokenizer(source: str | None, vocab_size: int):
    """The tokenizer of local model directory ``source`` (HF files), or bytes when ``source`` is None."""
    if source is None:
        return ByteTokenizer(vocab_size)
    if not os.path.isdir(source):
        raise TkccError(f"tokenizer directory {source!r} does not exist")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise TkccError(f"could not load a tokenizer from {source}: {e}") from None
    return HFTokenizer(tok, vocab_size, source)
