"""Peak memory of one training step, each variant in a process of its own.

Each process builds one variant of ``bench/run.py`` (``none``: the compiled model without a
policy; ``graph``, ``step`` and ``fold``: fxgrad in graph scope, step scope, step scope with
``backend.fold``; ``eager``: ``clip_grad_norm_``-style code after backward), compiles it and
takes two warm steps, then resets the peak and takes ``--steps`` more. The peak is the
process's peak resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) on
the CPU, ``torch.cuda.max_memory_allocated`` on a GPU. Ratios are each variant's peak over
``none``'s; on the CPU the process itself (Python, torch, compiled code) is most of the
resident set, so the ratio bounds the training memory fxgrad adds only loosely, and the
differences in MiB are printed too. On the CPU, ``--model wide_mlp`` (512 MiB of gradients)
resolves a 1% difference; a small model's gradients drown in the resident set's noise.

    python bench/memory.py --model wide_mlp --policy global_clip --optimizer adamw-fused
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import run  # noqa: E402
from models import MODELS  # noqa: E402
from policies import OPTIMIZERS, POLICIES, fold_scopes  # noqa: E402

import fxgrad  # noqa: E402

VARIANTS = ("none", "graph", "step", "fold", "eager")


def build(model_name: str, policy: str, variant: str, device: str, scale: float) -> run.Variant:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[model_name](scale)
    model = model.to(device)
    inputs = (tuple(a.to(device) for a in args), {k: v.to(device) for k, v in kwargs.items()})
    transform, make_eager = POLICIES[policy]
    if variant in ("none", "eager"):
        after = make_eager() if variant == "eager" else run.no_policy
        return run.Variant(variant, model, torch.compile(model), after, inputs)
    backend = fxgrad.backend(transform, scope="graph" if variant == "graph" else "step")
    built = run.Variant(variant, model, backend.compile(model), run.no_policy, inputs)
    if variant == "fold":
        backend.fold(built.optimizer)
    return built


def peak(model_name: str, policy: str, variant: str, device: str, steps: int, scale: float) -> float:
    """In this process: the variant's peak bytes over ``steps`` warm steps."""
    built = build(model_name, policy, variant, device, scale)
    built.first_step()
    built.step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident set
    for _ in range(steps):
        built.step()
    if device == "cuda":
        return float(torch.cuda.max_memory_allocated())
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib * 1024.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--policy", default="global_clip", choices=list(POLICIES))
    parser.add_argument("--optimizer", default="adamw-fused", choices=list(OPTIMIZERS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="model size (bench/gpu.sh's CPU dry run shrinks it)")
    parser.add_argument("--jobs", type=int, default=1, help="variants run at once (on a GPU the peaks do not interact)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.jobs < 1:
        parser.error("--jobs must be at least 1")
    run.Variant.optimizer_name = options.optimizer
    if options.variant:
        print(peak(options.model, options.policy, options.variant, options.device, options.steps, options.scale))
        return
    variants = [
        v for v in VARIANTS if v != "fold" or "step" in fold_scopes(POLICIES[options.policy][0], options.optimizer)
    ]
    peaks = {}
    for start in range(0, len(variants), options.jobs):  # each variant's peak is its own process's
        batch = variants[start : start + options.jobs]
        command = [sys.executable, __file__] + sys.argv[1:]
        running = {v: subprocess.Popen([*command, "--variant", v], stdout=subprocess.PIPE, text=True) for v in batch}
        try:
            for variant, process in running.items():
                out, _ = process.communicate()
                if process.returncode:
                    raise SystemExit(f"variant {variant} failed with exit code {process.returncode}")
                peaks[variant] = float(out.strip().splitlines()[-1])
        finally:
            for process in running.values():
                process.kill()  # the others of a failed batch (a no-op on a finished process)
    unit = "max_memory_allocated" if options.device == "cuda" else "peak RSS"
    print(f"model {options.model}, policy {options.policy}, optimizer {options.optimizer}, {unit}:")
    for variant in variants:
        mib, ratio = peaks[variant] / 2**20, peaks[variant] / peaks["none"]
        extra = mib - peaks["none"] / 2**20
        print(f"  {variant:>5}: {mib:9.1f} MiB  / none {ratio:.4f}  ({extra:+.1f} MiB)")


if __name__ == "__main__":
    main()
