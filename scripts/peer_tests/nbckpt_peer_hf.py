"""pytest plug-in for transformers' own Trainer tests: ``NbckptCallback`` added to every Trainer, as
a user adds it (``-p nbckpt_peer_hf``, see run_transformers.sh).

Each ``Trainer(args=...)`` gets ``NbckptCallback(<directory>)`` after the test's own callbacks, one
nbckpt directory per ``output_dir``, kept outside it (in a folder of this test's, removed after it),
so that ``output_dir`` holds only what the Trainer itself writes. A new Trainer for an ``output_dir``
whose callback is still open closes that one first, as a user closes a callback before opening its
directory again. Where a test resumes, ``train(resume_from_checkpoint=...)`` goes through
``cb.resume_checkpoint()``, as docs/integrations.md tells users: ``True`` is the newest step,
``<output_dir>/checkpoint-N`` (a folder the Trainer did not write) step N of that ``output_dir``'s
directory. Anything else is passed on as it is (a bogus path, a folder the Trainer wrote itself).
Nothing else is bridged: no ``checkpoint-N`` folder is made up where a test looks for one.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import re
import shutil
import tempfile
from typing import Any

import transformers

from nbckpt.integrations.hf import NbckptCallback

#: This test's folder of nbckpt directories (one per output_dir).
_base: str | None = None
#: The open callback of each output_dir (absolute), the newest Trainer's.
_open: dict[str, NbckptCallback] = {}


def _callback_for(output_dir: str) -> NbckptCallback:
    if _base is None:
        raise RuntimeError("nbckpt_peer_hf: a Trainer made outside a test")
    out = os.path.abspath(output_dir)
    old = _open.pop(out, None)
    if old is not None:
        old.close()
    callback = NbckptCallback(os.path.join(_base, hashlib.sha1(out.encode()).hexdigest()[:12]))
    _open[out] = callback
    return callback


def _resume_folder(trainer: Any, resume: Any) -> Any:
    """What ``resume_from_checkpoint`` names, as a folder ``cb.resume_checkpoint()`` writes."""
    if resume is True:
        callback = _open.get(os.path.abspath(trainer.args.output_dir))
        folder = callback.resume_checkpoint() if callback is not None else None
        return resume if folder is None else folder  # no step: the Trainer's own error
    if isinstance(resume, (str, os.PathLike)) and not os.path.isdir(resume):
        path = os.path.abspath(os.fspath(resume))
        named = re.fullmatch(r"checkpoint-([0-9]+)", os.path.basename(path))
        callback = _open.get(os.path.dirname(path))
        if named and callback is not None and int(named[1]) in callback.ckpt.steps():
            return callback.resume_checkpoint(step=int(named[1]))
    return resume


def _wrap_trainer() -> None:
    init, train = transformers.Trainer.__init__, transformers.Trainer.train
    signature = inspect.signature(init)

    @functools.wraps(init)
    def with_callback(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        training_args = bound.arguments.get("args")
        if training_args is not None:  # (a Trainer made without args writes no checkpoint in these tests)
            given = list(bound.arguments.get("callbacks") or [])
            bound.arguments["callbacks"] = [*given, _callback_for(training_args.output_dir)]
        init(*bound.args, **bound.kwargs)

    @functools.wraps(train)
    def resuming(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        return train(self, _resume_folder(self, resume_from_checkpoint), *args, **kwargs)

    transformers.Trainer.__init__ = with_callback
    transformers.Trainer.train = resuming


def pytest_configure() -> None:
    _wrap_trainer()


def pytest_runtest_setup() -> None:
    global _base
    _base = tempfile.mkdtemp(prefix="nbckpt-peer-hf-")


def pytest_runtest_teardown() -> None:
    global _base
    while _open:
        _open.popitem()[1].close()
    if _base is not None:
        shutil.rmtree(_base, ignore_errors=True)
        _base = None
