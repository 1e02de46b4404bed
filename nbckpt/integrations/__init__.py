"""nbckpt in training code written by others: frameworks, export, plain loops.

- :mod:`nbckpt.integrations.lightning`: ``NbckptCheckpointIO`` for ``Trainer(plugins=[...])``
  (``pip install nbckpt[lightning]``);
- :mod:`nbckpt.integrations.hf`: ``NbckptCallback`` for ``transformers.Trainer``
  (``pip install nbckpt[hf]``);
- :mod:`nbckpt.integrations.accelerate`: ``AcceleratorCheckpointer``, everything an
  ``accelerate.Accelerator`` tracks (``pip install nbckpt[accelerate]``);
- :func:`export` and :func:`load`: a step directory or a pointer to one as one ``torch.load``-able
  dict (``nbckpt export STEP_DIR out.pt``).

Importing this package imports no framework: each lives in its module.
"""

from __future__ import annotations

from ._common import export, load

__all__ = ["export", "load"]
