"""Errors tkcc raises. Each names the cause and the place (invariant 6)."""


class TkccError(Exception):
    """Base class: every error tkcc raises on bad input is one of these."""


class CaptureError(TkccError):
    """A model could not be captured as whole graphs (lists every graph break)."""


class TraceFormatError(TkccError):
    """A trace file is malformed: carries file, line and field."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None, field: str | None = None):
        where = ":".join(str(p) for p in (path, line) if p is not None)
        parts = [where] if where else []
        if field:
            parts.append(f"field {field!r}")
        super().__init__(f"{', '.join(parts)}: {message}" if parts else message)
        self.path, self.line, self.field = path, line, field


class PlanError(TkccError):
    """A pass plan names an unknown pass or an out-of-range parameter."""


class PassError(TkccError):
    """A pass produced a broken graph or changed numerics it promised to keep."""


class ArtifactError(TkccError):
    """An artifact is missing, does not match its hash, or does not load."""


class GoldenError(TkccError):
    """Golden outputs are missing or do not match."""


class EngineError(TkccError):
    """The engine refused a request (bad input, auth, limits) or a candidate failed."""


class BackendError(TkccError):
    """The ``torch.compile`` backend got an option it cannot use (names the option and what it accepts)."""
