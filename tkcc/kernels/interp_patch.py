"""The Triton interpreter without its per-call re-patching of ``triton.language``.

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` (its builtins, tensor methods, ``range``, ...)
for the interpreter, runs its programs one by one, and restores the language afterwards. But every call of a
``@triton.jit`` helper *inside* a program patches the language again (``InterpretedFunction.__call__`` calls
``_patch_lang``), scanning every module and class member with ``inspect.getmembers``: in triton 3.6 that is about
a third of the interpreter's time on kernels that call helpers (``tl.sum``, ``tl.zeros``, a norm's ``_rstd``) in
every program. The language is already patched for the whole launch, so the helper's re-patch finds nothing left
to do beyond recreating equivalent wrappers (same global interpreter builder).

:func:`install` skips a helper's re-patch when the launch in progress has already patched every language module
the helper sees (``triton.language`` / ``triton.language.core`` among its globals); a helper that sees one the
launch did not patch is patched as before. The launch's own patch and restore are unchanged. Installed by
``tkcc.kernels.common`` when the interpreter is on; a triton without these internals is left alone.
"""
from __future__ import annotations

import inspect

_installed = False


def install() -> bool:
    """Patch the interpreter once per process; False where this triton does not have the expected internals."""
    global _installed
    if _installed:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ip
    except ImportError:
        return False
    original = getattr(ip, "_patch_lang", None)
    scope_cls = getattr(ip, "_LangPatchScope", None)
    if original is None or scope_cls is None or not hasattr(scope_cls(), "restore"):
        return False
    launch: list[frozenset] = []  # the language modules patched by the launch in progress (at most one entry)

    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))

    def patch_lang(fn):
        seen = langs(fn)
        if launch:  # a helper called inside a program
            if seen <= launch[-1]:
                return scope_cls()  # already patched for this launch: nothing to restore either
            launch[-1] = launch[-1] | seen
            return original(fn)
        scope = original(fn)  # a launch: patched until its restore
        launch.append(seen)
        restore = scope.restore

        def restore_and_end():
            try:
                restore()
            finally:
                launch.clear()

        scope.restore = restore_and_end
        return scope

    ip._patch_lang = patch_lang
    _installed = True
    return True
