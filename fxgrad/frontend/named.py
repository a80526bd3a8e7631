"""The named backend: ``torch.compile(model, backend="fxgrad", options={...})``.

pyproject.toml registers :func:`fxgrad_backend` in the ``torch_dynamo_backends``
entry-point group. The policy comes from ``options`` (see :mod:`fxgrad.frontend.config`)
over the JSON file named by the ``FXGRAD_CONFIG`` environment variable, if set
(e.g. for Hugging Face's ``torch_compile_backend="fxgrad"``, which passes no
options); options without a policy and no such file are refused::

    torch.compile(model, backend="fxgrad",
                  options={"transform": {"clip_by_global_norm": {"max_norm": 1.0}}})
"""

from __future__ import annotations

import json
import os
import weakref
from typing import Any

import torch.fx
import torch.nn as nn

from fxgrad import _compat
from fxgrad.core import validate
from fxgrad.frontend.backend import Backend
from fxgrad.frontend.config import CONFIG_ENV, from_config, load
from fxgrad.passes.capture import graph_model

# One Backend per model and options, so two models never share state or layer names.
_backends: weakref.WeakKeyDictionary[nn.Module, dict[str, Backend]] = weakref.WeakKeyDictionary()
_without_model: dict[str, Backend] = {}  # graphs whose parameters no module owns
_latest: dict[str, Backend] = {}


def fxgrad_backend(
    gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None, mode: str | None = None
) -> Any:
    """Dynamo calls this once per graph; graphs of one model with the same options share
    one Backend (its state and statistics), other models get their own. ``options`` is
    the policy; ``mode`` is ``torch.compile``'s, for Inductor."""
    spec = _spec(options)
    if spec is None:
        raise ValueError(NEEDS_POLICY)
    key = _key(spec)
    if not any(isinstance(value, nn.Parameter) for value in example_inputs):
        # A graph without parameters (the code after a graph break, say) has nothing to
        # transform: any backend compiles it, and it must not become backend_for()'s answer.
        return (_latest.get(key) or from_config(spec))(gm, example_inputs, mode=mode)
    model = _compat.unwrap_model(graph_model(gm, example_inputs, list(_backends.keys())))
    table = _backends.setdefault(model, {}) if model is not None else _without_model
    if key not in table:
        table[key] = from_config(spec)
        if model is not None:
            table[key].check_policy_reaches(model)
    _latest[key] = table[key]
    return table[key](gm, example_inputs, mode=mode)


def backend_for(options: dict | None = None, model: nn.Module | None = None) -> Backend | None:
    """The Backend built for these options (none: the ``FXGRAD_CONFIG`` file's policy) and
    ``model`` (default: the one that compiled a graph last), once a graph has been
    compiled with them. Options no backend could be built from raise as ``torch.compile``
    would (``ValueError``/``TypeError``), rather than read as "not compiled yet"."""
    if model is not None:
        validate.module("model", model)
    spec = _spec(options)
    if spec is None:
        if options:  # options the named backend refuses
            raise ValueError(NEEDS_POLICY)
        return None
    if model is None:
        found = _latest.get(_key(spec))
    else:
        model = _compat.unwrap_model(model)  # the module torch.compile or fabric.setup returned: the model inside
        found = _backends.get(model, {}).get(_key(spec))
    if found is None:
        from_config(spec)  # checks the options
    return found


NEEDS_POLICY = (
    'backend="fxgrad" needs a policy: pass options={"transform": ...} (or {"config": <policy.json>}) '
    f"to torch.compile, or set {CONFIG_ENV}=<policy.json>"
)


def _spec(options: dict | None) -> dict | None:
    """``options`` over the ``FXGRAD_CONFIG`` file's spec (None: neither names a policy)."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    path = os.environ.get(CONFIG_ENV)
    spec = {**(load(path) if path else {}), **(options or {})}
    return spec if "transform" in spec or "config" in spec else None


def _key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, default=str)
