"""pytest plug-in for Lightning's own tests: nbckpt's ``NbckptCheckpointIO`` as every strategy's
default checkpoint IO (``-p nbckpt_peer_io``, see run_lightning.sh).

Besides the IO, it bridges the two differences of layout docs/integrations.md documents, so that
a test that looks at the files reads what the plug-in saved: ``torch.load`` and Lightning's
``pl_load`` (``Model.load_from_checkpoint``) of a pointer read it with
:func:`nbckpt.integrations.lightning.load_checkpoint` (users: that, ``load_from_checkpoint`` or
``nbckpt.integrations.export``; plain ``torch.load`` raises a message naming them), and listings
of a checkpoint directory (``os.listdir``, ``glob``, ``Path.iterdir``, ``Path.glob``) leave out
nbckpt's hidden ``.nbckpt`` folder. Nothing else. Set NBCKPT_PEER_SHIMS=0 to run without them.
"""

from __future__ import annotations

import functools
import glob
import os
import pathlib
from typing import Any

import lightning.fabric.plugins.io.torch_io as fabric_torch_io
import lightning.fabric.utilities.cloud_io as cloud_io
import lightning.pytorch.core.saving as saving
import lightning.pytorch.strategies.strategy as strategy_module
import torch

from nbckpt.integrations._common import read_pointer
from nbckpt.integrations.lightning import ROOT_NAME, NbckptCheckpointIO, load_checkpoint


def _is_name(path: Any) -> bool:
    """Whether ``path`` is a name the plug-in saved: a pointer, or a reservation of one."""
    try:
        return isinstance(path, (str, os.PathLike)) and read_pointer(path) is not None
    except OSError:
        return False


def _reads_pointers(load: Any) -> Any:
    @functools.wraps(load)
    def wrapper(f: Any, *args: Any, map_location: Any = None, **kwargs: Any) -> Any:
        if _is_name(f):
            return load_checkpoint(f, None if callable(map_location) else map_location)
        return load(f, *args, map_location=map_location, **kwargs)

    return wrapper


def _hides_root(listing: Any) -> Any:
    """``listing`` without nbckpt's directory (``ROOT_NAME``) among the names it gives."""

    @functools.wraps(listing)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        found = listing(*args, **kwargs)
        names = [e for e in found if os.path.basename(os.fspath(e)) != ROOT_NAME]
        return names if isinstance(found, list) else iter(names)

    return wrapper


def pytest_configure() -> None:
    strategy_module.TorchCheckpointIO = NbckptCheckpointIO  # type: ignore[misc]  # what the default builds
    if os.environ.get("NBCKPT_PEER_SHIMS", "1") != "0":
        torch.load = _reads_pointers(torch.load)
        pl_load = _reads_pointers(cloud_io._load)
        cloud_io._load = saving.pl_load = fabric_torch_io.pl_load = pl_load
        os.listdir = _hides_root(os.listdir)
        glob.glob = _hides_root(glob.glob)
        pathlib.Path.iterdir = _hides_root(pathlib.Path.iterdir)  # type: ignore[method-assign]
        pathlib.Path.glob = _hides_root(pathlib.Path.glob)  # type: ignore[method-assign]
