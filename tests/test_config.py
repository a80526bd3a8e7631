"""Declarative policies and ``torch.compile(model, backend="fxgrad", options=...)``."""

import copy
import json

import models
import pytest
import reference as ref
import torch
import torch.nn as nn
from parity import assert_grads_close

import fxgrad
from fxgrad.frontend.config import from_config
from fxgrad.frontend.named import backend_for

OPTIONS = {
    "transform": [
        {"rescale": {"alpha": 0.5, "multipliers": {"net.0": 2.0, "type:torch.nn.Linear": 1.2}}},
        {"clip_by_global_norm": {"max_norm": 1e-3}},
    ],
    "skip": ["default"],
    "compiler": "aot_eager",
}


def test_named_backend_with_options_matches_eager():
    torch.manual_seed(0)
    model = models.MLP()
    expected = copy.deepcopy(model)
    x = torch.randn(8, 16)
    compiled = torch.compile(model, backend="fxgrad", options=OPTIONS)
    models.loss_of(compiled(x)).backward()
    models.loss_of(expected(x)).backward()
    ref.rescale(expected, 0.5, multipliers=(("net.0", 2.0), (nn.Linear, 1.2)))
    ref.clip_global(expected, 1e-3)
    assert_grads_close(model, expected)
    assert backend_for(OPTIONS).transform == fxgrad.chain(
        fxgrad.rescale(alpha=0.5, multipliers={"net.0": 2.0, nn.Linear: 1.2}),
        fxgrad.clip_by_global_norm(1e-3),
    )


def test_named_backend_gives_each_model_its_own_backend():
    """Two models compiled with the same options: each keeps its layer names and state."""
    options = {
        "transform": [
            {"by_name": {"mapping": {"net.0": {"clip_by_norm": {"max_norm": 1e-3}}}}},
            {"autoclip": {"history": 4}},
        ],
        "compiler": "aot_eager",
    }
    x = torch.randn(8, 16)
    trained = []
    for sizes in ((16, 32, 4), (16, 8, 8, 4)):  # two sizes of one class: two graphs
        model = models.MLP(sizes)
        expected = copy.deepcopy(model)
        models.loss_of(torch.compile(model, backend="fxgrad", options=options)(x)).backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()  # the state moves at the step
        models.loss_of(expected(x)).backward()
        ref.clip_per_layer(expected, 1e-3, select=lambda name, _: name == "net.0")
        ref.AutoClip(90, 4, 0.1).step(expected)
        assert_grads_close(model, expected)
        trained.append(model)
    backends = [backend_for(options, model) for model in trained]
    assert backends[0] is not backends[1] and backend_for(options) is backends[1]
    assert [b.state_dict()["1.autoclip/count"].item() for b in backends] == [1, 1]


def test_policy_from_file_via_environment(tmp_path, monkeypatch):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"transform": {"clip_by_norm": {"max_norm": 1e-3}}, "compiler": "aot_eager"}))
    monkeypatch.setenv("FXGRAD_CONFIG", str(path))
    torch.manual_seed(0)
    model = models.MLP()
    expected = copy.deepcopy(model)
    x = torch.randn(8, 16)
    models.loss_of(torch.compile(model, backend="fxgrad")(x)).backward()
    models.loss_of(expected(x)).backward()
    ref.clip_per_layer(expected, 1e-3)
    assert_grads_close(model, expected)
    assert backend_for(model=model) is backend_for() is not None  # the file's backend, without its options
    assert backend_for().transform == fxgrad.clip_by_norm(1e-3)
    options = {"strict": False}  # over the file's spec, not instead of it: a policy all the same
    compiled = torch.compile(model, backend="fxgrad", options=options)
    models.loss_of(compiled(x)).backward()
    assert backend_for(options, compiled) is backend_for(options, model)  # the compiled module, or the model
    assert backend_for(options, model).transform == fxgrad.clip_by_norm(1e-3)


def test_config_file_key(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"transform": {"clip_by_value": {"clip_value": 0.1}}}))
    expected = "fxgrad.backend(clip_by_value(clip_value=0.1), compiler='inductor')"
    assert repr(from_config({"config": str(path)})) == expected


def test_config_file_keys_beside_it_override_and_schedules_take_string_steps(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(
        json.dumps(
            {
                "transform": {
                    "multi_normalize": {
                        "schedule": {"0": ["l2"], "100": ["l2", "linf"]},
                        "threshold_schedule": {"0": 0.2, "50": 0.1},
                    }
                },
                "compiler": "inductor",
            }
        )
    )
    backend = from_config({"config": str(path), "compiler": "aot_eager", "strict": False})
    assert (backend.compiler, backend.strict) == ("aot_eager", False)
    assert backend.transform == fxgrad.multi_normalize(
        schedule={0: ("l2",), 100: ("l2", "linf")}, threshold_schedule={0: 0.2, 50: 0.1}
    )
    with pytest.raises(ValueError, match="unknown config keys"):
        from_config({"config": str(path), "strikt": True})
    path.write_text(json.dumps({"config": str(path)}))
    with pytest.raises(ValueError, match="names another config file"):
        from_config({"config": str(path)})
    path.write_text("transform: {}")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_config({"config": str(path)})


def test_routers_and_skip_in_config():
    backend = from_config(
        {
            "transform": {
                "by_name": {
                    "mapping": {"*.q_proj": {"rescale": {"alpha": 0.3}}},
                    "default": {"clip_by_norm": {"max_norm": 1.0}},
                }
            },
            "skip": ["default", "type:torch.nn.Embedding", "lm_head"],
            "strict": False,
            "scope": "step",
        }
    )
    assert backend.skip == fxgrad.DEFAULT_SKIP + (nn.Embedding, "lm_head")
    assert not backend.strict
    assert backend.scope == "step"
    assert repr(backend.transform) == (
        "by_name({'*.q_proj': rescale(alpha=0.3, target='mean')}, default=clip_by_norm(max_norm=1.0))"
    )


@pytest.mark.parametrize(
    "spec,error,match",
    [
        ({"transform": {"clip_by_magic": {}}}, ValueError, "unknown transform"),
        ({"transform": {"clip_by_norm": {"max_norm": -1}}}, ValueError, "max_norm"),
        ({"transform": {"clip_by_norm": 1.0}}, TypeError, "arguments"),
        ({"transform": {"clip_by_norm": {}, "rescale": {}}}, ValueError, "a transform is"),
        ({"transform": {"by_type": {"mapping": {"torch.nn.Nope": {"rescale": {}}}}}}, ValueError, "torch.nn.Nope"),
        ({"policy": {}}, ValueError, "unknown config keys"),
        ({}, ValueError, "config names no policy"),
        ({"transform": None, "compiler": "aot_eager"}, ValueError, "config names no policy"),
        ({"skip": "default"}, TypeError, "skip"),
        ({"transform": {"chain": [{"monitor": {}}]}}, ValueError, "a chain is written as a list"),
        ({"transform": {"rescale": {"multipliers": [["*", 2.0]]}}}, TypeError, "multipliers"),
        ({"transform": {"multi_normalize": {"schedule": {"x": ["l2"]}}}}, ValueError, "schedule"),
        ({"transform": {"multi_normalize": {"schedule": {"0": ["l2"], "²": ["l2"]}}}}, ValueError, "schedule"),
        ({"transform": {"clip_by_norm": {"max_nrom": 1.0}}}, TypeError, "clip_by_norm takes no argument 'max_nrom'"),
        ({"transform": {"by_type": {"mapping": {nn.LSTM: {"monitor": {}}}}}}, TypeError, "dotted path as a string"),
        ({"transform": {"by_name": {"mapping": {1: {"monitor": {}}}}}}, TypeError, "by_name keys must be"),
        (  # two spellings of one key: refused, not merged with the last one winning
            {
                "transform": {
                    "by_type": {
                        "mapping": {
                            "torch.nn.Linear": {"monitor": {}},
                            "torch.nn.modules.linear.Linear": {"monitor": {}},
                        }
                    }
                }
            },
            ValueError,
            "by_type mapping: 'torch.nn.Linear' and 'torch.nn.modules.linear.Linear' name the same key",
        ),
        (
            {
                "transform": {
                    "rescale": {
                        "multipliers": {"type:torch.nn.Linear": 2.0, "type:torch.nn.modules.linear.Linear": 3.0}
                    }
                }
            },
            ValueError,
            "rescale multipliers: .* name the same key",
        ),
        ({"transform": {"multi_normalize": {"schedule": {"0": ["l2"], "00": ["linf"]}}}}, ValueError, "same key"),
        # where in the config a bad class or transform sits is named
        (
            {"transform": {"rescale": {"multipliers": {"type:torch.nn.NoSuch": 2.0}}}},
            ValueError,
            "rescale multipliers: cannot import class 'torch.nn.NoSuch'",
        ),
        (
            {"transform": {"by_type": {"mapping": {"torch.nn.NoSuch": {"monitor": {}}}}}},
            ValueError,
            "by_type mapping: cannot import",
        ),
        ({"transform": {"by_type": {"mapping": {}, "default": "x"}}}, ValueError, "by_type default: a transform is"),
        ({"transform": {"monitor": {}}, "skip": ["type:torch.nn.NoSuch"]}, ValueError, "skip: cannot import class"),
    ],
)
def test_bad_config_is_rejected(spec, error, match):
    with pytest.raises(error, match=match):
        from_config(spec)


@pytest.mark.parametrize("options", [None, {"compiler": "aot_eager"}], ids=["no options", "options, no policy"])
def test_named_backend_without_policy_explains(monkeypatch, options):
    monkeypatch.delenv("FXGRAD_CONFIG", raising=False)
    with pytest.raises(Exception, match="needs a policy"):
        torch.compile(nn.Linear(2, 2), backend="fxgrad", options=options)(torch.randn(1, 2))


def test_a_config_that_is_no_path_is_refused_before_it_is_opened():
    """open() takes an int as a file descriptor, and closes it: True would have closed stdout."""
    for config in (1, True):
        with pytest.raises(TypeError, match=r"config must be a path"):
            from_config({"config": config})
    with pytest.raises(TypeError, match=r"options must be a dict"):
        backend_for("clip", nn.Linear(2, 2))


def test_backend_for_checks_what_it_is_asked_for(monkeypatch):
    """Options no backend could be built from are no "not compiled yet" (None)."""
    monkeypatch.delenv("FXGRAD_CONFIG", raising=False)
    with pytest.raises(ValueError, match="no_such_rule"):
        backend_for({"transform": {"no_such_rule": {}}})
    with pytest.raises(ValueError, match="transfrom"):
        backend_for({"transfrom": {}, "transform": {"clip_by_norm": {"max_norm": 1.0}}})
    with pytest.raises(ValueError, match="needs a policy"):
        backend_for({"transfrom": {"clip_by_norm": {"max_norm": 1.0}}})
    with pytest.raises(TypeError, match=r"model must be an nn.Module"):
        backend_for({}, model="m")
    assert backend_for({"transform": {"clip_by_norm": {"max_norm": 1.0}}}) is None  # valid, not compiled yet


def test_named_backend_reports_routing_keys_that_reach_no_layer():
    options = {
        "transform": {"by_name": {"mapping": {"*nothing*": {"clip_by_norm": {"max_norm": 1.0}}}}},
        "compiler": "aot_eager",
    }
    with pytest.warns(fxgrad.CoverageWarning, match=r"by_name key '\*nothing\*' matches no layer"):
        torch.compile(models.MLP(), backend="fxgrad", options=options)(torch.randn(2, 16))


def test_backend_for_ignores_graphs_without_parameters():
    """GPT-2's forward ends in a graph with no parameters (after a graph break): the latest
    backend is still the one holding the model's layers."""
    options = {"transform": {"monitor": {}}, "compiler": "aot_eager"}
    model, args, kwargs = models.build("gpt2")
    models.loss_of(torch.compile(model, backend="fxgrad", options=options)(*args, **kwargs)).backward()
    assert backend_for(options) is backend_for(options, model)
    assert "grad_norm/transformer.wte" in backend_for(options).stats()
