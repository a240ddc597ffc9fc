"""Package attributes imported on first use (PEP 562), so that importing a package, or a small module inside it,
does not import torch and everything else the package offers: the command line answers ``--help`` at once."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping


class LazyPackage(types.ModuleType):
    """A package whose exported attributes (``_lazy_where``: name -> the module defining it) load on first read.

    Importing a submodule sets an attribute of its package to it; where an exported attribute has a submodule's
    name (``hyperoffload.simulate``, the function, and ``hyperoffload/simulate.py``), the attribute wins, as it did
    when the package imported everything up front."""

    _lazy_where: Mapping[str, str]

    def __getattr__(self, name: str) -> object:
        where = self.__dict__.get("_lazy_where", {})
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
        elif name.startswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        else:
            try:
                value = importlib.import_module(f"{self.__name__}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{self.__name__}.{name}":
                    raise
                raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and name in self.__dict__.get("_lazy_where", {}):
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list:
        return sorted({*self.__dict__, *self.__dict__.get("_lazy_where", {})})


def lazy_package(name: str, where: Mapping[str, str]) -> None:
    """Make the package ``name`` (call it as ``lazy_package(__name__, {...})`` in its ``__init__``) load each
    attribute ``attr`` from the module ``where[attr]`` when first read."""
    module = sys.modules[name]
    module.__class__ = LazyPackage
    types.ModuleType.__setattr__(module, "_lazy_where", dict(where))


__all__ = ["LazyPackage", "lazy_package"]
