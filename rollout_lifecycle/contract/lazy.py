"""Names a package exports whose modules load only when first asked for (PEP 562): the package
root's backends (they bring httpx and Ray) and the test kit's actor fleets (Ray)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, namespace: dict[str, Any], where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package`` (whose globals are
    ``namespace``) that import each name of ``where`` from its module on first access and keep
    it, so that later lookups are plain ones."""

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *where})

    return getattr_, dir_


__all__ = ["lazy_names"]
