"""One entry point for every trace format: detect, load whole, or stream in chunks."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from tkcc.errors import TraceFormatError
from tkcc.traffic import formats_csv, formats_jsonl, servegen, tkcc_format
from tkcc.traffic.textio import first_line
from tkcc.traffic.trace import Trace

# name -> chunk iterator(path, skip_bad, chunk_rows, **options)
FORMATS = {
    "azure2023": formats_csv.iter_azure,
    "sharegpt": formats_csv.iter_sharegpt,
    "burstgpt": formats_csv.iter_burstgpt,
    "servegen": servegen.iter_servegen,
    "mooncake": formats_jsonl.iter_mooncake,
    "jsonl": formats_jsonl.iter_request_log,
    "tkcc": tkcc_format.iter_tkcc,
}
ALIASES = {"azure": "azure2023", "azure2024": "azure2023", "openai": "jsonl", "vllm": "jsonl"}


def detect_format(path) -> str:
    """Name the format of a file from its name and first line; TraceFormatError if none fits."""
    p = str(path)
    if servegen.is_servegen_path(p):
        return "servegen"
    if os.path.isdir(p):
        raise TraceFormatError("is a directory; name a trace file (for ServeGen, chunk-N-trace.csv)", path=p)
    if not os.path.exists(p):
        raise TraceFormatError("no such file", path=p)
    line = first_line(p)
    if not line:
        raise TraceFormatError("file is empty", path=p, line=1)
    if line.lstrip().startswith("{"):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"first line looks like JSON but does not parse: {e.msg}", path=p, line=1) from None
        if isinstance(obj, dict) and "tkcc_trace" in obj:
            return "tkcc"
        if isinstance(obj, dict) and {"timestamp", "input_length", "output_length"} <= set(obj):
            return "mooncake"
        if isinstance(obj, dict) and formats_jsonl.looks_like_request_log(obj):
            return "jsonl"
        raise TraceFormatError(f"unknown JSON-lines trace: first object has keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}; "
                               f"formats: {sorted(FORMATS)}", path=p, line=1)
    fmt = formats_csv.sniff_csv_header(line)
    if fmt:
        return fmt
    near = formats_csv.closest_csv_format(line)
    if near:
        fmt, missing = near
        raise TraceFormatError(f"missing column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}: "
                               f"the header {line[:200]!r} looks like a {fmt} trace, which needs "
                               f"{list(formats_csv.CSV_FORMATS[fmt])}", path=p, line=1, field=missing[0])
    if p.endswith("-trace.csv"):
        raise TraceFormatError("looks like a ServeGen trace.csv but the matching -dataset.json is missing", path=p)
    raise TraceFormatError(f"unknown trace format (first line {line[:120]!r}); name one with --format: "
                           f"{sorted(FORMATS)}", path=p, line=1)


def _resolve(path, format: str | None) -> tuple[str, str]:
    p = str(path)
    if format in (None, "", "auto"):
        return p, detect_format(p)
    fmt = ALIASES.get(format, format)
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown format {format!r}; formats: {sorted(FORMATS)}", path=p)
    if fmt != "servegen" and not os.path.isfile(p):
        raise TraceFormatError("no such file", path=p)
    return p, fmt


def iter_trace(path, format: str | None = None, skip_bad: bool = False, chunk_rows: int = 200_000,
               **options) -> Iterator[Trace]:
    """Stream a trace as Trace chunks of at most ~chunk_rows requests (constant memory per chunk).

    Arrival order and skip counts carry across chunks; every chunk's
    ``skipped`` counts only its own bad rows.
    """
    p, fmt = _resolve(path, format)
    _check_options(fmt, options, p)
    yield from FORMATS[fmt](p, skip_bad=skip_bad, chunk_rows=chunk_rows, **options)


def _check_options(fmt: str, options: dict, path: str) -> None:
    import inspect

    allowed = set(inspect.signature(FORMATS[fmt]).parameters) - {"path", "skip_bad"}
    extra = sorted(set(options) - allowed)
    if extra:
        raise TraceFormatError(f"option(s) {extra} do not apply to format {fmt!r} (it takes {sorted(allowed)})",
                               path=path)


def load_trace(path, format: str | None = None, skip_bad: bool = False, sort: bool = False, **options) -> Trace:
    """Load a whole trace. ``format`` one of FORMATS (or None to detect).

    ``skip_bad``: drop malformed rows and count them (``trace.skipped``,
    ``trace.meta['skipped_lines']``) instead of raising. ``sort``: accept rows
    out of arrival order (request logs are often written at completion time)
    and sort them, recording how many moved in ``meta['reordered']``.
    Format options: ServeGen takes ``seed``, ``max_requests``, ``start_s``,
    ``end_s``, ``input_field``.
    """
    p, fmt = _resolve(path, format)
    if sort and fmt != "servegen":
        options["check_order"] = False
    _check_options(fmt, options, p)
    tr = Trace.concat(list(FORMATS[fmt](p, skip_bad=skip_bad, **options)))
    if sort:
        order = np.argsort(tr.arrival_s, kind="stable")
        moved = int((order != np.arange(len(tr))).sum())
        if moved:
            tr = tr.select(order)
            if fmt not in ("servegen", "sharegpt"):  # arrivals count from the earliest request
                tr.arrival_s = tr.arrival_s - tr.arrival_s[0]
        tr.meta["reordered"] = moved
    return tr


BUNDLED = {
    "azure-conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "sharegpt": "sharegpt_lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "servegen-m-large-80": "servegen/language/m-large/chunk-80-trace.csv",
    "servegen-m-mid-81": "servegen/language/m-mid/chunk-81-trace.csv",
    "servegen-m-small-14": "servegen/language/m-small/chunk-14-trace.csv",
    "olmoe-counts": "moe_routing_olmoe/olmoe_paper_expert_counts.csv",
}


def bundled_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "traces"


def bundled_trace(name: str = "azure-conv") -> Path:
    """Path of a trace shipped with tkcc (see tkcc/data/traces/ATTRIBUTION.md)."""
    if name not in BUNDLED:
        raise TraceFormatError(f"no bundled trace {name!r}; bundled: {sorted(BUNDLED)}")
    p = bundled_dir() / BUNDLED[name]
    if not p.exists():
        raise TraceFormatError("bundled trace file is missing from this install", path=str(p))
    return p
