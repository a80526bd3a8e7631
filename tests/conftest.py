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
