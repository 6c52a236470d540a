"""PassLog: what one pass did to a Program, readable by people and by scripts.

The PassManager fills one per applied pass: what the pass says it matched and
replaced, the node names it added and removed (found by diffing each phase's
graph), where every new node came from, the time it took, the numerics check
against the previous graph, and the readable code of each phase before and
after. Logs serialise to one JSON object each and to a directory
(``NN-passname.json`` plus ``NN-passname.<phase>.before.py``/``.after.py``),
so ``tkcc passes show DIR`` can read them back without the compiler state.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tkcc.errors import TkccError


@dataclass
class PhaseLog:
    """One phase's share of a pass: node diff, provenance, readable code, numerics."""

    phase: str
    nodes_before: int = 0
    nodes_after: int = 0
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # new node name -> names of the nodes it came from (empty list: origin unknown)
    provenance: dict[str, list[str]] = field(default_factory=dict)
    code_before: str = ""
    code_after: str = ""
    # numerics against the previous graph: "exact", "tolerance", "skipped", ...
    check: str = "skipped"
    max_abs_err: float | None = None
    max_rel_err: float | None = None


@dataclass
class PassLog:
    """Per pass: identity, counts, time, per-phase diffs and code."""

    index: int
    name: str
    version: str
    params: dict
    exact: bool
    matched: int = 0
    replaced: int = 0
    time_s: float = 0.0
    check_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    kernels: dict[str, str] = field(default_factory=dict)
    phases: dict[str, PhaseLog] = field(default_factory=dict)

    # ---- derived counts over all phases -------------------------------------------------
    @property
    def added(self) -> int:
        return sum(len(p.added) for p in self.phases.values())

    @property
    def removed(self) -> int:
        return sum(len(p.removed) for p in self.phases.values())

    @property
    def stem(self) -> str:
        """File name stem in a log directory: ``03-cse``."""
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)
        return f"{self.index:02d}-{safe}"

    def summary(self) -> dict:
        """Counts only: what a report or a table shows."""
        return {
            "index": self.index,
            "name": self.name,
            "version": self.version,
            "params": self.params,
            "exact": self.exact,
            "matched": self.matched,
            "replaced": self.replaced,
            "added": self.added,
            "removed": self.removed,
            "time_s": round(self.time_s, 6),
            "check": {ph: p.check for ph, p in self.phases.items()},
            "nodes": {ph: [p.nodes_before, p.nodes_after] for ph, p in self.phases.items()},
        }

    def summary_line(self) -> str:
        checks = ",".join(sorted({p.check for p in self.phases.values()})) or "-"
        params = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return (f"{self.index:2d} {self.name:<22} v{self.version:<4} matched={self.matched:<4} "
                f"replaced={self.replaced:<4} +{self.added:<4} -{self.removed:<4} "
                f"{self.time_s * 1e3:7.1f} ms  numerics={checks}" + (f"  [{params}]" if params else ""))

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self, with_code: bool = True) -> dict:
        d = asdict(self)
        d["added"], d["removed"] = self.added, self.removed
        if not with_code:
            for p in d["phases"].values():
                p.pop("code_before", None)
                p.pop("code_after", None)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PassLog":
        try:
            phases = {k: PhaseLog(**v) for k, v in d.get("phases", {}).items()}
            keep = {k: d[k] for k in ("index", "name", "version", "params", "exact", "matched", "replaced",
                                      "time_s", "check_time_s", "notes", "kernels") if k in d}
            return cls(phases=phases, **keep)
        except TypeError as e:
            raise TkccError(f"pass log is malformed: {e}") from e


def format_logs(logs: list[PassLog]) -> str:
    """One line per pass, readable in a terminal."""
    if not logs:
        return "(no passes applied)"
    return "\n".join(log.summary_line() for log in logs)


def write_logs(logs: list[PassLog], directory: str | Path) -> Path:
    """Write ``NN-pass.json`` (without code) plus ``NN-pass.<phase>.before.py``/``.after.py``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for log in logs:
        data = log.to_json(with_code=False)
        for ph, p in log.phases.items():
            data["phases"][ph]["code_before_file"] = f"{log.stem}.{ph}.before.py"
            data["phases"][ph]["code_after_file"] = f"{log.stem}.{ph}.after.py"
            (d / f"{log.stem}.{ph}.before.py").write_text(p.code_before)
            (d / f"{log.stem}.{ph}.after.py").write_text(p.code_after)
        for kname, src in log.kernels.items():
            (d / f"{log.stem}.kernel.{re.sub(r'[^A-Za-z0-9_.-]+', '_', kname)}.py").write_text(src)
        (d / f"{log.stem}.json").write_text(json.dumps(data, indent=2, default=str))
    (d / "index.json").write_text(json.dumps([log.summary() for log in logs], indent=2, default=str))
    return d


def read_logs(directory: str | Path) -> list[PassLog]:
    """Read back what :func:`write_logs` wrote (code included)."""
    d = Path(directory)
    if not d.is_dir():
        raise TkccError(f"{d}: not a pass-log directory (expected files like 01-dce.json)")
    files = sorted(p for p in d.glob("[0-9][0-9]-*.json"))
    if not files and not (d / "index.json").exists():
        raise TkccError(f"{d}: no pass logs found (expected files like 01-dce.json)")
    logs = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise TkccError(f"{f}: pass log is not valid JSON: {e}") from e
        for p in data.get("phases", {}).values():
            for key in ("code_before", "code_after"):
                fname = p.pop(f"{key}_file", None)
                if fname and (d / fname).exists():
                    p[key] = (d / fname).read_text()
        data.pop("added", None)
        data.pop("removed", None)
        logs.append(PassLog.from_json(data))
    return logs
