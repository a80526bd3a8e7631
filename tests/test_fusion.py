"""Inductor fuses what fxgrad inserts into the kernels it already generates.

``torch._inductor.metrics.generated_kernel_count`` counts loop-nest variants
on CPU, not kernels, so these tests read the generated backward module and
count the kernel launches in its ``call()`` instead.
"""

import copy
import re

import pytest
import torch
import torch.nn as nn

import fxgrad
from fxgrad import _compat

pytestmark = pytest.mark.inductor

LAUNCH = re.compile(r"^\s+(cpp_fused_\w+|triton_\w+)\(", re.MULTILINE)


def backward_launches(transform, depth=8, width=32):
    """Kernel launches in the compiled backward of a ``depth``-layer MLP, and its code."""
    _compat.reset_dynamo()
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()) for _ in range(depth)]
    )
    loss = fxgrad.backend(transform).compile(model)(torch.randn(8, width)).sum()
    code = "\n".join(_compat.generated_code(loss.backward))
    return len(LAUNCH.findall(code)), code


@pytest.mark.parametrize(
    "transform",
    [
        fxgrad.clip_by_global_norm(1.0),
        fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.clip_by_norm(1.0), fxgrad.clip_by_global_norm(1.0)),
    ],
    ids=["global_clip", "rescale_per_layer_global"],
)
def test_policy_adds_at_most_one_kernel_for_24_gradients(transform):
    baseline, baseline_code = backward_launches(None)
    launches, code = backward_launches(transform)
    assert baseline > 0, "no backward code was generated"
    assert not re.search(r"\bsqrt\(", baseline_code)
    assert re.search(r"\bsqrt\(", code)  # the inserted norms are in the generated kernels
    assert launches - baseline <= 1, (baseline, launches)


def test_torch_compile_mode_and_options_reach_inductor():
    """torch.compile passes mode= and options= to a custom backend; fxgrad hands them to Inductor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    expected = copy.deepcopy(model)
    x = torch.randn(8, 16)
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-3))
    compiled = backend.compile(model, mode="max-autotune-no-cudagraphs")  # torch takes mode or options
    compiled(x).sum().backward()
    expected(x).sum().backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 1e-3)
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7)
