"""Step-time ratios measured side by side in one process.

For each model and policy, these variants train the same model (own copies,
same batch) and are timed interleaved, several repeats, medians, warm-up and
compilation excluded:

* ``compiled``: ``torch.compile(model)`` (Inductor), no gradient policy, and a second
  copy of it (``compiled again``) whose ratio to the first is the noise floor;
* ``fxgrad``:   ``fxgrad.backend(policy).compile(model)``, the policy inside the backward;
* ``fxgrad step``: the same with ``scope="step"``: the policy as one compiled program over
  every ``.grad``, run by ``optimizer.step()`` (what DDP and FSDP2 jobs get by default);
* ``eager``:    ``torch.compile(model)`` plus the policy in eager PyTorch after
  ``backward()`` (``clip_grad_norm_(foreach=True)``, per-layer loops);
* ``hooks rescale`` (with the rescale policy): module backward hooks under
  compiled autograd, as the rescaling article writes it;
* ``fxgrad fold <policy>`` (with ``--optimizer adamw-fused``): step scope with
  ``backend.fold(optimizer)``: the policy runs in one step program with the update;
  ``fxgrad fold <policy> graph`` (factors per layer or one global factor): the same in
  graph scope (the backward reads the norms and returns the gradients unscaled; a global
  factor rides in the fused update's ``grad_scale``, per-layer factors go to a program
  that runs the update).

Each variant's gradients after its first step (policy applied) must equal those of the
same policy in eager PyTorch (``fxgrad`` and ``fxgrad step`` against ``eager``,
``compiled again`` against ``compiled``), or the run stops: a policy that did nothing
would otherwise be timed as if it worked.

It also reports cold compile time (the first step in a fresh process with
empty caches) and the kernel launches fxgrad adds to the compiled backward,
then writes a Markdown table.

    python bench/run.py                       # everything, ~30 minutes on 2 CPU cores
    python bench/run.py --quick --compiler aot_eager --out -   # smoke test
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import datetime
import functools
import os
import platform
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))

from models import MODELS, loss_of  # noqa: E402
from policies import OPTIMIZERS, POLICIES, HookRescaled, fold_scopes, layers_of  # noqa: E402

import fxgrad  # noqa: E402
from fxgrad import _compat  # noqa: E402

LAUNCH = re.compile(r"^\s+(cpp_fused_\w+|triton_\w+(?:\.run)?|extern_kernels\.\w+)\(", re.MULTILINE)


def launches(code: list[str]) -> int:
    """The kernel launches in Inductor's generated modules ``code``."""
    return len(LAUNCH.findall("\n".join(code)))


class Variant:
    """One way of training one model copy."""

    autocast: torch.dtype | None = None  # set by main() for --dtype bfloat16 / float16
    optimizer_name = "sgd"  # set by main() for --optimizer
    code_dir: str | None = None  # set by main() for --code-dir

    def __init__(
        self,
        name,
        model,
        compiled,
        after_backward,
        inputs,
        around_step=contextlib.nullcontext,
        reference=None,
        program_settings=None,
        has_program=False,
    ):
        self.name, self.model, self.compiled = name, model, compiled
        self.after_backward, self.around_step = after_backward, around_step
        self.reference = reference  # the variant whose first-step gradients this one's must equal
        self.first_grads: list[torch.Tensor | None] | None = None
        self.program_settings = program_settings or {}  # Inductor settings for the step program alone
        self.has_program = has_program  # whether its first update compiles a step program
        self.program_launches = 0  # the step program's kernel launches (0: none)
        self.counts_launches = False  # whether its first step counts the backward's kernel launches
        self.args, self.kwargs = inputs
        self.optimizer = OPTIMIZERS[self.optimizer_name](model.parameters())
        self.layers = layers_of(model)
        self.times: list[float] = []

    def loss(self) -> torch.Tensor:
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast, enabled=self.autocast is not None):
            return loss_of(self.compiled(*self.args, **self.kwargs))

    def step(self) -> None:
        with self.around_step():
            self.loss().backward()
        self.after_backward(self.model, self.layers)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize()

    def first_step(self, count_launches: bool = False) -> tuple[float, int]:
        """Compile and run one step; return its time and, with ``count_launches``, the launches
        the tables report: the backward's if :attr:`counts_launches` (returned; else 0), the
        step program's if :attr:`has_program` (:attr:`program_launches`). Counting compiles
        with torch's caches off (to see the code), so a first step timed as a restart's must not
        count. With ``code_dir`` the counted code is written there."""
        start = time.perf_counter()
        with self.around_step():
            loss = self.loss()
            if count_launches and self.counts_launches:  # the backward's code only
                code = _compat.generated_code(loss.backward)
                backward_launches = launches(code)
                self._write_code("backward", code)
            else:
                loss.backward()
                backward_launches = 0
        self.after_backward(self.model, self.layers)
        with torch._inductor.config.patch(self.program_settings):  # the step program compiles here
            if count_launches and self.has_program:
                code = _compat.generated_code(self.optimizer.step)
                self.program_launches = launches(code)
                self._write_code("program", code)
            else:
                self.optimizer.step()
        # After the step, which leaves the gradients it applied in .grad: scope="step" runs the
        # policy in it, and a folded update writes the gradient times the factor back. (A step
        # hook would keep a folded optimizer's update out of the step program: a hook of others.)
        self._keep_grads()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize()
        return time.perf_counter() - start, backward_launches

    def _write_code(self, part: str, code: list[str]) -> None:
        if self.code_dir and code:
            with open(os.path.join(self.code_dir, f"{self.name.replace(' ', '_')}.{part}.py"), "w") as out:
                out.write("\n\n# ----\n\n".join(code))

    def _keep_grads(self) -> None:
        self.first_grads = [None if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()]

    def assert_same_gradients(self, reference: Variant) -> None:
        """This variant's first-step gradients equal ``reference``'s, per parameter, to
        ``rtol`` relative to the gradient's size (looser under autocast)."""
        rtol = 1e-4 if self.autocast is None else 3e-2
        for (name, p), a, b in zip(self.model.named_parameters(), self.first_grads, reference.first_grads):
            if a is None or b is None:
                assert a is b, f"{self.name} vs {reference.name}: {name} has a gradient in one only"
                continue
            atol = rtol * b.abs().max().item()
            torch.testing.assert_close(
                a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{self.name} vs {reference.name}: {name}: {m}"
            )


def synchronize() -> None:
    """Wait for the GPU, so wall-clock times cover the work (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def no_policy(model, layers) -> None:
    pass


def build_variants(model_name, policies, scale, compiler, device="cpu", twins=None):
    """The variants of ``model_name`` for ``policies``. ``twins``, Inductor settings, adds a
    ``+twin`` copy of the plain compiled model and of each fxgrad variant compiled with them:
    the model's graphs in graph scope (``torch.compile``'s ``options``), the step program alone
    in step scope."""
    torch.manual_seed(0)
    model, args, kwargs = MODELS[model_name](scale)
    model = model.to(device)
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    inputs = (tuple(map(to, args)), {k: to(v) for k, v in kwargs.items()})

    def compiled(m, options=None):
        return torch.compile(m, options=options) if compiler == "inductor" else torch.compile(m, backend="aot_eager")

    copy_of = lambda: copy.deepcopy(model)  # noqa: E731
    variants = [
        Variant("compiled", (m := copy_of()), compiled(m), no_policy, inputs),
        Variant("compiled again", (m := copy_of()), compiled(m), no_policy, inputs, reference="compiled"),
    ]
    settings = [("", None)] + ([(" +twin", twins)] if twins else [])
    if twins:
        variants.append(Variant("compiled +twin", (m := copy_of()), compiled(m, twins), no_policy, inputs))
    for policy in policies:
        transform, make_eager = POLICIES[policy]
        eager = make_eager()
        reference = f"eager {policy}"
        for suffix, options in settings:
            folds = fold_scopes(transform, Variant.optimizer_name)
            for scope, fold in [("graph", False), ("step", False)] + [(scope, True) for scope in folds]:
                m = copy_of()
                backend = fxgrad.backend(transform, compiler=compiler, scope=scope)
                name = "fxgrad " + ("fold " if fold else "step " if scope == "step" else "") + policy
                variant = Variant(
                    name + (" graph" if fold and scope == "graph" else "") + suffix,
                    m,
                    backend.compile(m, options=options) if scope == "graph" else backend.compile(m),
                    no_policy,
                    inputs,
                    reference=reference,
                    program_settings=options if scope == "step" else None,
                    has_program=scope == "step",
                )
                if fold:
                    backend.fold(variant.optimizer)  # before the first forward: in graph scope, too
                variants.append(variant)
        m = copy_of()
        variants.append(Variant(f"eager {policy}", m, compiled(m), eager, inputs))
    if "rescale" in policies:
        hooked = HookRescaled(copy_of())
        variants.append(
            Variant(
                "hooks rescale",
                hooked.model,
                compiled(hooked),
                no_policy,
                inputs,
                lambda: under_compiled_autograd(compiler),
            )
        )
    counted = {"compiled", *(f"fxgrad {policy}" for policy in policies)}  # the extra-kernels column
    for variant in variants:
        variant.counts_launches = variant.name.removesuffix(" +twin") in counted
    return variants


def under_compiled_autograd(compiler: str):
    """The context a step with module backward hooks runs in under ``torch.compile``: Dynamo
    traces the hooks only while compiled autograd is on (else a graph break at every hooked
    module), and the backward must then run under it."""
    return _compat.compiled_autograd(torch.compile(backend=compiler))


def measure(variants, repeats, steps):
    by_name = {v.name: v for v in variants}
    first = {}
    for v in sorted(variants, key=lambda v: v.reference is not None):  # references first
        first[v.name] = v.first_step(count_launches=True)
        print(f"first step of {v.name}: {first[v.name][0]:.1f} s", file=sys.stderr, flush=True)  # a cut run's trace
        if v.reference is not None:
            v.assert_same_gradients(by_name[v.reference])
            v.first_grads = None
    for v in variants:
        v.first_grads = None
    for v in variants:
        v.step()  # one warm step each
    for r in range(repeats):
        # A fresh order each repeat: a fixed cyclic order would give each variant the same
        # predecessor every time, and whatever that one leaves behind (caches, compiled
        # autograd) would bias it.
        order = random.Random(r).sample(variants, len(variants))
        for v in order:
            start = time.perf_counter()
            for _ in range(steps):
                v.step()
            v.times.append((time.perf_counter() - start) / steps)
    return first


def paired_ratio(a: Variant, b: Variant) -> float:
    """Median over repeats of a's time / b's time in the same repeat (robust to drift)."""
    return statistics.median(x / y for x, y in zip(a.times, b.times))


def report_rows(model_name, policies, variants, first, compile_ratios):
    by_name = {v.name: v for v in variants}
    base = by_name["compiled"]
    rows = []
    for policy in policies:
        fx, eager, step = by_name[f"fxgrad {policy}"], by_name[f"eager {policy}"], by_name[f"fxgrad step {policy}"]
        cold = compile_ratios.get(policy)
        fold, graph_fold = by_name.get(f"fxgrad fold {policy}"), by_name.get(f"fxgrad fold {policy} graph")
        rows.append(
            (
                model_name,
                policy,
                f"{paired_ratio(fx, base):.3f}",
                f"{paired_ratio(eager, base):.3f}",
                f"{paired_ratio(fx, eager):.3f}",
                f"{paired_ratio(step, base):.3f}",
                f"{paired_ratio(step, eager):.3f}",
                "-" if fold is None else f"{paired_ratio(fold, base):.3f}",
                "-" if fold is None else f"{paired_ratio(fold, eager):.3f}",
                "-" if graph_fold is None else f"{paired_ratio(graph_fold, base):.3f}",
                f"{first[fx.name][1] - first['compiled'][1]:+d}",
                "-" if cold is None else f"{cold:.2f}",
                f"{paired_ratio(by_name['hooks rescale'], base):.3f}" if policy == "rescale" else "-",
            )
        )
    return rows, statistics.median(base.times), paired_ratio(by_name["compiled again"], base)


def twin_lines(model_name, variants, first) -> list[str]:
    """Each ``+twin`` variant's time over the plain compiled model's, over the plain compiled
    model's own twin, and over the variant it twins; and the kernel launches of its backward
    or of its step program."""
    by_name = {v.name: v for v in variants}
    base, twin_base = by_name["compiled"], by_name["compiled +twin"]
    lines = [
        f"| {model_name}: variant | / compiled | / compiled +twin | / without the settings | launches |",
        "|---|---|---|---|---|",
    ]
    for twin in (v for v in variants if v.name.endswith(" +twin")):
        plain = by_name[twin.name.removesuffix(" +twin")]
        if twin.counts_launches:
            launches = f"backward {first[twin.name][1]} (without: {first[plain.name][1]})"
        elif twin.has_program:
            launches = f"step program {twin.program_launches} (without: {plain.program_launches})"
        else:
            launches = "-"
        lines.append(
            f"| {twin.name} | {paired_ratio(twin, base):.3f} | {paired_ratio(twin, twin_base):.3f} | "
            f"{paired_ratio(twin, plain):.3f} | {launches} |"
        )
    return lines


HEADER = (
    "model",
    "policy",
    "fxgrad / compiled",
    "eager / compiled",
    "fxgrad / eager",
    "step scope / compiled",
    "step scope / eager",
    "fold / compiled",
    "fold / eager",
    "graph fold / compiled",
    "extra kernels",
    "cold compile fxgrad / compiled",
    "module hooks / compiled",
)


def markdown(rows) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


INDUCTOR_OPTIONS: list[str] = []  # --inductor-option, passed on to the fresh processes


def inductor_setting(pair: str) -> tuple[str, object]:
    """``NAME=VALUE`` (``VALUE`` a Python literal) as a ``torch._inductor.config`` name and value."""
    name, equals, value = pair.partition("=")
    if not equals:
        raise SystemExit(f"expected NAME=VALUE, got {pair!r}")
    return name, ast.literal_eval(value)


def set_inductor_options(pairs: list[str]) -> None:
    """Apply ``NAME=VALUE`` pairs to ``torch._inductor.config``."""
    for pair in pairs:
        name, value = inductor_setting(pair)
        *parents, leaf = name.split(".")
        setattr(functools.reduce(getattr, parents, torch._inductor.config), leaf, value)
        INDUCTOR_OPTIONS.append(pair)


def first_step_seconds(
    model_name: str, policy: str | None, scale: float, compiler: str, device: str, dtype: str, cache: str = ""
) -> float:
    """Compile and run one step in a fresh process, with the Inductor cache directory
    ``cache`` (an empty one when not given)."""
    import subprocess

    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache or empty)
        command = [
            sys.executable,
            __file__,
            "--first-step",
            model_name,
            policy or "none",
            "--compiler",
            compiler,
            "--scale",
            str(scale),
            "--device",
            device,
            "--dtype",
            dtype,
            *[argument for pair in INDUCTOR_OPTIONS for argument in ("--inductor-option", pair)],
        ]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def cold_compile(model_name: str, policies: list[str], samples: int, *args) -> dict:
    """policy -> median over ``samples`` rounds of its first step / the baseline's in the same
    round (each in a fresh process), and None -> the baseline's median seconds."""
    rounds = [{p: first_step_seconds(model_name, p, *args) for p in [None, *policies]} for _ in range(samples)]
    out = {p: statistics.median(r[p] / r[None] for r in rounds) for p in policies}
    out[None] = statistics.median(r[None] for r in rounds)
    return out


def warm_start(model_name: str, policies: list[str], samples: int, *args) -> dict:
    """policy -> median over ``samples`` rounds of its first step in a fresh process sharing an
    earlier process's Inductor cache directory (a restart after a preemption) / plain
    ``torch.compile``'s in the same round; None -> plain ``torch.compile``'s median seconds."""
    with contextlib.ExitStack() as stack:
        caches = {p: stack.enter_context(tempfile.TemporaryDirectory()) for p in [None, *policies]}
        for policy, cache in caches.items():
            first_step_seconds(model_name, policy, *args, cache=cache)  # fills the cache
        rounds = [
            {p: first_step_seconds(model_name, p, *args, cache=cache) for p, cache in caches.items()}
            for _ in range(samples)
        ]
    out = {p: statistics.median(r[p] / r[None] for r in rounds) for p in policies}
    out[None] = statistics.median(r[None] for r in rounds)
    return out


def run_first_step(model_name: str, policy: str, scale: float, compiler: str, device: str) -> None:
    """Print the first step's seconds of ``policy``'s fxgrad variant (``step:<policy>``: in step
    scope), or of plain ``torch.compile`` for ``"none"``."""
    scope, _, policy = policy.rpartition(":")
    variants = build_variants(model_name, [] if policy == "none" else [policy], scale, compiler, device)
    name = "compiled" if policy == "none" else f"fxgrad {scope + ' ' if scope else ''}{policy}"
    print(next(v for v in variants if v.name == name).first_step()[0])


PASS_POLICIES = ("global_clip", "full", "agc", "sinkhorn")


def pass_scaling(sizes, policies=PASS_POLICIES, samples=3) -> list[str]:
    """fxgrad's own rewrite time (median of ``samples`` compiles) for ``policies`` over
    MLPs of ``sizes`` layers."""
    lines = []
    for layers in sizes:
        cells = []
        for policy in policies:
            spent: list[float] = []
            for _ in range(samples):
                _compat.reset_dynamo()
                model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
                backend = fxgrad.backend(POLICIES[policy][0], compiler="aot_eager")
                rewrite = backend._rewrite_backward

                def timed(*args, rewrite=rewrite, **kwargs):
                    start = time.perf_counter()
                    cacheable = rewrite(*args, **kwargs)
                    spent.append(time.perf_counter() - start)
                    return cacheable

                backend._rewrite_backward = timed
                backend.compile(model)(torch.randn(2, 8)).sum().backward()
            cells.append(f"{statistics.median(spent):.3f} s")
        lines.append(f"| {layers} | {2 * layers} | " + " | ".join(cells) + " |")
    return ["| layers | gradients | " + " | ".join(policies) + " |", "|---|---|" + "---|" * len(policies)] + lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        default="gpt2,resnet,deep_mlp",
        help=f"some of {','.join(MODELS)} (gpt2_124m is for bench/gpu.sh, wide_mlp for bench/memory.py)",
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--quick", action="store_true", help="small models, 2 repeats of 2 steps")
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results", "cpu.md"),
        help="Markdown file to write, or - for stdout only",
    )
    parser.add_argument(
        "--compile-policies",
        default="global_clip,full",
        help="policies whose cold compile time is measured (fresh process each); step:<policy> in step scope",
    )
    parser.add_argument(
        "--compile-samples",
        type=int,
        default=3,
        help="rounds of fresh processes per cold and warm first step (interleaved with the baseline's)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="autocast dtype for the forward (parameters stay float32)",
    )
    parser.add_argument(
        "--optimizer",
        default="sgd",
        choices=list(OPTIMIZERS),
        help="every variant's optimizer; adamw-fused adds the fold variant (backend.fold)",
    )
    parser.add_argument("--no-pass-scaling", action="store_true", help="skip the pass-time measurement")
    parser.add_argument(
        "--inductor-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set torch._inductor.config.NAME to the Python literal VALUE for every variant, in this process "
        "and the fresh ones (repeatable; e.g. reorder_for_peak_memory=False)",
    )
    parser.add_argument(
        "--twin",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="add a '+twin' copy of the plain compiled model and of each fxgrad variant, compiled with "
        "torch._inductor.config.NAME set to VALUE (the model's graphs too in graph scope, the step program "
        "alone in step scope), and a table of them (repeatable; e.g. combo_kernels=True)",
    )
    parser.add_argument("--code-dir", help="write the counted backwards' and the step programs' generated code here")
    parser.add_argument(
        "--compile-times",
        action="store_true",
        help="only cold and warm first steps of --compile-policies (fresh processes), no step timing",
    )
    parser.add_argument("--first-step", nargs=2, metavar=("MODEL", "POLICY"), help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=float, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    scale = options.scale or (0.25 if options.quick else 1.0)
    if options.dtype != "float32":
        Variant.autocast = getattr(torch, options.dtype)
    Variant.optimizer_name = options.optimizer
    Variant.code_dir = options.code_dir
    if options.code_dir:
        os.makedirs(options.code_dir, exist_ok=True)
    set_inductor_options(options.inductor_option)
    twins = dict(inductor_setting(pair) for pair in options.twin)
    if twins and options.compiler != "inductor":
        raise SystemExit("--twin sets Inductor settings: it needs --compiler inductor")
    if options.first_step:
        run_first_step(*options.first_step, scale, options.compiler, options.device)
        return
    # An empty Inductor cache: a backward loaded from disk generates no code, and the
    # "extra kernels" column would count the whole of fxgrad's backward as extra.
    fresh_cache = tempfile.TemporaryDirectory(prefix="fxgrad-bench-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh_cache.name
    repeats, steps = (2, 2) if options.quick else (options.repeats, options.steps)
    if options.quick:
        options.compile_samples = 1
    # HookRescaled hooks the first layer too, whose input needs no gradient; torch warns each step.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    torch._dynamo.config.cache_size_limit = 64
    policies = options.policies.split(",")

    rows, notes, twin_table = [], [], []
    timed = [p for p in options.compile_policies.split(",") if p.rpartition(":")[2] in policies]
    for model_name in filter(None, options.models.split(",")):  # --models "": pass time only
        _compat.reset_dynamo()
        first_args = (scale, options.compiler, options.device, options.dtype)
        cold = cold_compile(model_name, timed, options.compile_samples, *first_args) if timed else {}
        if options.compile_times:
            warm = warm_start(model_name, timed, options.compile_samples, *first_args) if timed else {}
            for policy in timed:
                print(
                    f"{model_name} {policy}: first step / plain torch.compile's, median of "
                    f"{options.compile_samples}: cold {cold[policy]:.2f} (plain {cold[None]:.1f} s); warm, a later "
                    f"process on the same Inductor cache, {warm[policy]:.2f} (plain {warm[None]:.1f} s)",
                    flush=True,
                )
            continue
        variants = build_variants(model_name, policies, scale, options.compiler, options.device, twins)
        first = measure(variants, repeats, steps)
        model_rows, base, control = report_rows(model_name, policies, variants, first, cold)
        rows += model_rows
        if twins:
            twin_table += ["", *twin_lines(model_name, variants, first)]
        notes.append(
            f"- {model_name}: compiled step {base * 1e3:.1f} ms; a second copy of it / compiled "
            f"{control:.3f} (the noise floor)"
            + (f"; cold first step (compile + run) {cold[None]:.1f} s without a policy" if cold else "")
        )
        print(markdown(model_rows), flush=True)
    if options.compile_times:
        return

    command = "python bench/run.py " + shlex.join(sys.argv[1:])
    gpu = torch.cuda.get_device_name() if options.device == "cuda" else None
    text = "\n".join(
        [
            f"# fxgrad benchmark ({'GPU' if gpu else 'CPU'})",
            "",
            f"- date: {datetime.date.today()}",
            f"- machine: {gpu or platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, autocast {options.dtype}, "
            f"optimizer {options.optimizer}",
            f"- command: `{command.strip()}`",
            *(
                [
                    f"- method: variants interleaved in one process (order shuffled each repeat), {repeats} repeats "
                    f"x {steps} steps; each ratio is the median over repeats of the two variants' times in the "
                    "same repeat; warm-up and compilation excluded",
                    *(
                        [
                            "- compile: the first step (compile + run) in a fresh process with empty Inductor "
                            "caches, fxgrad / plain `torch.compile`, median over "
                            f"{options.compile_samples} rounds of both"
                        ]
                        if timed
                        else []
                    ),
                    "- ratios < 1 mean faster; `extra kernels` counts kernel launches fxgrad adds "
                    "to the compiled backward (negative: Inductor fused more)",
                    "- `module hooks / compiled` (rescale rows): the rescaling article's `register_full_backward_hook` "
                    "per layer, scaling the gradient flowing into each layer by `(1 / ||g||)^0.5`, run under "
                    "compiled autograd as `torch.compile` requires (`bench/policies.py`, `HookRescaled`)",
                ]
                if rows
                else []
            ),
            *(["", markdown(rows), "", "Baselines:", *notes] if rows else []),
            *(["", f"Twins, compiled with {', '.join(options.twin)}:", *twin_table] if twin_table else []),
            "",
            *(
                []
                if options.no_pass_scaling
                else [
                    "Pass time (fxgrad's rewrite alone, median of 3 compiles, MLP of Linear(8, 8); `full` is "
                    "monitor + rescale + per-layer clip):",
                    "",
                    *pass_scaling((10, 100) if options.quick else (10, 100, 1000)),
                ]
            ),
            "",
        ]
    )
    print(text)
    if options.out != "-":
        with open(options.out, "w") as file:
            file.write(text)


if __name__ == "__main__":
    main()
