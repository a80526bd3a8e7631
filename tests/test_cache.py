"""A changed policy never reuses a stale compiled backward, across processes.

AOTAutograd's on-disk cache is keyed on the forward graph. Each step below
runs in a fresh process sharing one TORCHINDUCTOR_CACHE_DIR. Step scope leaves
the backward alone and uses that cache as a plain compile does; graph scope
uses it under a key that also holds the policy (fxgrad.frontend.warm_start).
"""

import json
import os
import subprocess
import sys

import pytest

from fxgrad import _compat

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

PROBE = os.path.join(os.path.dirname(__file__), "cache_probe.py")


def step(policy, cache_dir):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    out = subprocess.run(
        [sys.executable, PROBE, policy], env=env, check=True, capture_output=True, text=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_policy_changes_survive_the_on_disk_caches(tmp_path):
    plain = step("none", tmp_path)
    assert plain["norm"] > 0.1
    assert step("0.001", tmp_path)["norm"] == pytest.approx(1e-3, rel=1e-4)
    assert step("0.01", tmp_path)["norm"] == pytest.approx(1e-2, rel=1e-4)
    again = step("none", tmp_path)
    assert again["aot_cache_hits"] >= 1  # the cache is live, so the test can catch a stale hit
    assert again["norm"] == pytest.approx(plain["norm"], rel=1e-6)


def test_step_scope_restarts_from_the_caches_and_graph_scope_never_takes_their_entries(tmp_path):
    plain = step("none", tmp_path)
    assert step("step:0.001", tmp_path)["norm"] == pytest.approx(1e-3, rel=1e-4)
    warm = step("step:0.001", tmp_path)  # a restart: the model's graphs and the step program come from disk
    assert warm["aot_cache_hits"] >= 1  # forward and backward
    assert warm["fx_graph_cache_hits"] >= 3  # the same, and the step program
    assert warm["norm"] == pytest.approx(1e-3, rel=1e-4)
    assert step("step:0.01", tmp_path)["norm"] == pytest.approx(1e-2, rel=1e-4)  # not the other program
    assert step("0.002", tmp_path)["norm"] == pytest.approx(2e-3, rel=1e-4)  # not the plain backward
    again = step("none", tmp_path)
    assert again["aot_cache_hits"] >= 1
    assert again["norm"] == pytest.approx(plain["norm"], rel=1e-6)  # not graph scope's backward


def test_graph_scope_restarts_from_the_caches_with_its_state(tmp_path):
    cold = step("stateful", tmp_path)
    warm = step("stateful", tmp_path)  # a restart: forward and rewritten backward come from disk
    assert (cold["aot_cache_hits"], warm["aot_cache_hits"]) == (0, 1)
    assert warm["fx_graph_cache_hits"] >= 2
    assert cold["stats"] and warm["stats"] == pytest.approx(cold["stats"], rel=1e-6)  # state carried 3 steps
    assert warm["norm"] == pytest.approx(cold["norm"], rel=1e-6)
    assert step("0.001", tmp_path)["norm"] == pytest.approx(1e-3, rel=1e-4)  # another policy: not its entry


def test_a_backward_whose_layers_differ_from_the_stand_in_is_not_saved(tmp_path):
    # The last layer requires grad but gets none: the real backward's state differs from the
    # stand-in's, which is all a later process would register before loading it.
    first = step("detached", tmp_path)
    again = step("detached", tmp_path)
    assert (first["aot_cache_saved"], again["aot_cache_hits"]) == (0, 0)
    assert again["stats"] == pytest.approx(first["stats"], rel=1e-6)


def test_the_cache_key_keeps_the_passes_the_settings_held():
    """A user's own post-grad pass still runs, and still keys the caches, beside fxgrad's key."""

    class Mine(_compat._CustomGraphPass):
        def __init__(self, key):
            self.key, self.ran = key, 0

        def __call__(self, graph):
            self.ran += 1

        def uuid(self):
            return self.key

    mine = Mine("mine")
    passes = _compat.cache_keyed({"post_grad_custom_post_pass": mine}, "policy")["post_grad_custom_post_pass"]
    passes = passes if isinstance(passes, tuple) else (passes,)  # torch before 2.13 takes one pass
    for graph_pass in passes:
        graph_pass(None)
    assert mine.ran == 1 and "mine" in str([p.uuid() for p in passes]) and "policy" in str([p.uuid() for p in passes])
