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
from dataclasses import dataclass
from pathlib import Path


class NativeBuildFailed(RuntimeError):
    """A native library could not be built (no compiler, or it failed)."""


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hyperoffload"


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeLibrary:
    """How one shared library is built: from ``source`` with ``$compiler_env`` (default ``default_compiler``) and
    ``flags`` (placed after the source, then ``-o``); ``depends_on`` is anything else its output depends on (a library
    it links against, PyTorch's version); ``what`` names it in errors."""

    source: Path
    compiler_env: str
    default_compiler: str
    flags: tuple[str, ...]
    depends_on: str = ""
    what: str

    @property
    def compiler(self) -> str:
        return os.environ.get(self.compiler_env, self.default_compiler)

    def target(self) -> Path:
        """Where the library is cached (it may not exist yet)."""
        key = hashlib.sha256(self.source.read_bytes() + self.compiler.encode() + " ".join(self.flags).encode()
                             + self.depends_on.encode()).hexdigest()[:16]
        return cache_dir() / f"{self.source.stem}-{key}.so"

    def build(self) -> Path:
        """The library, compiled the first time (``target()``); ``NativeBuildFailed`` says why when it cannot be."""
        target, compiler = self.target(), self.compiler
        if target.exists():
            return target
        if shutil.which(compiler) is None:
            raise NativeBuildFailed(f"{self.what} needs a {'C++' if self.source.suffix == '.cpp' else 'C'} compiler, "
                                    f"and {compiler!r} was not found: install one (gcc or clang; Inductor needs it on "
                                    f"the CPU too) or set {self.compiler_env}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, str(self.source), *self.flags, "-o", str(built)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise NativeBuildFailed(f"building {self.what} with {compiler} failed:\n{done.stderr.strip()[-4000:]}")
            os.replace(built, target)  # atomic: processes building at once each install a whole file
        return target


__all__ = ["NativeBuildFailed", "NativeLibrary", "cache_dir"]
