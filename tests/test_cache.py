"""A changed policy never reuses a stale compiled backward, across processes.

AOTAutograd's on-disk cache is keyed on the forward graph. Each step below
runs in a fresh process sharing one TORCHINDUCTOR_CACHE_DIR. Graph scope keeps
out of that cache; step scope, which leaves the backward alone, uses it.
"""

import json
import os
import subprocess
import sys

import pytest

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
