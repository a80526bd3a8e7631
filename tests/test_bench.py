"""The benchmark harness runs end to end (numbers from aot_eager mean nothing)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_bench_quick_smoke():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--quick", "--compiler", "aot_eager",
         "--models", "deep_mlp", "--policies", "global_clip", "--out", "-"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    assert "| deep_mlp | global_clip |" in out.stdout
    assert "| 100 | 200 |" in out.stdout
