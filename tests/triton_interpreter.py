"""Triton's CPU interpreter without its repeated language patching (tests only; conftest.py installs it).

Triton 3.6's interpreter patches `triton.language` for each kernel launch (`GridExecutor.__call__`) and again at
every call of a `@triton.jit` helper inside it (`InterpretedFunction.__call__`). Within one launch the second
patching finds the module already patched, so it changes nothing, but it walks the module with
`inspect.getmembers` each time: about a quarter of the interpreter's time in tests/test_triton.py (profiled
2026-12-06, 34 of 133 s at d = 128). Here a helper call skips the patching when the language modules its globals
name were patched earlier in the same launch; the first call of each launch, and any module not yet patched, still
go through Triton's own `_patch_lang`. A helper that did need the patch would fail loudly (an unpatched builtin
cannot run outside a compiled kernel), never compute something else.

Installed only for the exact Triton version it was written against; any other version runs unchanged.
"""

from __future__ import annotations

VERSION = "3.6.0"


def install() -> bool:
    """Install the shortcut; False (nothing changed) where the interpreter is not the one this was written for."""
    try:
        import triton
    except ImportError:  # not in the dev extra off Linux: the interpreter tests skip themselves
        return False
    if triton.__version__ != VERSION:
        return False
    import triton.runtime.interpreter as interp

    patch_lang, launch = getattr(interp, "_patch_lang", None), interp.GridExecutor.__call__
    if patch_lang is None or getattr(patch_lang, "_oal_shortcut", False):
        return False
    state = {"depth": 0, "patched": set()}

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is interp.tl or v is interp.tl.core}

    def patch_once(fn):
        names = langs(fn)
        if state["depth"] and names and names <= state["patched"]:
            return interp._LangPatchScope()  # nothing to restore: the launch's own scope restores the patch
        scope = patch_lang(fn)
        if state["depth"]:
            state["patched"] |= names
        return scope

    def launch_once(self, *args, **kwargs):
        outer = state["patched"]
        state["depth"] += 1
        state["patched"] = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            state["patched"] = outer

    patch_once._oal_shortcut = True
    interp._patch_lang = patch_once
    interp.GridExecutor.__call__ = launch_once
    return True
