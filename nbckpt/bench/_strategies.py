"""Every checkpoint strategy by name: the nine built in, and yours.

Add your own::

    @register_strategy
    class MyStrategy(Strategy):
        name = "mine"
        def save(self, state, step): ...

The interface and the strategies without a process group are in :mod:`._strategy`, DCP's in
:mod:`._dcp`; the built-ins are registered here, in the order that help texts list them.
"""

from __future__ import annotations

from typing import Any, TypeVar

from .._errors import ConfigError
from ._dcp import DcpAsync, DcpAsyncProcess, DcpAsyncStager, DcpSync
from ._strategy import NbckptAsync, NbckptAsyncOverlap, NbckptSync, NoCheckpoint, Strategy, TorchSave

__all__ = ["STRATEGIES", "get_strategy", "register_strategy"]

S = TypeVar("S", bound=type[Strategy])

#: Every strategy by name; :func:`register_strategy` adds yours.
STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: S) -> S:
    """Class decorator: make ``cls`` available by its ``name`` (replacing one of the same name)."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"{cls!r} is not a Strategy subclass")
    if not cls.name or not isinstance(cls.name, str) or "/" in cls.name:
        raise ConfigError(f"strategy {cls.__name__} needs a plain name (a class attribute 'name')")
    STRATEGIES[cls.name] = cls
    return cls


def get_strategy(name: str | Strategy, **options: Any) -> Strategy:
    """A fresh strategy by name (``options`` go to its constructor), or ``name`` itself."""
    if isinstance(name, Strategy):
        return name
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return cls(**options)


for _built_in in (NoCheckpoint, TorchSave, DcpSync, DcpAsync, DcpAsyncProcess, DcpAsyncStager,
                  NbckptSync, NbckptAsync, NbckptAsyncOverlap):
    register_strategy(_built_in)
