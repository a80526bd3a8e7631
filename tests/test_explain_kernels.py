"""``fxgrad.explain(..., kernels=True)``: which Inductor kernels compute fxgrad's nodes.

One Inductor compile of a small MLP; the golden pins the report's shape. Refresh it with
``EXPECTTEST_ACCEPT=1 pytest tests/test_explain_kernels.py``.
"""

import functools
import re

import expecttest
import pytest
import torch
import torch.nn as nn

import fxgrad

pytestmark = pytest.mark.inductor

POLICY = fxgrad.chain(fxgrad.clip_by_norm(1.0), fxgrad.clip_by_global_norm(1.0))
_HASH = re.compile(r"\b[0-9a-f]{16,}\b")  # none in torch 2.13's CPU kernel names; kept out of the golden if any come


@functools.cache
def mlp_report():
    """The report on ``Linear -> ReLU -> Linear`` under a per-layer and a global clip. The backend
    says ``aot_eager``: explain compiles with Inductor for the kernels all the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    backend = fxgrad.backend(POLICY, compiler="aot_eager")
    return fxgrad.explain(model, torch.randn(4, 8), backend=backend, kernels=True)


def gradient_ops(inserted: str) -> dict[str, list[str]]:
    """The inserted nodes that read a gradient (its squares, its scaling), by parameter."""
    ops: dict[str, list[str]] = {}
    for name, args in re.findall(r"^(fxgrad_\w+) = [\w.]+\((.*)\)$", inserted, re.MULTILINE):
        for param in dict.fromkeys(re.findall(r"grad\['([^']+)'\]", args)):
            ops.setdefault(param, []).append(name)
    return ops


class TestExplainKernels(expecttest.TestCase):
    def test_every_inserted_node_is_in_a_kernel_or_reported_outside(self):
        report = mlp_report()
        self.assertIn("compiler='inductor'", str(report))  # what compiled the graphs shown, not the backend's
        (program,) = report.kernels
        self.assertEqual(program.program, "backward graph 0")
        inserted = re.findall(r"^(fxgrad_\w+) = ", report.inserted, re.MULTILINE)
        self.assertEqual(len(inserted), 47)
        for name in inserted:
            self.assertTrue(program.holding(name) or name in program.not_in_kernel, name)
        self.assertEqual(program.not_in_kernel, ())
        # Not "exactly one": Inductor recomputes cheap scalar arithmetic in each kernel that reads it
        # rather than storing it. The per-layer and global clip factors are computed in the kernel that
        # writes the statistics and again in the kernel that scales the gradients. Work on the
        # gradients themselves (squares for the norms, the final scaling) is done once.
        recomputed = [name for name in inserted if len(program.holding(name)) > 1]
        self.assertIn("fxgrad_clamp_max_2", recomputed)  # the global clip factor
        for name in recomputed:
            self.assertEqual([k.name for k in program.holding(name)], ["cpp_fused_3", "cpp_fused_sum_view_4"])
        for param, names in gradient_ops(report.inserted).items():
            for name in names:
                self.assertEqual(len(program.holding(name)), 1, (param, name))
        # fxgrad's save_state is an op Inductor calls, not one it can fuse.
        (save,) = program.holding("fxgrad_save_state")
        self.assertFalse(save.generated)

    def test_where_the_norms_and_the_scaling_land(self):
        report = mlp_report()
        (program,) = report.kernels
        ops = gradient_ops(report.inserted)
        square = {param: names[0] for param, names in ops.items()}  # fxgrad_mul = grad * grad
        # Bias gradients are reductions Inductor generates: their squared norms fuse into them.
        for bias in ("0.bias", "2.bias"):
            (kernel,) = program.holding(square[bias])
            self.assertTrue(kernel.model and not kernel.separate_pass, kernel)
        # Weight gradients come out of extern_kernels.mm on CPU: nothing fuses into a matmul, so
        # their norms are kernels of fxgrad's own (passes that read the weight gradients once more).
        for weight in ("0.weight", "2.weight"):
            (kernel,) = program.holding(square[weight])
            self.assertTrue(kernel.separate_pass, kernel)
        self.assertEqual([k.name for k in program.kernels if not k.generated].count("extern_kernels.mm"), 3)
        # One kernel scales all four gradients (the last one, after the global norm is known). Its
        # model nodes are the bias-gradient reductions, which Inductor computes again there instead
        # of storing them; the weight gradients it reads back from the matmuls' outputs.
        scaling = {program.holding(names[-1])[0].name for names in ops.values()}
        self.assertEqual(scaling, {program.kernels[-1].name})
        self.assertEqual(program.kernels[-1].labels[-1], "scale gradients")
        self.assertEqual(program.kernels[-1].model, ("sum_1", "view", "sum_2", "view_1"))

    def test_kernels_table(self):
        report = mlp_report()
        self.assertIn(report.kernels_table(), str(report))
        self.assertExpectedInline(
            _HASH.sub("<hash>", report.kernels_table()),
            """\
backward graph 0: 9 launches, 5 of them generated kernels
kernel                                   model nodes  fxgrad nodes
cpp_fused_sum_view_0                               2  fxgrad_mul_3, fxgrad_sum_3
extern_kernels.mm                                  1  -
cpp_fused_sum_threshold_backward_view_1            5  fxgrad_mul_1, fxgrad_sum_1
extern_kernels.mm                                  1  -
cpp_fused_2                                        0  fxgrad_mul_2, fxgrad_sum_2  <- a separate pass
extern_kernels.mm                                  1  -
cpp_fused_3                                        0  fxgrad_mul, fxgrad_sum, fxgrad_add, fxgrad_add_1,
                                                      fxgrad_sqrt, fxgrad_add_2, fxgrad_reciprocal,
                                                      fxgrad_mul_4, fxgrad_clamp_max, fxgrad_sqrt_1,
                                                      fxgrad_add_3, fxgrad_reciprocal_1, fxgrad_mul_5,
                                                      fxgrad_clamp_max_1, fxgrad_mul_6, fxgrad_mul_7,
                                                      fxgrad_mul_8, fxgrad_mul_9, fxgrad_add_4, fxgrad_sqrt_2,
                                                      fxgrad_add_5, fxgrad_reciprocal_2, fxgrad_mul_10,
                                                      fxgrad_clamp_max_2, fxgrad_mul_11, fxgrad_view,
                                                      fxgrad_view_1, fxgrad_view_2, fxgrad_constant_pad_nd,
                                                      fxgrad_convert_element_type, fxgrad_constant_pad_nd_1,
                                                      fxgrad_add_6, fxgrad_constant_pad_nd_2, fxgrad_add_7
                                                      <- a separate pass
torch.ops.fxgrad.save_state.default                0  fxgrad_save_state  <- an extern call, not fused
cpp_fused_sum_view_4                               4  fxgrad_add, fxgrad_add_1, fxgrad_sqrt, fxgrad_add_2,
                                                      fxgrad_reciprocal, fxgrad_mul_4, fxgrad_clamp_max,
                                                      fxgrad_sqrt_1, fxgrad_add_3, fxgrad_reciprocal_1,
                                                      fxgrad_mul_5, fxgrad_clamp_max_1, fxgrad_mul_6,
                                                      fxgrad_mul_7, fxgrad_mul_8, fxgrad_mul_9, fxgrad_add_4,
                                                      fxgrad_sqrt_2, fxgrad_add_5, fxgrad_reciprocal_2,
                                                      fxgrad_mul_10, fxgrad_clamp_max_2, fxgrad_mul_12,
                                                      fxgrad_mul_13, fxgrad_mul_14, fxgrad_mul_15,
                                                      fxgrad_mul_16, fxgrad_mul_17""",
        )

    def test_kernels_table_needs_kernels_and_kernels_is_a_bool(self):
        model = nn.Linear(2, 2)
        backend = fxgrad.backend(fxgrad.clip_by_norm(1.0), compiler="aot_eager")
        with self.assertRaisesRegex(TypeError, "kernels must be a bool"):
            fxgrad.explain(model, torch.randn(1, 2), backend=backend, kernels="yes")
        report = fxgrad.explain(model, torch.randn(1, 2), backend=backend)
        self.assertIsNone(report.kernels)
        with self.assertRaisesRegex(ValueError, r"explain\(\.\.\., kernels=True\)"):
            report.kernels_table()


def test_step_scope_reports_the_step_program():
    """In step scope the backward is left alone; explain runs the compiled step program once on
    this backward's gradients. Inductor lowers the program as recorded: its nodes keep their names.
    The statistics are an input of the program, written in the kernel that computes them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    grads = [p.grad for p in model.parameters()]
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), scope="step")
    report = fxgrad.explain(model, torch.randn(4, 8), backend=backend, kernels=True)
    backward, program = report.kernels
    assert backward.program == "backward graph 0"
    assert not any(k.fxgrad for k in backward.kernels)
    assert program.program == "step program"
    (kernel,) = program.kernels  # the norms, the scale and the statistics, in one
    assert kernel.generated and "fxgrad_save_state" in kernel.fxgrad
    assert kernel.labels[-2:] == ("scale gradients", "statistics")
    assert all(name.startswith("fxgrad_") for name in kernel.fxgrad)
    assert [n.partition("_")[0] for n in kernel.model] == ["copy"] * 4  # the writes into .grad
    assert [p.grad for p in model.parameters()] == grads  # put back


def test_a_folded_step_program_shows_the_update_in_its_kernel():
    """With ``backend.fold(optimizer)`` the step program runs the optimizer's update: explain runs
    it once on a fresh copy of the optimizer, puts the weights back, and the one kernel holds the
    norms, the statistics and the update, which applies the factor (no "scale gradients")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    weights = [p.detach().clone() for p in model.parameters()]
    backend = fxgrad.backend(fxgrad.clip_by_global_norm(1.0), scope="step")
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    backend.fold(optimizer)
    report = fxgrad.explain(model, torch.randn(4, 8), backend=backend, kernels=True)
    (kernel,) = report.kernels[-1].kernels
    assert kernel.labels[-2:] == ("statistics", "update")
    assert "scale gradients" not in kernel.labels
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert not optimizer.state  # the copy's state was started, not the optimizer's


def test_a_combo_kernel_is_given_the_nodes_of_its_fused_parts():
    """A combo kernel's sub-kernel that Inductor fused first is a scheduler node without an IR
    node of its own, which torch's provenance recorder skips (on a GPU its nodes were reported
    as in no kernel); fxgrad hands the recorder its parts. Stand-in scheduler nodes: the
    combo kernels themselves need a GPU."""
    import types

    import torch._inductor.config as inductor_config
    import torch._inductor.debug as inductor_debug

    from fxgrad import _compat

    class Part:  # a scheduler node: its IR node, whose origins are FX nodes
        def __init__(self, name):
            origin = types.SimpleNamespace(name=name)
            self.node = types.SimpleNamespace(origins=[origin], get_stack_traces=lambda: [])

    class Fused:  # a fused scheduler node: no IR node, its parts
        node = None

        def __init__(self, *parts):
            self.parts = list(parts)

        def get_nodes(self):
            return self.parts

    def recorded(recorder):
        with inductor_config.patch({"trace.provenance_tracking_level": 2}), inductor_debug.reset_provenance_globals():
            handle = recorder([Fused(Part("fxgrad_mul_12"), Part("fxgrad_mul_14")), Part("fxgrad_mul_11")], "k")
            return inductor_debug._inductor_triton_kernel_to_post_grad_node_info.get(f"k:{handle}", [])

    record = inductor_debug.set_kernel_post_grad_provenance_tracing
    assert recorded(record) == ["fxgrad_mul_11"]  # torch's own: the fused parts are lost
    assert recorded(_compat.fused_parts_recorded(record)) == ["fxgrad_mul_12", "fxgrad_mul_14", "fxgrad_mul_11"]
