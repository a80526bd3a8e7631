"""The named backend: ``torch.compile(model, backend="fxgrad", options={...})``.

pyproject.toml registers :func:`fxgrad_backend` in the ``torch_dynamo_backends``
entry-point group. The policy comes from ``options`` (see :mod:`fxgrad.config`),
or, when there are none (e.g. Hugging Face's ``torch_compile_backend="fxgrad"``),
from the JSON file named by the ``FXGRAD_CONFIG`` environment variable::

    torch.compile(model, backend="fxgrad",
                  options={"transform": {"clip_by_global_norm": {"max_norm": 1.0}}})
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch.fx

from fxgrad.backend import Backend
from fxgrad.config import CONFIG_ENV, from_config, load

_backends: dict[str, Backend] = {}


def fxgrad_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Any:
    """Dynamo calls this once per graph; graphs with the same options share one Backend."""
    spec = dict(options or {})
    if not spec:
        path = os.environ.get(CONFIG_ENV)
        if not path:
            raise ValueError(
                'backend="fxgrad" needs a policy: pass options={"transform": ...} to '
                f"torch.compile, or set {CONFIG_ENV}=<policy.json>"
            )
        spec = load(path)
    key = json.dumps(spec, sort_keys=True, default=str)
    if key not in _backends:
        _backends[key] = from_config(spec)
    return _backends[key](gm, example_inputs)


def backend_for(options: dict) -> Backend | None:
    """The Backend built for these options, once a graph has been compiled with them."""
    return _backends.get(json.dumps(options, sort_keys=True, default=str))
