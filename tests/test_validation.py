"""Bad input fails at construction with TypeError/ValueError naming the argument."""

import copy
import io
import math
import re
import types

import pytest
import torch
import torch.nn as nn

import fxgrad

CASES = [
    (lambda: fxgrad.clip_by_global_norm(-1.0), ValueError, "max_norm"),
    (lambda: fxgrad.clip_by_global_norm(0.0), ValueError, "max_norm"),
    (lambda: fxgrad.clip_by_global_norm(math.nan), ValueError, "max_norm"),
    (lambda: fxgrad.clip_by_global_norm("1.0"), TypeError, "max_norm"),
    (lambda: fxgrad.clip_by_global_norm(True), TypeError, "max_norm"),
    (lambda: fxgrad.clip_by_global_norm(torch.tensor(1.0)), TypeError, "max_norm"),
    (lambda: fxgrad.clip_by_global_norm(1.0, norm_type=0), ValueError, "norm_type"),
    (lambda: fxgrad.clip_by_global_norm(1.0, norm_type=-2), ValueError, "norm_type"),
    (lambda: fxgrad.clip_by_norm(-0.5), ValueError, "max_norm"),
    (lambda: fxgrad.clip_by_norm(math.nan), ValueError, "max_norm"),
    (lambda: fxgrad.clip_by_value(-0.1), ValueError, "clip_value"),
    (lambda: fxgrad.clip_by_value(0), ValueError, "clip_value"),
    (lambda: fxgrad.clip_by_value(math.nan), ValueError, "clip_value"),
    (lambda: fxgrad.rescale(alpha=-0.5), ValueError, "alpha"),
    (lambda: fxgrad.rescale(alpha=math.inf), ValueError, "alpha"),
    (lambda: fxgrad.rescale(target="median"), ValueError, "target"),
    (lambda: fxgrad.rescale(target=-1.0), ValueError, "target"),
    (lambda: fxgrad.rescale(target=[1.0]), TypeError, "target"),
    (lambda: fxgrad.rescale(multipliers={nn.Linear: -2}), ValueError, "multipliers"),
    (lambda: fxgrad.rescale(multipliers={3: 2.0}), TypeError, "multipliers"),
    (lambda: fxgrad.rescale(multipliers=[("*", 2.0)]), TypeError, "multipliers"),
    (lambda: fxgrad.rescale(multipliers=(("a", 1.0), ("a", 2.0))), ValueError, "multipliers"),
    (lambda: fxgrad.rescale(multipliers=(("a",),)), TypeError, "multipliers"),
    (lambda: fxgrad.rescale(alpha=0), ValueError, "alpha=0"),  # a rule that does nothing
    (lambda: fxgrad.rescale(alpha=0, multipliers={"a": 1.0}, apply_to="update"), ValueError, "alpha=0"),
    (lambda: fxgrad.chain(fxgrad.clip_by_norm(1.0), "clip"), TypeError, "chain"),
    (lambda: fxgrad.chain(torch.nn.utils.clip_grad_norm_), TypeError, "chain"),
    (lambda: fxgrad.by_type({"Linear": fxgrad.clip_by_norm(1.0)}), TypeError, "by_type"),
    (lambda: fxgrad.by_type({nn.Linear: 1.0}), TypeError, "mapping"),
    (lambda: fxgrad.by_type([nn.Linear]), TypeError, "mapping"),
    (lambda: fxgrad.by_type({}, default="clip"), TypeError, "default"),
    (lambda: fxgrad.by_name({nn.Linear: fxgrad.clip_by_norm(1.0)}), TypeError, "by_name"),
    (lambda: fxgrad.rescale(target=0.1, every=10), ValueError, "every"),
    (lambda: fxgrad.rescale(every=0), ValueError, "every"),
    (lambda: fxgrad.rescale(every=2.5), TypeError, "every"),
    (lambda: fxgrad.rescale(target="ema", decay=1.0), ValueError, "decay"),
    (lambda: fxgrad.autoclip(percentile=101), ValueError, "percentile"),
    (lambda: fxgrad.autoclip(history=0), ValueError, "history"),
    (lambda: fxgrad.autoclip(history=10.0), TypeError, "history"),
    (lambda: fxgrad.autoclip(blend=0), ValueError, "blend"),
    (lambda: fxgrad.zclip(alpha=1.0), ValueError, "alpha"),
    (lambda: fxgrad.zclip(z_thresh=-1), ValueError, "z_thresh"),
    (lambda: fxgrad.zclip(max_norm=0), ValueError, "max_norm"),
    (lambda: fxgrad.zclip(warmup=0), ValueError, "warmup"),
    (lambda: fxgrad.monitor(ema=0), ValueError, "ema"),
    (lambda: fxgrad.monitor(spike_z=math.nan), ValueError, "spike_z"),
    (lambda: fxgrad.monitor(weights="yes"), TypeError, "weights"),
    (lambda: fxgrad.monitor(check_ranks=1), TypeError, "check_ranks"),
    (lambda: fxgrad.backend(fxgrad.clip_by_norm(1.0), scaler=object()), TypeError, "scaler"),
    (lambda: fxgrad.normalize("l1"), ValueError, "norm"),
    (lambda: fxgrad.normalize(2), TypeError, "norm"),
    (lambda: fxgrad.multi_normalize((1.0,)), TypeError, "norms"),
    (lambda: fxgrad.normalize(scale=0), ValueError, "scale"),
    (lambda: fxgrad.normalize(eps=-1), ValueError, "eps"),
    (lambda: fxgrad.multi_normalize(("l2", "l3")), ValueError, "norms"),
    (lambda: fxgrad.multi_normalize("l2"), TypeError, "norms"),
    (lambda: fxgrad.multi_normalize(switching_threshold=-0.1), ValueError, "switching_threshold"),
    (lambda: fxgrad.multi_normalize(schedule={5: ("l2",)}), ValueError, "schedule"),
    (lambda: fxgrad.multi_normalize(schedule=[("l2",)]), TypeError, "schedule"),
    (lambda: fxgrad.multi_normalize(("linf",), schedule={0: ("l2",)}), ValueError, "norms"),
    (
        lambda: fxgrad.multi_normalize(switching_threshold=0.5, threshold_schedule={0: 0.2}),
        ValueError,
        "switching_threshold",
    ),
    (lambda: fxgrad.multi_normalize(threshold_schedule={0: -1.0}), ValueError, "threshold_schedule"),
    (lambda: fxgrad.multi_normalize(threshold_schedule={}), TypeError, "threshold_schedule"),
    (lambda: fxgrad.multi_normalize(threshold_schedule=0), TypeError, "threshold_schedule"),
    (lambda: fxgrad.clip_by_norm(2**1100), ValueError, "max_norm"),
    (lambda: fxgrad.sinkhorn(iters=0), ValueError, "iters"),
    (lambda: fxgrad.adaptive_grad_clip(clipping=0), ValueError, "clipping"),
    (lambda: fxgrad.adaptive_grad_clip(eps=math.nan), ValueError, "eps"),
    (lambda: fxgrad.scale_by_trust_ratio(trust_coefficient=-1), ValueError, "trust_coefficient"),
    (lambda: fxgrad.scale_by_trust_ratio(min_norm=-1), ValueError, "min_norm"),
    (lambda: fxgrad.weight_norm_drift(every=0), ValueError, "every"),
    (lambda: fxgrad.weight_norm_drift(min_denominator=0), ValueError, "min_denominator"),
    (lambda: fxgrad.balance_norms(k=0), ValueError, "k"),
    (lambda: fxgrad.balance_norms(lam=-1), ValueError, "lam"),
    (lambda: fxgrad.balance_norms(entropy_drop=-0.1), ValueError, "entropy_drop"),
    (lambda: fxgrad.rescale(every=2**70), ValueError, "every"),
    (lambda: fxgrad.monitor(warmup=10**400), ValueError, "warmup"),
    (lambda: fxgrad.autoclip(history=2**40), ValueError, "history"),
    (lambda: fxgrad.zclip(warmup=2**40), ValueError, "warmup"),
    (lambda: fxgrad.sinkhorn(iters=10**6), ValueError, "iters"),
    (lambda: fxgrad.weight_norm_drift(every=10**400), ValueError, "every"),
    (lambda: fxgrad.multi_normalize(schedule={0: ("l2",), 10**400: ("linf",)}), ValueError, "schedule"),
    (lambda: fxgrad.multi_normalize(schedule={0: ("l2",), "5": ("linf",)}), ValueError, "schedule"),
    (lambda: fxgrad.rescale(target=lambda depth: 1.0), TypeError, "target"),
    (lambda: fxgrad.rescale(decay=0.5), ValueError, "decay"),
    (lambda: fxgrad.chain(), ValueError, "chain"),
    (lambda: fxgrad.by_type({}), ValueError, "mapping"),
    (lambda: fxgrad.by_name({}), ValueError, "mapping"),
    (lambda: fxgrad.backend("clip"), TypeError, "transform"),
    (lambda: fxgrad.backend(compiler="eager"), ValueError, "compiler"),
    (lambda: fxgrad.backend(compiler=["inductor"]), TypeError, "compiler"),
    (lambda: fxgrad.backend(compiler=1), TypeError, "compiler"),
    (lambda: fxgrad.backend(scope="steps"), ValueError, "scope"),
    (lambda: fxgrad.backend(scope=1), TypeError, "scope"),
    (lambda: fxgrad.backend(scope="step").step("m"), TypeError, "model"),
    (lambda: fxgrad.backend(strict="yes"), TypeError, "strict"),
    (lambda: fxgrad.backend(skip=nn.LayerNorm), TypeError, "skip"),
    (lambda: fxgrad.backend(skip="LayerNorm"), TypeError, "skip"),
    (lambda: fxgrad.backend(skip=(nn.LayerNorm, 3)), TypeError, "skip"),
    (lambda: fxgrad.backend(skip=(int,)), TypeError, "skip"),
    (lambda: fxgrad.backend(skip=("",)), ValueError, "skip"),
    (lambda: fxgrad.clip_by_norm(), TypeError, "clip_by_norm() missing 1 required positional argument"),
    (lambda: fxgrad.clip_by_norm(1.0, max_nrom=2.0), TypeError, "clip_by_norm() got an unexpected keyword"),
    (lambda: fxgrad.multi_normalize(5, schedule={0: ("l2",)}), TypeError, "norms"),
    (lambda: fxgrad.backend(scaler=torch.amp.GradScaler), TypeError, "scaler"),  # the class, not one
    (lambda: fxgrad.backend(scaler=types.SimpleNamespace(unscale_=id, update=id)), TypeError, "scaler"),
    (lambda: fxgrad.backend(scope="graph").step("m"), TypeError, "model"),  # before the scope's RuntimeError
    (lambda: fxgrad.backend(scope="graph").scaled_grads("m"), TypeError, "model"),
    (lambda: fxgrad.rescale(target=nn.Linear), TypeError, "target"),  # a class is callable, but no target
    (lambda: fxgrad.backend(skip={"lm_head": 1}), TypeError, "skip"),
    # numbers that scale or divide float32 gradients: inf (1e308) or 0 (1e-50) there
    (lambda: fxgrad.normalize(scale=1e308), ValueError, "scale"),
    (lambda: fxgrad.normalize(eps=1e-50), ValueError, "eps"),
    (lambda: fxgrad.multi_normalize(eps=1e-50), ValueError, "eps"),
    (lambda: fxgrad.rescale(alpha=0, multipliers={"a": 1e308}), ValueError, "multipliers"),
    # thresholds: 1e-300 is 0 there (every gradient clipped to 0), 1e39 overflows at the first step
    (lambda: fxgrad.clip_by_global_norm(1e-300), ValueError, "max_norm"),
    (lambda: fxgrad.clip_by_norm(1e-300), ValueError, "max_norm"),
    (lambda: fxgrad.clip_by_value(1e39), ValueError, "clip_value"),
    (lambda: fxgrad.zclip(max_norm=1e-300), ValueError, "max_norm"),
    (lambda: fxgrad.rescale(alpha=1e39), ValueError, "alpha"),
    (lambda: fxgrad.scale_by_trust_ratio(trust_coefficient=1e39), ValueError, "trust_coefficient"),
    (lambda: fxgrad.chain(fxgrad.Transform()), TypeError, "chain() argument 0"),  # the base class
    (lambda: fxgrad.backend().compile(nn.Linear(2, 2), dynamic="x"), TypeError, "dynamic"),
    (lambda: fxgrad.backend().compile(nn.Linear(2, 2), fullgraph="x"), TypeError, "fullgraph"),
    # every method that takes a model, optimizer or scaler checks it first, not deep inside
    (lambda: fxgrad.backend().compile(nn.Linear(2, 2), disable="x"), TypeError, "disable"),
    (lambda: fxgrad.backend().compile(nn.Linear(2, 2), options={1: 2}), TypeError, "options"),
    (lambda: fxgrad.backend(fxgrad.clip_by_global_norm(1.0)).transform_grads("m"), TypeError, "model"),
    (lambda: fxgrad.backend().transform_grads("m"), TypeError, "model"),  # no policy: still checked
    (lambda: fxgrad.backend().transform_grads(nn.Linear(2, 2), scaler="x"), TypeError, "scaler"),
    (lambda: fxgrad.backend().transform_grads(nn.Linear(2, 2), optimizer="x"), TypeError, "optimizer"),
    (lambda: fxgrad.backend(fxgrad.clip_by_global_norm(1.0)).check_policy_reaches("m"), TypeError, "model"),
    (lambda: fxgrad.backend(fxgrad.Transform()), TypeError, "transform"),  # the base class: no routes
    (lambda: fxgrad.backend().compile(nn.Linear(2, 2), dynamic=1), TypeError, "dynamic"),  # 1 == True
    (lambda: fxgrad.explain(nn.ModuleList([nn.Linear(2, 2)]), backend=fxgrad.backend()), TypeError, "model"),
    (lambda: fxgrad.backend(scaler=types.SimpleNamespace(unscale_=id, update=id, is_enabled=id)), TypeError, "scaler"),
    (lambda: fxgrad.step_if_finite(torch.optim.SGD, fxgrad.backend(fxgrad.skip_nonfinite())), TypeError, "optimizer"),
    # alpha > 1 reverses the layers' order, and (T / 1e-7) ** alpha overflows for a layer without gradient
    (lambda: fxgrad.rescale(alpha=1.5), ValueError, "alpha"),
]


@pytest.mark.parametrize("build,error,argument", CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_bad_input_is_rejected_at_construction(build, error, argument):
    with pytest.raises(error, match=rf"\b{re.escape(argument)}\b"):  # the argument as a word: "k" is not "mask"
        build()


@pytest.mark.parametrize("value,error", [(-1.0, ValueError), (torch.tensor(0.1), TypeError)])
def test_callable_target_returning_garbage_names_the_layer(value, error):
    backend = fxgrad.backend(fxgrad.rescale(target=lambda depth, layer: value), compiler="aot_eager")
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(error, match="(?s)target.*'0'"):
        backend.compile(model)(torch.randn(1, 2)).sum().backward()


def test_transforms_are_immutable_and_readable():
    clip = fxgrad.clip_by_norm(1.0)
    with pytest.raises(AttributeError):
        clip.max_norm = 2.0
    policy = fxgrad.chain(
        fxgrad.by_type({nn.LSTM: fxgrad.clip_by_norm(0.5)}, default=fxgrad.clip_by_norm(1.0)),
        fxgrad.rescale(alpha=0.3, multipliers={nn.Conv2d: 3.0, "*.q_proj": 1.3}),
        fxgrad.clip_by_global_norm(1.0, norm_type=math.inf),
    )
    assert repr(policy) == (
        "chain(by_type({torch.nn.LSTM: clip_by_norm(max_norm=0.5)}, default=clip_by_norm(max_norm=1.0)), "
        "rescale(alpha=0.3, target='mean', multipliers={torch.nn.Conv2d: 3.0, '*.q_proj': 1.3}), "
        "clip_by_global_norm(max_norm=1.0, norm_type=float('inf')))"
    )
    assert eval(repr(policy), {**vars(fxgrad), "torch": torch}) == policy
    assert fxgrad.clip_by_norm(1.0) == clip and hash(fxgrad.clip_by_norm(1.0)) == hash(clip)
    normalizing = fxgrad.multi_normalize(scale=0.5, eps=1e-4)
    assert repr(normalizing) == "multi_normalize(norms=('l2', 'linf'), switching_threshold=0.1, scale=0.5, eps=0.0001)"
    assert eval(repr(normalizing), vars(fxgrad)) == normalizing


def test_a_backend_reads_like_its_call():
    backend = fxgrad.backend(fxgrad.clip_by_norm(1.0), skip=(nn.LayerNorm, "*ln*"), strict=False, scope="step")
    text = "fxgrad.backend(clip_by_norm(max_norm=1.0), skip=(torch.nn.LayerNorm, '*ln*'), compiler='inductor', "
    assert repr(backend) == text + "strict=False, scope='step')"
    built = eval(repr(backend), {**vars(fxgrad), "fxgrad": fxgrad, "torch": torch})
    assert (built.transform, built.skip, built.strict, built.scope) == (backend.transform, backend.skip, False, "step")
    scaled = fxgrad.backend(fxgrad.clip_by_norm(1.0), skip=(nn.LayerNorm,), scaler=torch.amp.GradScaler("cpu"))
    assert "skip=(torch.nn.LayerNorm,)" in repr(scaled) and "scaler=<GradScaler>" in repr(scaled)


@pytest.mark.parametrize(
    "kwargs,error,argument",
    [
        ({"mode": "max-autotune"}, ValueError, "compiler='aot_eager'"),
        ({"options": {"max_autotune": True}}, ValueError, "compiler='aot_eager'"),
    ],
)
def test_inductor_settings_with_aot_eager_are_refused(kwargs, error, argument):
    backend = fxgrad.backend(fxgrad.clip_by_norm(1.0), compiler="aot_eager")
    with pytest.raises(error, match=argument):
        backend.compile(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize("kwargs,argument", [({"mode": "fast"}, "mode"), ({"options": {"no_such_knob": 1}}, "options")])
def test_unknown_inductor_settings_are_refused(kwargs, argument):
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        fxgrad.backend(fxgrad.clip_by_norm(1.0)).compile(nn.Linear(2, 2), **kwargs)


class FakeFSDP1(nn.Module):
    """Stands in for FSDP1's FullyShardedDataParallel, which needs an accelerator to build."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


@pytest.mark.parametrize("how", ["backend.compile", "torch.compile", "step"])
def test_fsdp1_is_refused_naming_the_wrapped_module(monkeypatch, how):
    """FSDP1 flattens the parameters it wraps: fxgrad sees no layers there, and refuses the
    model where it first meets it instead of applying the policy to flat shards."""
    import torch.distributed.fsdp

    monkeypatch.setattr(torch.distributed.fsdp, "FullyShardedDataParallel", FakeFSDP1)
    model = nn.Sequential(nn.Linear(2, 2), FakeFSDP1(nn.Linear(2, 2)))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager", scope="step")
    with pytest.raises(TypeError, match=r"model: Sequential holds FSDP1.*'1'.*fully_shard"):
        if how == "backend.compile":
            backend.compile(model)
        elif how == "torch.compile":
            torch.compile(model, backend=backend)
        else:
            backend.step(model)


def test_a_compiled_model_deep_copies_onto_the_same_backend_and_refuses_pickling():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1e-2), compiler="aot_eager")
    compiled = backend.compile(model)
    twin = copy.deepcopy(compiled)  # an EMA copy, say
    assert twin._orig_mod is not model and copy.deepcopy(backend) is backend
    with pytest.warns(fxgrad.CoverageWarning, match=r"copy\.deepcopy"):  # the twin's layers are renamed
        twin(torch.randn(4, 8)).sum().backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters()]))
    assert norm.item() == pytest.approx(1e-2, rel=1e-5)
    with pytest.raises(TypeError, match=r"cannot be pickled, nor a model compiled with it"):
        torch.save(compiled, io.BytesIO())


def test_numpy_strings_are_kept_as_python_strings():
    """A name read from a numpy array (``numpy.str_``) is a ``str``; kept as one, the repr
    evaluates back instead of showing ``np.str_('l2')``."""
    np = pytest.importorskip("numpy")
    rules = [
        fxgrad.normalize(np.str_("l2")),
        fxgrad.multi_normalize((np.str_("l2"), np.str_("linf"))),
        fxgrad.by_name({np.str_("fc*"): fxgrad.clip_by_norm(1.0)}),
    ]
    for rule in rules:
        assert "np.str_" not in repr(rule)
    assert eval("fxgrad." + repr(rules[0]), {"fxgrad": fxgrad}) == fxgrad.normalize("l2")
