"""Turn a failed capture into a CaptureError that lists each graph break: file, line, reason, fix.

``torch.export`` stops at the first problem; ``torch._dynamo.explain`` runs the
model once and collects every place where one graph would have to be cut, with
the user frame and dynamo's reason. Both are reported: the explain list (every
break) and the export failure with its innermost user frame (the one that made
capture fail, which dynamo may handle differently).
"""
from __future__ import annotations

import logging
import os
import re
import traceback
from dataclasses import dataclass

import torch

from tkcc.errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)

# (pattern in dynamo's reason, what to change); first match wins.
_FIXES = [
    (r"item\(\)|capture_scalar_outputs|tolist|Tensor\.item",
     "keep the value as a tensor: replace .item()/.tolist()/int(tensor) by tensor ops (torch.where, masks); a Python "
     "number read from a tensor cannot live inside one graph"),
    (r"`print`|builtin operator `print`|logging|reorderable_logging",
     "remove the print/logging call from forward (or guard it with `if not torch.compiler.is_compiling():`)"),
    (r"[Dd]ata-dependent|data dependent|generic_jump|jump|branch|GuardOnDataDependent|guard on data-dependent",
     "replace Python control flow on a tensor value (if/while/bool(tensor)) by torch.where or torch.cond, or make "
     "the condition depend on shapes/constants only"),
    (r"nonzero|dynamic shape operator|DynamicOutputShape|output shape depends",
     "use a fixed-shape formulation (masks, torch.topk with a fixed k, gather) instead of an op whose output shape "
     "depends on tensor values; for Hugging Face MoE models set config._experts_implementation = 'batched_mm'"),
    (r"numpy|np\.",
     "use torch ops instead of numpy inside forward"),
    (r"skip|disable|SKIP_DIRS|not supported|Unsupported",
     "move the unsupported Python call out of forward, or rewrite it with torch ops"),
]


@dataclass
class GraphBreak:
    """One place where the model cannot stay inside one graph."""

    file: str
    line: int
    function: str
    code: str
    reason: str
    fix: str

    def format(self, i: int) -> str:
        where = f"{self.file}:{self.line} in {self.function}"
        code = f"\n       code:   {self.code.strip()}" if self.code else ""
        return f"  {i}. {where}{code}\n       reason: {self.reason}\n       change: {self.fix}"


def suggest_fix(reason: str) -> str:
    """What to change in the model for a break with this reason."""
    for pattern, fix in _FIXES:
        if re.search(pattern, reason):
            return fix
    hints = [ln.split("Hint:", 1)[1].strip() for ln in reason.splitlines() if "Hint:" in ln]
    return "; ".join(hints) if hints else "rewrite this statement with torch tensor ops"


def _short_reason(text: str) -> str:
    """First line of dynamo's reason plus its 'Explanation:' line, without developer context."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown"
    parts = [lines[0]]
    parts += [ln.split("Explanation:", 1)[1].strip() for ln in lines if ln.startswith("Explanation:")]
    return " — ".join(parts)


def explain_breaks(module, args: tuple) -> list[GraphBreak]:
    """Every graph break dynamo finds when running ``module(*args)`` once (runs the model)."""
    dyn_log = logging.getLogger("torch._dynamo")
    old_level = dyn_log.level
    dyn_log.setLevel(logging.ERROR)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            result = torch._dynamo.explain(module)(*args)
    finally:
        dyn_log.setLevel(old_level)
        torch._dynamo.reset()
    breaks = []
    for br in result.break_reasons:
        stack = list(br.user_stack or [])
        frame = stack[-1] if stack else None
        breaks.append(GraphBreak(
            file=frame.filename if frame else "<unknown>",
            line=frame.lineno if frame else 0,
            function=frame.name if frame else "?",
            code=(frame.line or "") if frame else "",
            reason=_short_reason(br.reason),
            fix=suggest_fix(br.reason),
        ))
    return _dedupe(breaks)


def _dedupe(breaks: list[GraphBreak]) -> list[GraphBreak]:
    seen, out = set(), []
    for b in breaks:
        key = (b.file, b.line, b.reason)
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


def failure_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """Innermost frame of the failure that is user code (outside torch)."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not f.filename.startswith(_TORCH_DIR) and "/tkcc/frontend/" not in f.filename]
    if user:
        return user[-1]
    m = re.search(r"Caused by: \((.+?):(\d+) in (\w+)\)", str(exc))
    if m:
        return traceback.FrameSummary(m.group(1), int(m.group(2)), m.group(3))
    return None


def capture_error_from_failure(module, args: tuple, exc: BaseException, what: str = "model") -> CaptureError:
    """A CaptureError listing each graph break of ``module(*args)`` and the export failure."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    first = f"{type(exc).__name__}: {first}"
    frame = failure_frame(exc)
    export_break = GraphBreak(
        file=frame.filename if frame else "<unknown>", line=frame.lineno if frame else 0,
        function=frame.name if frame else "?", code=(frame.line or "") if frame else "",
        reason=first, fix=suggest_fix(str(exc)))
    try:
        breaks = explain_breaks(module, args)
        explain_note = ""
    except Exception as e2:  # noqa: BLE001 - explain is best effort; export's own failure is still reported
        breaks = []
        explain_note = f"\n(torch._dynamo.explain could not run: {type(e2).__name__}: {str(e2).splitlines()[0] if str(e2) else ''})"
    if not any((b.file, b.line) == (export_break.file, export_break.line) for b in breaks):
        breaks.append(export_break)
    name = type(module).__name__
    lines = [f"cannot capture {what} {name} as one whole graph: {len(breaks)} graph break(s)"]
    lines += [b.format(i + 1) for i, b in enumerate(breaks)]
    lines.append(f"torch.export failed with {first}" + explain_note)
    err = CaptureError("\n".join(lines))
    err.breaks = breaks
    return err


# (pattern in the failure, what to configure, whether it applies only where the failure is in MoE experts' code): a
# library model is configured, never rewritten.
_LIBRARY_FIXES = [
    (r"nonzero|DynamicOutputShape|dynamic shape operator|data-dependent|GuardOnDataDependent",
     "a data-dependent op inside the model's MoE experts; set config._experts_implementation = 'batched_mm' (a "
     "fixed-shape experts implementation) before capture", True),
    (r"flash_attn|flex_attention|BlockMask",
     "set config._attn_implementation = 'sdpa' before capture", False),
]


def _in_experts(frame, module: str | None) -> bool:
    """Whether export stopped in a mixture of experts' code (the module or the function says so)."""
    return "expert" in f"{module or ''} {frame.name if frame else ''}".lower()


def library_failure(model, what: str, exc: BaseException, where: str, supported: str) -> CaptureError:
    """A CaptureError for a library model (a Hugging Face ``*ForCausalLM``) that ``torch.export`` could not trace.

    Unlike a user's module, the model's code is not the user's to rewrite: the error leads with tkcc's own
    frame (``where``) and the reason, says in which of the model's modules and lines export stopped, and
    offers a configuration change where one is known, else what tkcc does capture (``supported``)."""
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    frame = failure_frame(exc)
    module = _failing_module(model, exc)
    at = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else "an unknown line"
    inside = f" (module {module})" if module else ""
    fix = next((f for pat, f, moe in _LIBRARY_FIXES
                if re.search(pat, str(exc)) and (not moe or _in_experts(frame, module))), None)
    cfg = getattr(model, "config", None)
    kind = getattr(cfg.get_text_config(), "model_type", "?") if cfg is not None else "?"
    msg = (f"{where}: cannot capture {what} {type(model).__name__} (model_type {kind!r}) as one graph: "
           f"torch.export stopped at {at}{inside}: {reason}\n"
           + (f"  what to do: {fix}" if fix else f"  tkcc does not capture this model's code yet; it captures "
                                                 f"{supported}"))
    err = CaptureError(msg)
    err.breaks = [GraphBreak(file=frame.filename if frame else "<unknown>", line=frame.lineno if frame else 0,
                             function=frame.name if frame else "?", code=(frame.line or "") if frame else "",
                             reason=reason, fix=fix or "not supported by tkcc's capture")]
    return err


def _failing_module(model, exc: BaseException) -> str | None:
    """'<path> (<class>)' of the innermost module of ``model`` whose code was running when ``exc`` was raised."""
    paths = {id(m): p for p, m in model.named_modules()}
    tb, found = exc.__traceback__, None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, torch.nn.Module) and id(obj) in paths and paths[id(obj)]:
            found = f"{paths[id(obj)]}, {type(obj).__name__}"
        tb = tb.tb_next
    return found
