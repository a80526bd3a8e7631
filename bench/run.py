"""Step-time ratios measured side by side in one process.

For each model and policy, three variants train the same model (own copies,
same batch) and are timed interleaved, several repeats, medians, warm-up and
compilation excluded:

* ``compiled``: ``torch.compile(model)`` (Inductor), no gradient policy;
* ``fxgrad``:   ``fxgrad.backend(policy).compile(model)``, the policy inside the backward;
* ``eager``:    ``torch.compile(model)`` plus the policy in eager PyTorch after
  ``backward()`` (``clip_grad_norm_(foreach=True)``, per-layer loops).

It also reports compile time (first step minus a warm step) and the kernel
launches fxgrad adds to the compiled backward, then writes a Markdown table.

    python bench/run.py                       # everything, ~15 minutes on 2 CPU cores
    python bench/run.py --quick --compiler aot_eager --out -   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import re
import statistics
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # compile times must be cold
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import fxgrad  # noqa: E402
from fxgrad import _compat  # noqa: E402
from models import MODELS, loss_of  # noqa: E402
from policies import POLICIES, layers_of  # noqa: E402

LAUNCH = re.compile(r"^\s+(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+)\(", re.MULTILINE)


class Variant:
    """One way of training one model copy."""

    def __init__(self, name, model, compiled, after_backward, inputs):
        self.name, self.model, self.compiled = name, model, compiled
        self.after_backward = after_backward
        self.args, self.kwargs = inputs
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.layers = layers_of(model)
        self.times: list[float] = []

    def step(self) -> None:
        loss_of(self.compiled(*self.args, **self.kwargs)).backward()
        self.after_backward(self.model, self.layers)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def first_step(self) -> tuple[float, int]:
        """Compile and run one step; return its time and the backward's kernel launches."""
        start = time.perf_counter()
        loss = loss_of(self.compiled(*self.args, **self.kwargs))
        code = "\n".join(_compat.generated_code(loss.backward))
        self.after_backward(self.model, self.layers)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, len(LAUNCH.findall(code))


def no_policy(model, layers) -> None:
    pass


def build_variants(model_name, policies, scale, compiler):
    torch.manual_seed(0)
    model, args, kwargs = MODELS[model_name](scale)
    inputs = (args, kwargs)

    def compiled(m):
        return torch.compile(m) if compiler == "inductor" else torch.compile(m, backend="aot_eager")

    copy_of = lambda: copy.deepcopy(model)  # noqa: E731
    # The first compile of a model pays one-time costs (imports, Dynamo's analysis
    # of the model's code); a discarded warm-up variant absorbs them.
    # It compiles through fxgrad with no policy, so Dynamo traces again for "compiled".
    warm_up = fxgrad.backend(None, compiler=compiler)
    variants = [Variant("warm-up", (m := copy_of()), warm_up.compile(m), no_policy, inputs)]
    variants.append(Variant("compiled", (m := copy_of()), compiled(m), no_policy, inputs))
    for policy in policies:
        transform, eager = POLICIES[policy]
        m = copy_of()
        backend = fxgrad.backend(transform, compiler=compiler)
        variants.append(Variant(f"fxgrad {policy}", m, backend.compile(m), no_policy, inputs))
        m = copy_of()
        variants.append(Variant(f"eager {policy}", m, compiled(m), eager, inputs))
    return variants


def measure(variants, repeats, steps):
    first = {v.name: v.first_step() for v in variants}
    variants = [v for v in variants if v.name != "warm-up"]
    for v in variants:
        v.step()  # one warm step each
    for r in range(repeats):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            start = time.perf_counter()
            for _ in range(steps):
                v.step()
            v.times.append((time.perf_counter() - start) / steps)
    return first


def report_rows(model_name, policies, variants, first):
    median = {v.name: statistics.median(v.times) for v in variants if v.times}
    base = median["compiled"]
    compile_time = {name: first[name][0] - median[name] for name in median}
    rows = []
    for policy in policies:
        fx, eager = f"fxgrad {policy}", f"eager {policy}"
        rows.append((
            model_name, policy,
            f"{median[fx] / base:.3f}", f"{median[eager] / base:.3f}", f"{median[fx] / median[eager]:.3f}",
            f"{first[fx][1] - first['compiled'][1]:+d}",
            f"{compile_time[fx] / compile_time['compiled']:.2f}",
        ))
    return rows, base, compile_time["compiled"]


HEADER = ("model", "policy", "fxgrad / compiled", "eager / compiled", "fxgrad / eager",
          "extra kernels", "compile fxgrad / compiled")


def markdown(rows) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def pass_scaling(sizes) -> list[str]:
    """fxgrad's own rewrite time for a global clip over MLPs of ``sizes`` layers."""
    lines = []
    for layers in sizes:
        _compat.reset_dynamo()
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
        backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), compiler="aot_eager")
        rewrite, spent = backend._rewrite_backward, []

        def timed(graph, gm, rewrite=rewrite, spent=spent):
            start = time.perf_counter()
            rewrite(graph, gm)
            spent.append(time.perf_counter() - start)

        backend._rewrite_backward = timed
        backend.compile(model)(torch.randn(2, 8)).sum().backward()
        lines.append(f"| {layers} | {2 * layers} | {spent[0]:.3f} s |")
    return ["| layers | gradients | pass time |", "|---|---|---|"] + lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--quick", action="store_true", help="small models, 2 repeats of 2 steps")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu.md"),
                        help="Markdown file to write, or - for stdout only")
    options = parser.parse_args()
    scale = 0.25 if options.quick else 1.0
    repeats, steps = (2, 2) if options.quick else (options.repeats, options.steps)
    torch._dynamo.config.cache_size_limit = 64
    policies = options.policies.split(",")

    rows, notes = [], []
    for model_name in options.models.split(","):
        _compat.reset_dynamo()
        variants = build_variants(model_name, policies, scale, options.compiler)
        first = measure(variants, repeats, steps)
        model_rows, base, compile_s = report_rows(model_name, policies, variants, first)
        rows += model_rows
        notes.append(f"- {model_name}: compiled step {base * 1e3:.1f} ms, compile {compile_s:.1f} s")
        print(markdown(model_rows), flush=True)

    command = "python bench/run.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "# fxgrad benchmark (CPU)",
        "",
        f"- date: {datetime.date.today()}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"- command: `{command.strip()}`",
        f"- method: variants interleaved in one process, {repeats} repeats x {steps} steps, "
        "medians; warm-up and compilation excluded; Inductor caches off for compile times",
        "- ratios < 1 mean faster; `extra kernels` counts kernel launches fxgrad adds "
        "to the compiled backward",
        "",
        markdown(rows),
        "",
        "Baselines:",
        *notes,
        "",
        "Pass time (fxgrad's rewrite alone, `clip_by_global_norm`, MLP of Linear(8, 8)):",
        "",
        *pass_scaling((10, 100) if options.quick else (10, 100, 1000)),
        "",
    ])
    print(text)
    if options.out != "-":
        with open(options.out, "w") as file:
            file.write(text)


if __name__ == "__main__":
    main()
