"""Compiled gradients equal the eager reference on real architectures.

Every policy runs on every model under ``aot_eager``; a focused set also runs
under Inductor (CPU). Thresholds are small so that clipping is active.
"""

import math

import pytest
import reference as ref
import torch.nn as nn
from parity import check_parity

import fxgrad

MODELS = ["mlp", "cnn", "parametrized", "transformer", "lstm", "gpt2", "bert", "llama", "t5", "mobilebert"]


def depth_target(depth, layer):
    """Amplify shallow layers: 3x the target at the input, 1x at the output."""
    return 0.01 * (1 + 2 * (1 - depth))


POLICIES = {
    "global_l2": (fxgrad.clip_by_global_norm(0.01), lambda m: ref.clip_global(m, 0.01)),
    "global_inf": (
        fxgrad.clip_by_global_norm(1e-3, norm_type=math.inf),
        lambda m: ref.clip_global(m, 1e-3, math.inf),
    ),
    "global_l1": (fxgrad.clip_by_global_norm(0.05, norm_type=1), lambda m: ref.clip_global(m, 0.05, 1.0)),
    "per_layer": (fxgrad.clip_by_norm(0.003), lambda m: ref.clip_per_layer(m, 0.003)),
    "value": (fxgrad.clip_by_value(1e-3), lambda m: ref.clip_value(m, 1e-3)),
    "rescale_mean": (fxgrad.rescale(alpha=0.5), lambda m: ref.rescale(m, 0.5)),
    "rescale_const_multipliers": (
        fxgrad.rescale(alpha=0.3, target=0.02, multipliers={"*.mlp.*": 1.5, nn.Linear: 1.2}),
        lambda m: ref.rescale(m, 0.3, 0.02, multipliers=(("*.mlp.*", 1.5), (nn.Linear, 1.2))),
    ),
    "rescale_then_global": (
        fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.clip_by_global_norm(0.01)),
        lambda m: (ref.rescale(m, 0.5), ref.clip_global(m, 0.01)),
    ),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_name", MODELS)
def test_parity_aot_eager(model_name, policy):
    transform, reference = POLICIES[policy]
    check_parity(model_name, transform, reference)


@pytest.mark.parametrize("policy", ["per_layer", "rescale_then_global"])
@pytest.mark.parametrize("model_name", ["parametrized", "mobilebert"])
def test_layers_in_step_scope(model_name, policy):
    """Step scope, too, puts a parametrized weight's originals in the module it parametrizes, and
    skips MobileBERT's NoNorm layers by their name (``...LayerNorm``)."""
    transform, reference = POLICIES[policy]
    check_parity(model_name, transform, reference, scope="step")


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_rescale_depth_target(model_name):
    """A callable target sees the layer's depth in forward order (0 = first layer)."""
    import models

    model, args, _ = models.build(model_name)
    order = ref.forward_order(model, *args)
    depths = {name: i / (len(order) - 1) for i, name in enumerate(order)}
    check_parity(
        model_name,
        fxgrad.rescale(alpha=0.5, target=depth_target),
        lambda m: ref.rescale(m, 0.5, lambda d, name: depth_target(d, None), depths=depths),
    )


def test_by_type_lstm_half_others_one():
    """The headline RNN policy: LSTM layers clipped to 0.5, every other layer to 1.0."""
    policy = fxgrad.by_type({nn.LSTM: fxgrad.clip_by_norm(0.005)}, default=fxgrad.clip_by_norm(0.01))

    def reference(m):
        ref.clip_per_layer(m, 0.005, select=lambda name, module: isinstance(module, nn.LSTM))
        ref.clip_per_layer(m, 0.01, select=lambda name, module: not isinstance(module, nn.LSTM))

    check_parity("lstm", policy, reference)


def test_by_name_routes_by_pattern():
    policy = fxgrad.by_name({"blocks.0.*": fxgrad.clip_by_norm(0.001)}, default=fxgrad.clip_by_value(1e-4))

    def reference(m):
        ref.clip_per_layer(m, 0.001, select=lambda name, module: name.startswith("blocks.0."))
        for name, _, params in ref.trainable_layers(m):
            if not name.startswith("blocks.0."):
                import torch

                torch.nn.utils.clip_grad_value_(params, 1e-4)

    check_parity("transformer", policy, reference)


def test_by_type_global_norm_per_type():
    """A group transform under a router reduces over that type only: clipping per layer type."""
    policy = fxgrad.by_type({nn.Conv2d: fxgrad.clip_by_global_norm(0.01)})

    def reference(m):
        import torch

        convs = [p for _, mod, ps in ref.trainable_layers(m) if isinstance(mod, nn.Conv2d) for p in ps]
        torch.nn.utils.clip_grad_norm_(convs, 0.01)

    check_parity("cnn", policy, reference)


def test_skip_off_rescales_norm_layers():
    import copy

    import models
    from parity import assert_grads_close, eager_grads

    model, args, kwargs = models.build("mlp")
    expected = copy.deepcopy(model)
    backend = fxgrad.backend(fxgrad.clip_by_norm(1e-3), skip=(), compiler="aot_eager")
    models.loss_of(backend.compile(model)(*args)).backward()
    eager_grads(expected, args, kwargs)
    for _, _, params in ref.trainable_layers(expected, skip_norm=False):
        import torch

        torch.nn.utils.clip_grad_norm_(params, 1e-3)
    assert_grads_close(model, expected)


INDUCTOR_CASES = [
    ("mlp", "rescale_then_global"),
    ("cnn", "per_layer"),
    ("gpt2", "rescale_then_global"),
    ("llama", "value"),
]


@pytest.mark.inductor
@pytest.mark.parametrize("model_name,policy", INDUCTOR_CASES)
def test_parity_inductor(model_name, policy):
    transform, reference = POLICIES[policy]
    check_parity(model_name, transform, reference, compiler="inductor")
