"""The benchmark harness runs end to end (numbers from aot_eager mean nothing)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_bench_quick_smoke():
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "run.py"),
            "--quick",
            "--compiler",
            "aot_eager",
            "--models",
            "deep_mlp",
            "--policies",
            "global_clip,rescale",
            "--out",
            "-",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    assert "| deep_mlp | global_clip |" in out.stdout
    assert "| 100 | 200 |" in out.stdout
    assert "| deep_mlp | rescale |" in out.stdout


def test_no_bench_module_hides_an_installed_package():
    """bench/'s scripts put bench/ first on sys.path, so a file named like an installed
    package hides it: a bench/kernels.py broke transformers' import of ``kernels``. (Asked of
    a fresh interpreter: the test run's path holds tests/, with a models.py of its own.)"""
    names = sorted(f.removesuffix(".py") for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py"))
    code = f"import importlib.util; print([n for n in {names!r} if importlib.util.find_spec(n)])"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


def test_ddp_bench_reports_the_ratios_of_the_variants_that_ran():
    """DDP has no "exact eager" and FSDP2 no "local": a ratio over a missing variant once
    crashed bench/ddp.py after the timing. (A subprocess, as below: bench/ has its own modules.)"""
    script = textwrap.dedent("""
        from ddp import ratio_lines
        ddp = ["none", "none again", "eager", "local", "exact", "fold"]
        fsdp2 = ["none", "none again", "eager", "exact eager", "exact"]
        for names in (ddp, fsdp2):
            print(*ratio_lines({name: [0.01 * (i + 1), 0.02 * (i + 1)] for i, name in enumerate(names)}), sep="\\n")
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=os.path.join(ROOT, "bench"), capture_output=True, text=True, check=True
    ).stdout
    for line in ["local / exact: 0.800", "fold / eager: 2.000", "exact / exact eager: 1.250", "exact / none: 5.000"]:
        assert line in out, out


def test_hooked_variant_runs_its_hooks_beside_an_unhooked_compiled_copy():
    """Dynamo does not guard on backward hooks: without its own wrapper the hooked copy would
    reuse the plain copy's graph and silently skip the hooks. (A subprocess: bench/ has its
    own ``models`` module.)"""
    script = textwrap.dedent("""
        import copy, warnings, torch
        from models import deep_mlp
        from policies import HookRescaled
        from run import under_compiled_autograd
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        model, (x,), _ = deep_mlp(0.1)
        plain = torch.compile(copy.deepcopy(model), backend="aot_eager")
        eager, hooked = HookRescaled(copy.deepcopy(model)), HookRescaled(copy.deepcopy(model))
        compiled = torch.compile(hooked, backend="aot_eager")
        for _ in range(2):
            plain(x).pow(2).mean().backward()
            with under_compiled_autograd("aot_eager"):
                compiled(x).pow(2).mean().backward()
            eager(x).pow(2).mean().backward()
            for a, b in zip(hooked.parameters(), eager.parameters()):
                torch.testing.assert_close(a.grad, b.grad)
                a.grad = b.grad = None
        print("hooks ran")
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=os.path.join(ROOT, "bench"), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and "hooks ran" in out.stdout, out.stderr[-3000:]
