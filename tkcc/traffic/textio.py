"""Open trace files as text, line by line with bounded memory, transparently gunzipping (.csv.gz and others).

Every loader reads through ``open_text``: lines of at most ``MAX_LINE_BYTES`` (a longer one is an error,
so a binary file or a file of NUL bytes costs one bounded read, not gigabytes of memory), UTF-8 (a
leading BOM dropped), no NUL bytes. A violation is a ``TraceFormatError`` naming the file, the line and the
cause, raised at the line where it is found.
"""
from __future__ import annotations

import gzip

from tkcc.errors import TraceFormatError

MAX_LINE_BYTES = 1 << 20  # one request per line: a real trace line is well under a kilobyte


class LineSource:
    """Lines already read from a file (a follower's new complete lines), standing in for the file.

    ``lines[k]`` (0-based) is physical line ``line_numbers[k]`` of ``name``, so
    errors still name the real file and line.
    """

    def __init__(self, name: str, lines: list[str], line_numbers: list[int]):
        self.name, self.lines, self.line_numbers = str(name), lines, line_numbers

    def __str__(self) -> str:
        return self.name

    def physical(self, k: int) -> int:
        """Physical line of the k-th (1-based) line handed out."""
        return self.line_numbers[k - 1] if 1 <= k <= len(self.line_numbers) else k

    def __enter__(self):
        return iter(self.lines)

    def __exit__(self, *exc):
        return False


def physical_line(source, k: int) -> int:
    return source.physical(k) if isinstance(source, LineSource) else k


def decode_line(raw: bytes, path, line: int, first: bool = False, max_bytes: int = MAX_LINE_BYTES) -> str:
    """One physical line as text, or TraceFormatError naming why it is not a trace line."""
    if len(raw) > max_bytes:
        raise TraceFormatError(f"line is longer than {max_bytes} bytes (a binary file, or not a trace with one "
                               "request per line)", path=str(path), line=line)
    if first and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise TraceFormatError("UTF-16 text; traces are read as UTF-8: convert the file (iconv -f UTF-16 -t UTF-8)",
                               path=str(path), line=line)
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise TraceFormatError(f"binary data: a NUL byte at column {nul + 1} (not a text trace)", path=str(path),
                               line=line)
    if first and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a BOM must not hide the first column
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"not UTF-8 text: byte 0x{raw[e.start]:02x} at column {e.start + 1} ({e.reason})",
                               path=str(path), line=line) from None


class TextLines:
    """Iterate a trace file's lines as text (see the module docstring); a context manager like ``open``.

    Reads blocks of ``BLOCK_BYTES``; the checks (NUL bytes, UTF-8, line length) run on whole blocks, and only
    a block that fails one is looked at line by line, to name the line."""

    BLOCK_BYTES = 256 << 10

    def __init__(self, path, max_line_bytes: int = MAX_LINE_BYTES):
        self.path, self.max = str(path), max_line_bytes
        try:
            self.raw = gzip.open(self.path, "rb") if self.path.endswith(".gz") else open(self.path, "rb")
        except OSError as e:
            raise TraceFormatError(f"cannot open: {e.strerror}", path=self.path) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.raw.close()
        return False

    def __iter__(self):
        return self._lines()

    def _read(self, line: int) -> bytes:
        try:
            return self.raw.read(self.BLOCK_BYTES)
        except (OSError, EOFError) as e:
            raise TraceFormatError(f"unreadable (damaged, or not gzip): {e}", path=self.path, line=line) from None

    def _lines(self):
        buf, n = b"", 0  # n: lines handed out so far
        while True:
            block = self._read(n + 1)
            if not block:
                if buf:
                    yield decode_line(buf, self.path, n + 1, first=n == 0, max_bytes=self.max)
                return
            data = buf + block
            cut = data.rfind(b"\n")
            if cut < 0:
                if len(data) > self.max:
                    decode_line(data, self.path, n + 1, first=n == 0, max_bytes=self.max)  # raises: too long
                buf = data
                continue
            head, buf = data[: cut + 1], data[cut + 1:]
            if len(buf) > self.max:
                decode_line(buf, self.path, n + head.count(b"\n") + 1, max_bytes=self.max)  # raises
            parts = head.split(b"\n")[:-1]
            try:
                if b"\x00" in head or len(head) > self.max or (n == 0 and head[:2] in (b"\xff\xfe", b"\xfe\xff")):
                    raise ValueError
                text = head.decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                for k, raw in enumerate(parts):  # name the first bad line (decode_line raises on it)
                    decode_line(raw + b"\n", self.path, n + k + 1, first=n + k == 0, max_bytes=self.max)
                text = head.decode("utf-8")
            lines = text.split("\n")[:-1]
            if n == 0 and lines and lines[0].startswith("\ufeff"):
                lines[0] = lines[0][1:]  # a BOM must not hide the first column
            n += len(lines)
            for line in lines:
                yield line + "\n"


def open_text(path):
    if isinstance(path, LineSource):
        return path
    return TextLines(path)


def first_line(path) -> str:
    """The first non-empty line (for format detection); '' for an empty file."""
    with open_text(path) as f:
        for line in f:
            if line.strip():
                return line.strip("\r\n")
    return ""
