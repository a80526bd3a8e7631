import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from fxgrad import _compat  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and leaves torch's global settings as it found them."""
    _compat.reset_dynamo()
    allow_rnn = _compat.dynamo_config().allow_rnn
    torch.manual_seed(0)
    yield
    _compat.dynamo_config().allow_rnn = allow_rnn
    _compat.reset_dynamo()


@pytest.fixture(params=["backend.compile", "torch.compile"])
def compile_with(request):
    """``compile_with(backend, model, **kwargs)``: compile the two ways users do,
    ``backend.compile(model)`` and ``torch.compile(model, backend=backend)``."""

    def compile_(backend, model, **kwargs):
        if request.param == "backend.compile":
            return backend.compile(model, **kwargs)
        return torch.compile(model, backend=backend, **kwargs)

    return compile_
