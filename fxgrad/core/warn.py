"""Warnings that point at the user's line.

fxgrad warns from deep inside torch: while Dynamo compiles a frame, in an
``optimizer.step()`` pre-hook, in an autograd hook during ``backward()``. A fixed
``stacklevel`` cannot name the user's line from all of those (Dynamo's depth
changes between torch releases), so :func:`warn` walks out of fxgrad's and torch's
frames and attributes the warning to the first frame of anyone else: the training
loop, or the library that drives it (Lightning, the HF Trainer)::

    warn("fxgrad: ... the policy did nothing to them.", CoverageWarning)
    # train.py:42: CoverageWarning: fxgrad: ... (the line that called backward())

Python 3.12's ``skip_file_prefixes`` does the same; this runs on 3.10 as well.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Hashable, MutableSet

import torch


class CoverageWarning(UserWarning):
    """A layer the policy targets gets no fxgrad treatment."""


_FXGRAD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = (_FXGRAD + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` at the first frame outside fxgrad and torch."""
    frame, level = sys._getframe(1), 2  # level 2 is the caller's frame
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def warn_once(told: MutableSet, key: Hashable, message: str, category: type[Warning]) -> None:
    """:func:`warn`, the first time ``key`` is told (``told``: the keys told so far, such as a
    ``WeakSet`` of optimizers)."""
    if key not in told:
        told.add(key)
        warn(message, category)
