"""Shared libraries of the native runtime, compiled from the sources next to this file on first use and cached.

Both ``copy_thread.c`` (the ``NativeLink``'s copy thread) and ``cache_kernels.cpp`` (the cache operators' C++
kernels) are built with the machine's compiler into ``~/.cache/hyperoffload`` (``$XDG_CACHE_HOME``), under a name
keyed by everything the build depends on, so a changed source, compiler or PyTorch builds a new file and processes
building at once each install a whole one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


class NativeBuildFailed(RuntimeError):
    """A native library could not be built (no compiler, or it failed)."""


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hyperoffload"


def library_target(source: Path, *, compiler: str, flags: Sequence[str], depends_on: str = "") -> Path:
    """Where the library built from ``source`` with ``compiler`` and ``flags`` is cached (it may not exist yet)."""
    key = hashlib.sha256(source.read_bytes() + compiler.encode() + " ".join(flags).encode()
                         + depends_on.encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def built_library(source: Path, *, compiler_env: str, default_compiler: str, flags: Sequence[str],
                  depends_on: str = "", what: str) -> Path:
    """The shared library built from ``source`` with ``$compiler_env`` (default ``default_compiler``) and ``flags``
    (placed after the source, then ``-o``); ``depends_on`` is anything else the build's output depends on (a
    library it links against, PyTorch's version). ``what`` names the library in errors."""
    compiler = os.environ.get(compiler_env, default_compiler)
    target = library_target(source, compiler=compiler, flags=flags, depends_on=depends_on)
    if target.exists():
        return target
    if shutil.which(compiler) is None:
        raise NativeBuildFailed(f"{what} needs a {'C++' if source.suffix == '.cpp' else 'C'} compiler, and "
                                f"{compiler!r} was not found: install one (gcc or clang; Inductor needs it on the CPU "
                                f"too) or set {compiler_env}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, str(source), *flags, "-o", str(built)], capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildFailed(f"building {what} with {compiler} failed:\n{done.stderr.strip()[-4000:]}")
        os.replace(built, target)  # atomic: processes building at once each install a whole file
    return target


__all__ = ["NativeBuildFailed", "built_library", "cache_dir", "library_target"]
