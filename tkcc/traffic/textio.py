"""Open trace files as text, transparently gunzipping (Azure 2025 and others ship .csv.gz)."""
from __future__ import annotations

import gzip
import io


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


def open_text(path):
    if isinstance(path, LineSource):
        return path
    p = str(path)
    if p.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8-sig", newline="")
    return open(p, "r", encoding="utf-8-sig", newline="")  # -sig: a BOM must not hide the first column


def first_line(path) -> str:
    """The first non-empty line (for format detection); '' for an empty file."""
    with open_text(path) as f:
        for line in f:
            if line.strip():
                return line.strip("\r\n")
    return ""
