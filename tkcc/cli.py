"""The `tkcc` command. Each group of subcommands registers itself from its own module: ``tkcc/commands/``
(the API layer: they drive tkcc.compile, the engine, campaigns and the server, so no layer below imports
them), and ``tkcc.traffic.cli``, the trace tools, which need nothing but the traffic package.

A subcommand handler returns a JSON-able dict; with ``--json`` it is printed as
one JSON object on stdout, otherwise the handler's ``text`` (or a readable
rendering) is printed. A handler signals failure by raising TkccError: the
message goes to stderr and the exit code is 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from pathlib import Path

_IMPORTED = time.monotonic()

# module path -> it defines register(subparsers); missing modules are skipped
# only while an area is being built, never silently at run time of a command.
COMMAND_MODULES = [
    "tkcc.commands.compile_cmd",   # compile, passes, golden
    "tkcc.traffic.cli",            # trace stats | drift
    "tkcc.commands.engine_cmd",    # serve (and serve --http: commands.http_cmd), submit, engine status|stop
    "tkcc.commands.campaign_cmd",  # campaign, watch, report
    "tkcc.commands.export_cmd",    # export (a campaign's shipped candidate, for tkcc.load)
]


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error under ``--json`` is also one JSON object on stdout."""

    json_mode = False

    def error(self, message):
        if _Parser.json_mode:
            print(json.dumps({"error": f"{self.prog}: {message}", "type": "UsageError"}))
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tkcc", description="tkcc: a continual compiler for inference")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod_name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and mod_name.startswith(e.name):
                continue  # that area is not installed in this build
            raise
        mod.register(sub)
    return parser


def command_started() -> float:
    """``time.monotonic()`` at the moment this process started (a command's budget counts from there)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0 <= age < 3600 * 24 * 365:
            return time.monotonic() - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return _IMPORTED


def builtin_models() -> tuple[list[str], str]:
    """(names, default) of the built-in models, read without importing torch (for help texts)."""
    data = json.loads((Path(__file__).resolve().parent / "data" / "models.json").read_text())
    return [m["name"] for m in data["models"]], data["default"]


def join_negative_values(argv: list[str]) -> list[str]:
    """``--budget -5m`` -> ``--budget=-5m``: argparse reads ``-5m`` as an option and says "expected one
    argument"; joined, the option's own check names the real problem (a negative value)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if (a.startswith("--") and "=" not in a and i + 1 < len(argv)
                and re.fullmatch(r"-\.?[0-9][0-9A-Za-z.]*", argv[i + 1])):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str, sort_keys=False))
    elif isinstance(result, dict) and "text" in result:
        print(result["text"])
    else:
        print(json.dumps(result, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    from tkcc.errors import TkccError

    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    _Parser.json_mode = "--json" in argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        result = args.func(args)
    except TkccError as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        print(f"tkcc {args.command}: error: {e}", file=sys.stderr)
        return 2
    if isinstance(result, int):
        return result
    if result is not None:
        try:
            emit(result, getattr(args, "json", False))
        except BrokenPipeError:  # e.g. `tkcc ... | head`: the reader left, nothing more to say
            sys.stderr.close()
            return 0
        if isinstance(result, dict) and result.get("ok") is False:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
