"""Golden tests of rewritten backward graphs.

The text is what ``fxgrad.testing`` renders: only the inserted nodes, with
the original gradients named ``grad['<parameter>']`` and one comment line per
route. Refresh with ``EXPECTTEST_ACCEPT=1 pytest tests/test_graphs.py``. Every
golden is first checked for inserted nodes whose value nothing uses.
"""

import math
import re

import expecttest
import torch
import torch.nn as nn

import fxgrad
from fxgrad.testing import backward_code, inserted_code


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)), torch.randn(5, 4)


def dead_nodes(code: str) -> list[str]:
    """Inserted nodes that no later line uses (``save_state`` runs for its effect)."""
    lines = code.splitlines()
    dead = []
    for i, line in enumerate(lines):
        name, _, value = line.strip().partition(" = ")
        used = any(re.search(rf"\b{name}\b", later) for later in lines[i + 1 :])
        if name.startswith("fxgrad_") and "save_state" not in value and not used:
            dead.append(name)
    return dead


class TestInsertedGraphs(expecttest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):
        self.assertEqual(dead_nodes(actual), [])
        super().assertExpectedInline(actual, expect, skip=skip + 1)

    def test_clip_by_global_norm_covers_norm_layers(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.clip_by_global_norm(1.0)),
            """\
# layer norms for clip_by_global_norm(max_norm=1.0)
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['1.weight'], grad['1.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['1.bias'], grad['1.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
fxgrad_mul_4 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_4 = aten.sum.default(fxgrad_mul_4)
fxgrad_mul_5 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_5 = aten.sum.default(fxgrad_mul_5)
fxgrad_add_2 = aten.add.Tensor(fxgrad_sum_4, fxgrad_sum_5)
# clip_by_global_norm(max_norm=1.0) on [0, 1, 2]
fxgrad_add_3 = aten.add.Tensor(fxgrad_add, fxgrad_add_1)
fxgrad_add_4 = aten.add.Tensor(fxgrad_add_3, fxgrad_add_2)
fxgrad_sqrt = aten.sqrt.default(fxgrad_add_4)
fxgrad_add_5 = aten.add.Tensor(fxgrad_sqrt, 1e-06)
fxgrad_reciprocal = aten.reciprocal.default(fxgrad_add_5)
fxgrad_mul_6 = aten.mul.Tensor(fxgrad_reciprocal, 1.0)
fxgrad_clamp_max = aten.clamp_max.default(fxgrad_mul_6, 1.0)
fxgrad_mul_7 = aten.mul.Tensor(fxgrad_sqrt, fxgrad_clamp_max)
# scale gradients
fxgrad_mul_8 = aten.mul.Tensor(grad['0.weight'], fxgrad_clamp_max)
fxgrad_mul_9 = aten.mul.Tensor(grad['0.bias'], fxgrad_clamp_max)
fxgrad_mul_10 = aten.mul.Tensor(grad['1.weight'], fxgrad_clamp_max)
fxgrad_mul_11 = aten.mul.Tensor(grad['1.bias'], fxgrad_clamp_max)
fxgrad_mul_12 = aten.mul.Tensor(grad['2.weight'], fxgrad_clamp_max)
fxgrad_mul_13 = aten.mul.Tensor(grad['2.bias'], fxgrad_clamp_max)
# statistics
fxgrad_view = aten.view.default(fxgrad_sqrt, [-1])
fxgrad_view_1 = aten.view.default(fxgrad_mul_7, [-1])
fxgrad_view_2 = aten.view.default(fxgrad_clamp_max, [-1])
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view, [0, 2], 0.0)
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_constant_pad_nd, torch.float64)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_1, [1, 1], 0.0)
fxgrad_add_6 = aten.add.Tensor(fxgrad_convert_element_type, fxgrad_constant_pad_nd_1)
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_2, [2, 0], 0.0)
fxgrad_add_7 = aten.add.Tensor(fxgrad_add_6, fxgrad_constant_pad_nd_2)
fxgrad_save_state = fxgrad.save_state.default(<stats>, fxgrad_add_7)
return {
    '0.weight': fxgrad_mul_8,
    '0.bias': fxgrad_mul_9,
    '1.weight': fxgrad_mul_10,
    '1.bias': fxgrad_mul_11,
    '2.weight': fxgrad_mul_12,
    '2.bias': fxgrad_mul_13,
}
""",
        )

    def test_the_step_program_holds_the_nodes_graph_scope_inserts(self):
        """scope="step" leaves the backward alone; explain and inserted_code show its step
        program instead, in the same form: the same nodes, where one graph holds the model."""
        policies = [
            fxgrad.clip_by_global_norm(1.0),
            fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.monitor()),
            fxgrad.chain(fxgrad.zclip(), fxgrad.clip_by_norm(0.1)),
            fxgrad.adaptive_grad_clip(0.01),
        ]
        for policy in policies:
            model, x = tiny()
            stepped = inserted_code(model, x, transform=policy, scope="step")
            model, x = tiny()
            self.assertEqual(stepped, inserted_code(model, x, transform=policy), msg=repr(policy))

    def test_clip_by_norm_skips_layernorm(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.clip_by_norm(1.0)),
            """\
# layer norms for clip_by_norm(max_norm=1.0)
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
# clip_by_norm(max_norm=1.0) on [0, 2]
fxgrad_sqrt = aten.sqrt.default(fxgrad_add)
fxgrad_add_2 = aten.add.Tensor(fxgrad_sqrt, 1e-06)
fxgrad_reciprocal = aten.reciprocal.default(fxgrad_add_2)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_reciprocal, 1.0)
fxgrad_clamp_max = aten.clamp_max.default(fxgrad_mul_4, 1.0)
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_add_1)
fxgrad_add_3 = aten.add.Tensor(fxgrad_sqrt_1, 1e-06)
fxgrad_reciprocal_1 = aten.reciprocal.default(fxgrad_add_3)
fxgrad_mul_5 = aten.mul.Tensor(fxgrad_reciprocal_1, 1.0)
fxgrad_clamp_max_1 = aten.clamp_max.default(fxgrad_mul_5, 1.0)
# scale gradients
fxgrad_mul_6 = aten.mul.Tensor(grad['0.weight'], fxgrad_clamp_max)
fxgrad_mul_7 = aten.mul.Tensor(grad['0.bias'], fxgrad_clamp_max)
fxgrad_mul_8 = aten.mul.Tensor(grad['2.weight'], fxgrad_clamp_max_1)
fxgrad_mul_9 = aten.mul.Tensor(grad['2.bias'], fxgrad_clamp_max_1)
return {
    '0.weight': fxgrad_mul_6,
    '0.bias': fxgrad_mul_7,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_mul_8,
    '2.bias': fxgrad_mul_9,
}
""",
        )

    def test_clip_by_value(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.clip_by_value(0.5)),
            """\
# clip_by_value(clip_value=0.5) on [0, 2]
fxgrad_clamp_min = aten.clamp_min.default(grad['0.weight'], -0.5)
fxgrad_clamp_max = aten.clamp_max.default(fxgrad_clamp_min, 0.5)
fxgrad_clamp_min_1 = aten.clamp_min.default(grad['0.bias'], -0.5)
fxgrad_clamp_max_1 = aten.clamp_max.default(fxgrad_clamp_min_1, 0.5)
fxgrad_clamp_min_2 = aten.clamp_min.default(grad['2.weight'], -0.5)
fxgrad_clamp_max_2 = aten.clamp_max.default(fxgrad_clamp_min_2, 0.5)
fxgrad_clamp_min_3 = aten.clamp_min.default(grad['2.bias'], -0.5)
fxgrad_clamp_max_3 = aten.clamp_max.default(fxgrad_clamp_min_3, 0.5)
return {
    '0.weight': fxgrad_clamp_max,
    '0.bias': fxgrad_clamp_max_1,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_clamp_max_2,
    '2.bias': fxgrad_clamp_max_3,
}
""",
        )

    def test_rescale_with_multiplier(self):
        model, x = tiny()
        transform = fxgrad.rescale(alpha=0.5, multipliers={"2": 2.0})
        self.assertExpectedInline(
            inserted_code(model, x, transform=transform),
            """\
# layer norms for rescale(alpha=0.5, target='mean', multipliers={'2': 2.0})
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
# rescale(alpha=0.5, target='mean', multipliers={'2': 2.0}) on [0, 2]
fxgrad_sqrt = aten.sqrt.default(fxgrad_add)
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_add_1)
fxgrad_add_2 = aten.add.Tensor(fxgrad_sqrt, fxgrad_sqrt_1)
fxgrad_div = aten.div.Tensor(fxgrad_add_2, 2)
fxgrad_add_3 = aten.add.Tensor(fxgrad_sqrt, 1e-07)
fxgrad_div_1 = aten.div.Tensor(fxgrad_div, fxgrad_add_3)
fxgrad_pow = aten.pow.Tensor_Scalar(fxgrad_div_1, 0.5)
fxgrad_add_4 = aten.add.Tensor(fxgrad_sqrt_1, 1e-07)
fxgrad_div_2 = aten.div.Tensor(fxgrad_div, fxgrad_add_4)
fxgrad_pow_1 = aten.pow.Tensor_Scalar(fxgrad_div_2, 0.5)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_pow_1, 2.0)
# scale gradients
fxgrad_mul_5 = aten.mul.Tensor(grad['0.weight'], fxgrad_pow)
fxgrad_mul_6 = aten.mul.Tensor(grad['0.bias'], fxgrad_pow)
fxgrad_mul_7 = aten.mul.Tensor(grad['2.weight'], fxgrad_mul_4)
fxgrad_mul_8 = aten.mul.Tensor(grad['2.bias'], fxgrad_mul_4)
return {
    '0.weight': fxgrad_mul_5,
    '0.bias': fxgrad_mul_6,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_mul_7,
    '2.bias': fxgrad_mul_8,
}
""",
        )

    def test_by_type_then_global_inf_norm(self):
        model, x = tiny()
        transform = fxgrad.chain(
            fxgrad.by_type({nn.Linear: fxgrad.clip_by_norm(0.5)}),
            fxgrad.clip_by_global_norm(1.0, norm_type=math.inf),
        )
        self.assertExpectedInline(
            inserted_code(model, x, transform=transform),
            """\
# layer norms for clip_by_norm(max_norm=0.5), clip_by_global_norm(max_norm=1.0, norm_type=float('inf'))
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_abs = aten.abs.default(grad['0.weight'])
fxgrad_amax = aten.amax.default(fxgrad_abs)
fxgrad_abs_1 = aten.abs.default(grad['0.bias'])
fxgrad_amax_1 = aten.amax.default(fxgrad_abs_1)
fxgrad_maximum = aten.maximum.default(fxgrad_amax, fxgrad_amax_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
fxgrad_abs_2 = aten.abs.default(grad['2.weight'])
fxgrad_amax_2 = aten.amax.default(fxgrad_abs_2)
fxgrad_abs_3 = aten.abs.default(grad['2.bias'])
fxgrad_amax_3 = aten.amax.default(fxgrad_abs_3)
fxgrad_maximum_1 = aten.maximum.default(fxgrad_amax_2, fxgrad_amax_3)
fxgrad_abs_4 = aten.abs.default(grad['1.weight'])
fxgrad_amax_4 = aten.amax.default(fxgrad_abs_4)
fxgrad_abs_5 = aten.abs.default(grad['1.bias'])
fxgrad_amax_5 = aten.amax.default(fxgrad_abs_5)
fxgrad_maximum_2 = aten.maximum.default(fxgrad_amax_4, fxgrad_amax_5)
# clip_by_norm(max_norm=0.5) on [0, 2]
fxgrad_sqrt = aten.sqrt.default(fxgrad_add)
fxgrad_add_3 = aten.add.Tensor(fxgrad_sqrt, 1e-06)
fxgrad_reciprocal = aten.reciprocal.default(fxgrad_add_3)
fxgrad_mul_6 = aten.mul.Tensor(fxgrad_reciprocal, 0.5)
fxgrad_clamp_max = aten.clamp_max.default(fxgrad_mul_6, 1.0)
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_add_1)
fxgrad_add_4 = aten.add.Tensor(fxgrad_sqrt_1, 1e-06)
fxgrad_reciprocal_1 = aten.reciprocal.default(fxgrad_add_4)
fxgrad_mul_7 = aten.mul.Tensor(fxgrad_reciprocal_1, 0.5)
fxgrad_clamp_max_1 = aten.clamp_max.default(fxgrad_mul_7, 1.0)
# clip_by_global_norm(max_norm=1.0, norm_type=float('inf')) on [0, 1, 2]
fxgrad_mul_8 = aten.mul.Tensor(fxgrad_maximum, fxgrad_clamp_max)
fxgrad_mul_9 = aten.mul.Tensor(fxgrad_maximum_1, fxgrad_clamp_max_1)
fxgrad_maximum_3 = aten.maximum.default(fxgrad_mul_8, fxgrad_maximum_2)
fxgrad_maximum_4 = aten.maximum.default(fxgrad_maximum_3, fxgrad_mul_9)
fxgrad_add_5 = aten.add.Tensor(fxgrad_maximum_4, 1e-06)
fxgrad_reciprocal_2 = aten.reciprocal.default(fxgrad_add_5)
fxgrad_mul_10 = aten.mul.Tensor(fxgrad_reciprocal_2, 1.0)
fxgrad_clamp_max_2 = aten.clamp_max.default(fxgrad_mul_10, 1.0)
fxgrad_mul_11 = aten.mul.Tensor(fxgrad_maximum_4, fxgrad_clamp_max_2)
fxgrad_mul_12 = aten.mul.Tensor(fxgrad_clamp_max, fxgrad_clamp_max_2)
fxgrad_mul_13 = aten.mul.Tensor(fxgrad_clamp_max_1, fxgrad_clamp_max_2)
# scale gradients
fxgrad_mul_14 = aten.mul.Tensor(grad['0.weight'], fxgrad_mul_12)
fxgrad_mul_15 = aten.mul.Tensor(grad['0.bias'], fxgrad_mul_12)
fxgrad_mul_16 = aten.mul.Tensor(grad['2.weight'], fxgrad_mul_13)
fxgrad_mul_17 = aten.mul.Tensor(grad['2.bias'], fxgrad_mul_13)
fxgrad_mul_18 = aten.mul.Tensor(grad['1.weight'], fxgrad_clamp_max_2)
fxgrad_mul_19 = aten.mul.Tensor(grad['1.bias'], fxgrad_clamp_max_2)
# statistics
fxgrad_view = aten.view.default(fxgrad_maximum_4, [-1])
fxgrad_view_1 = aten.view.default(fxgrad_mul_11, [-1])
fxgrad_view_2 = aten.view.default(fxgrad_clamp_max_2, [-1])
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view, [0, 2], 0.0)
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_constant_pad_nd, torch.float64)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_1, [1, 1], 0.0)
fxgrad_add_6 = aten.add.Tensor(fxgrad_convert_element_type, fxgrad_constant_pad_nd_1)
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_2, [2, 0], 0.0)
fxgrad_add_7 = aten.add.Tensor(fxgrad_add_6, fxgrad_constant_pad_nd_2)
fxgrad_save_state = fxgrad.save_state.default(<stats>, fxgrad_add_7)
return {
    '0.weight': fxgrad_mul_14,
    '0.bias': fxgrad_mul_15,
    '1.weight': fxgrad_mul_18,
    '1.bias': fxgrad_mul_19,
    '2.weight': fxgrad_mul_16,
    '2.bias': fxgrad_mul_17,
}
""",
        )

    def test_autoclip_loads_and_saves_its_state(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.autoclip(history=4)),
            """\
# layer norms for autoclip(percentile=90.0, history=4, blend=0.1)
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['1.weight'], grad['1.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['1.bias'], grad['1.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
fxgrad_mul_4 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_4 = aten.sum.default(fxgrad_mul_4)
fxgrad_mul_5 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_5 = aten.sum.default(fxgrad_mul_5)
fxgrad_add_2 = aten.add.Tensor(fxgrad_sum_4, fxgrad_sum_5)
# autoclip(percentile=90.0, history=4, blend=0.1) on [0, 1, 2]
fxgrad_add_3 = aten.add.Tensor(fxgrad_add, fxgrad_add_1)
fxgrad_add_4 = aten.add.Tensor(fxgrad_add_3, fxgrad_add_2)
fxgrad_sqrt = aten.sqrt.default(fxgrad_add_4)
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_sqrt, torch.float64)
fxgrad_load_state = fxgrad.load_state.default(<0.autoclip>)
fxgrad_slice = aten.slice.Tensor(fxgrad_load_state, 0, 0, 4)
fxgrad_view = aten.view.default(fxgrad_slice, [4])
fxgrad_slice_1 = aten.slice.Tensor(fxgrad_load_state, 0, 4, 5)
fxgrad_view_1 = aten.view.default(fxgrad_slice_1, [])
fxgrad_slice_2 = aten.slice.Tensor(fxgrad_load_state, 0, 5, 6)
fxgrad_view_2 = aten.view.default(fxgrad_slice_2, [])
fxgrad_abs = aten.abs.default(fxgrad_convert_element_type)
fxgrad_ne = aten.ne.Scalar(fxgrad_abs, inf)
fxgrad_eq = aten.eq.Tensor(fxgrad_convert_element_type, fxgrad_convert_element_type)
fxgrad_mul_6 = aten.mul.Tensor(fxgrad_eq, fxgrad_ne)
fxgrad_iota = prims.iota.default(4, start=0, step=1, dtype=torch.int64, device=device(type='cpu'), requires_grad=False)
fxgrad_alias = aten.alias.default(fxgrad_iota)
fxgrad_remainder = aten.remainder.Scalar(fxgrad_view_1, 4)
fxgrad_eq_1 = aten.eq.Tensor(fxgrad_alias, fxgrad_remainder)
fxgrad_bitwise_and = aten.bitwise_and.Tensor(fxgrad_eq_1, fxgrad_mul_6)
fxgrad_where = aten.where.self(fxgrad_bitwise_and, fxgrad_convert_element_type, fxgrad_view)
fxgrad_convert_element_type_1 = prims.convert_element_type.default(fxgrad_mul_6, torch.float64)
fxgrad_add_5 = aten.add.Tensor(fxgrad_view_1, fxgrad_convert_element_type_1)
fxgrad_clamp_max = aten.clamp_max.default(fxgrad_add_5, 4.0)
fxgrad_lt = aten.lt.Tensor(fxgrad_alias, fxgrad_clamp_max)
fxgrad_scalar_tensor = aten.scalar_tensor.default(inf, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'))
fxgrad_where_1 = aten.where.self(fxgrad_lt, fxgrad_where, fxgrad_scalar_tensor)
fxgrad_sort = aten.sort.default(fxgrad_where_1)
fxgrad_getitem = getitem(fxgrad_sort, 0)
fxgrad_sub = aten.sub.Tensor(fxgrad_clamp_max, 1)
fxgrad_clamp_min = aten.clamp_min.default(fxgrad_sub, 0)
fxgrad_mul_7 = aten.mul.Tensor(fxgrad_clamp_min, 0.9)
fxgrad_floor = aten.floor.default(fxgrad_mul_7)
fxgrad_add_6 = aten.add.Tensor(fxgrad_floor, 1)
fxgrad_sub_1 = aten.sub.Tensor(fxgrad_clamp_max, 1)
fxgrad_clamp_min_1 = aten.clamp_min.default(fxgrad_sub_1, 0)
fxgrad_minimum = aten.minimum.default(fxgrad_add_6, fxgrad_clamp_min_1)
fxgrad_convert_element_type_2 = prims.convert_element_type.default(fxgrad_floor, torch.int64)
fxgrad_view_3 = aten.view.default(fxgrad_convert_element_type_2, [1])
fxgrad_gather = aten.gather.default(fxgrad_getitem, 0, fxgrad_view_3)
fxgrad_select = aten.select.int(fxgrad_gather, 0, 0)
fxgrad_convert_element_type_3 = prims.convert_element_type.default(fxgrad_minimum, torch.int64)
fxgrad_view_4 = aten.view.default(fxgrad_convert_element_type_3, [1])
fxgrad_gather_1 = aten.gather.default(fxgrad_getitem, 0, fxgrad_view_4)
fxgrad_select_1 = aten.select.int(fxgrad_gather_1, 0, 0)
fxgrad_sub_2 = aten.sub.Tensor(fxgrad_select_1, fxgrad_select)
fxgrad_sub_3 = aten.sub.Tensor(fxgrad_mul_7, fxgrad_floor)
fxgrad_mul_8 = aten.mul.Tensor(fxgrad_sub_2, fxgrad_sub_3)
fxgrad_add_7 = aten.add.Tensor(fxgrad_select, fxgrad_mul_8)
fxgrad_eq_2 = aten.eq.Scalar(fxgrad_view_1, 0)
fxgrad_mul_9 = aten.mul.Tensor(fxgrad_view_2, 0.9)
fxgrad_mul_10 = aten.mul.Tensor(fxgrad_add_7, 0.1)
fxgrad_add_8 = aten.add.Tensor(fxgrad_mul_9, fxgrad_mul_10)
fxgrad_where_2 = aten.where.self(fxgrad_eq_2, fxgrad_add_7, fxgrad_add_8)
fxgrad_where_3 = aten.where.self(fxgrad_mul_6, fxgrad_where_2, fxgrad_view_2)
fxgrad_convert_element_type_4 = prims.convert_element_type.default(fxgrad_mul_6, torch.float64)
fxgrad_add_9 = aten.add.Tensor(fxgrad_view_1, fxgrad_convert_element_type_4)
fxgrad_view_5 = aten.view.default(fxgrad_where, [-1])
fxgrad_view_6 = aten.view.default(fxgrad_add_9, [-1])
fxgrad_view_7 = aten.view.default(fxgrad_where_3, [-1])
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view_5, [0, 2], 0.0)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_6, [4, 1], 0.0)
fxgrad_add_10 = aten.add.Tensor(fxgrad_constant_pad_nd, fxgrad_constant_pad_nd_1)
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_7, [5, 0], 0.0)
fxgrad_add_11 = aten.add.Tensor(fxgrad_add_10, fxgrad_constant_pad_nd_2)
fxgrad_save_state = fxgrad.save_state.default(<0.autoclip>, fxgrad_add_11)
fxgrad_add_12 = aten.add.Tensor(fxgrad_convert_element_type, 1e-06)
fxgrad_div = aten.div.Tensor(fxgrad_where_3, fxgrad_add_12)
fxgrad_clamp_max_1 = aten.clamp_max.default(fxgrad_div, 1.0)
fxgrad_mul_11 = aten.mul.Tensor(fxgrad_convert_element_type, fxgrad_clamp_max_1)
# scale gradients
fxgrad_mul_12 = aten.mul.Tensor(grad['0.weight'], fxgrad_clamp_max_1)
fxgrad_mul_13 = aten.mul.Tensor(grad['0.bias'], fxgrad_clamp_max_1)
fxgrad_mul_14 = aten.mul.Tensor(grad['1.weight'], fxgrad_clamp_max_1)
fxgrad_mul_15 = aten.mul.Tensor(grad['1.bias'], fxgrad_clamp_max_1)
fxgrad_mul_16 = aten.mul.Tensor(grad['2.weight'], fxgrad_clamp_max_1)
fxgrad_mul_17 = aten.mul.Tensor(grad['2.bias'], fxgrad_clamp_max_1)
# statistics
fxgrad_view_8 = aten.view.default(fxgrad_where_3, [-1])
fxgrad_view_9 = aten.view.default(fxgrad_convert_element_type, [-1])
fxgrad_view_10 = aten.view.default(fxgrad_mul_11, [-1])
fxgrad_view_11 = aten.view.default(fxgrad_clamp_max_1, [-1])
fxgrad_constant_pad_nd_3 = aten.constant_pad_nd.default(fxgrad_view_8, [0, 3], 0.0)
fxgrad_constant_pad_nd_4 = aten.constant_pad_nd.default(fxgrad_view_9, [1, 2], 0.0)
fxgrad_add_13 = aten.add.Tensor(fxgrad_constant_pad_nd_3, fxgrad_constant_pad_nd_4)
fxgrad_constant_pad_nd_5 = aten.constant_pad_nd.default(fxgrad_view_10, [2, 1], 0.0)
fxgrad_add_14 = aten.add.Tensor(fxgrad_add_13, fxgrad_constant_pad_nd_5)
fxgrad_constant_pad_nd_6 = aten.constant_pad_nd.default(fxgrad_view_11, [3, 0], 0.0)
fxgrad_add_15 = aten.add.Tensor(fxgrad_add_14, fxgrad_constant_pad_nd_6)
fxgrad_save_state_1 = fxgrad.save_state.default(<stats>, fxgrad_add_15)
return {
    '0.weight': fxgrad_mul_12,
    '0.bias': fxgrad_mul_13,
    '1.weight': fxgrad_mul_14,
    '1.bias': fxgrad_mul_15,
    '2.weight': fxgrad_mul_16,
    '2.bias': fxgrad_mul_17,
}
""",
        )

    def test_normalize_rms(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.normalize("rms")),
            """\
# layer norms for normalize(norm='rms', scale=1.0, eps=1e-08)
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
# normalize(norm='rms', scale=1.0, eps=1e-08) on [0, 2]
fxgrad_sqrt = aten.sqrt.default(fxgrad_add)
fxgrad_div = aten.div.Tensor(fxgrad_sqrt, 3.872983346207417)
fxgrad_add_2 = aten.add.Tensor(fxgrad_div, 1e-08)
fxgrad_reciprocal = aten.reciprocal.default(fxgrad_add_2)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_reciprocal, 1.0)
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_add_1)
fxgrad_div_1 = aten.div.Tensor(fxgrad_sqrt_1, 2.8284271247461903)
fxgrad_add_3 = aten.add.Tensor(fxgrad_div_1, 1e-08)
fxgrad_reciprocal_1 = aten.reciprocal.default(fxgrad_add_3)
fxgrad_mul_5 = aten.mul.Tensor(fxgrad_reciprocal_1, 1.0)
# scale gradients
fxgrad_mul_6 = aten.mul.Tensor(grad['0.weight'], fxgrad_mul_4)
fxgrad_mul_7 = aten.mul.Tensor(grad['0.bias'], fxgrad_mul_4)
fxgrad_mul_8 = aten.mul.Tensor(grad['2.weight'], fxgrad_mul_5)
fxgrad_mul_9 = aten.mul.Tensor(grad['2.bias'], fxgrad_mul_5)
return {
    '0.weight': fxgrad_mul_6,
    '0.bias': fxgrad_mul_7,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_mul_8,
    '2.bias': fxgrad_mul_9,
}
""",
        )

    def test_multi_normalize(self):
        model, x = tiny()
        transform = fxgrad.multi_normalize(("l2", "linf"), switching_threshold=0.1)
        self.assertExpectedInline(
            inserted_code(model, x, transform=transform),
            """\
# layer norms for multi_normalize(norms=('l2', 'linf'), switching_threshold=0.1)
fxgrad_abs = aten.abs.default(grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_abs)
fxgrad_abs_1 = aten.abs.default(grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_abs_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_1)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
fxgrad_abs_2 = aten.abs.default(grad['0.weight'])
fxgrad_amax = aten.amax.default(fxgrad_abs_2)
fxgrad_abs_3 = aten.abs.default(grad['0.bias'])
fxgrad_amax_1 = aten.amax.default(fxgrad_abs_3)
fxgrad_maximum = aten.maximum.default(fxgrad_amax, fxgrad_amax_1)
fxgrad_abs_4 = aten.abs.default(grad['2.weight'])
fxgrad_sum_4 = aten.sum.default(fxgrad_abs_4)
fxgrad_abs_5 = aten.abs.default(grad['2.bias'])
fxgrad_sum_5 = aten.sum.default(fxgrad_abs_5)
fxgrad_add_2 = aten.add.Tensor(fxgrad_sum_4, fxgrad_sum_5)
fxgrad_mul_2 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_6 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_7 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_3 = aten.add.Tensor(fxgrad_sum_6, fxgrad_sum_7)
fxgrad_abs_6 = aten.abs.default(grad['2.weight'])
fxgrad_amax_2 = aten.amax.default(fxgrad_abs_6)
fxgrad_abs_7 = aten.abs.default(grad['2.bias'])
fxgrad_amax_3 = aten.amax.default(fxgrad_abs_7)
fxgrad_maximum_1 = aten.maximum.default(fxgrad_amax_2, fxgrad_amax_3)
# multi_normalize(norms=('l2', 'linf'), switching_threshold=0.1) on [0, 2]
fxgrad_sqrt = aten.sqrt.default(fxgrad_add_1)
fxgrad_view = aten.view.default(fxgrad_sqrt, [-1])
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_add_3)
fxgrad_view_1 = aten.view.default(fxgrad_sqrt_1, [-1])
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view, [0, 1], 0.0)
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_constant_pad_nd, torch.float64)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_1, [1, 0], 0.0)
fxgrad_add_4 = aten.add.Tensor(fxgrad_convert_element_type, fxgrad_constant_pad_nd_1)
fxgrad_view_2 = aten.view.default(fxgrad_maximum, [-1])
fxgrad_view_3 = aten.view.default(fxgrad_maximum_1, [-1])
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_2, [0, 1], 0.0)
fxgrad_convert_element_type_1 = prims.convert_element_type.default(fxgrad_constant_pad_nd_2, torch.float64)
fxgrad_constant_pad_nd_3 = aten.constant_pad_nd.default(fxgrad_view_3, [1, 0], 0.0)
fxgrad_add_5 = aten.add.Tensor(fxgrad_convert_element_type_1, fxgrad_constant_pad_nd_3)
fxgrad_eq = aten.eq.Scalar(fxgrad_sqrt, 0)
fxgrad_div = aten.div.Tensor(fxgrad_add, fxgrad_sqrt)
fxgrad_pow = aten.pow.Tensor_Scalar(fxgrad_div, 2)
fxgrad_div_1 = aten.div.Tensor(fxgrad_pow, 15)
fxgrad_scalar_tensor = aten.scalar_tensor.default(0.0, dtype=torch.float32, layout=torch.strided, device=device(type='cpu'))
fxgrad_where = aten.where.self(fxgrad_eq, fxgrad_scalar_tensor, fxgrad_div_1)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_where, 1.5707963267948966)
fxgrad_sub = aten.sub.Tensor(1.0, fxgrad_mul_4)
fxgrad_clamp_min = aten.clamp_min.default(fxgrad_sub, 0.0)
fxgrad_clamp_max = aten.clamp_max.default(fxgrad_clamp_min, 1.0)
fxgrad_view_4 = aten.view.default(fxgrad_clamp_max, [-1])
fxgrad_eq_1 = aten.eq.Scalar(fxgrad_sqrt_1, 0)
fxgrad_div_2 = aten.div.Tensor(fxgrad_add_2, fxgrad_sqrt_1)
fxgrad_pow_1 = aten.pow.Tensor_Scalar(fxgrad_div_2, 2)
fxgrad_div_3 = aten.div.Tensor(fxgrad_pow_1, 8)
fxgrad_scalar_tensor_1 = aten.scalar_tensor.default(0.0, dtype=torch.float32, layout=torch.strided, device=device(type='cpu'))
fxgrad_where_1 = aten.where.self(fxgrad_eq_1, fxgrad_scalar_tensor_1, fxgrad_div_3)
fxgrad_mul_5 = aten.mul.Tensor(fxgrad_where_1, 1.5707963267948966)
fxgrad_sub_1 = aten.sub.Tensor(1.0, fxgrad_mul_5)
fxgrad_clamp_min_1 = aten.clamp_min.default(fxgrad_sub_1, 0.0)
fxgrad_clamp_max_1 = aten.clamp_max.default(fxgrad_clamp_min_1, 1.0)
fxgrad_view_5 = aten.view.default(fxgrad_clamp_max_1, [-1])
fxgrad_constant_pad_nd_4 = aten.constant_pad_nd.default(fxgrad_view_4, [0, 1], 0.0)
fxgrad_convert_element_type_2 = prims.convert_element_type.default(fxgrad_constant_pad_nd_4, torch.float64)
fxgrad_constant_pad_nd_5 = aten.constant_pad_nd.default(fxgrad_view_5, [1, 0], 0.0)
fxgrad_add_6 = aten.add.Tensor(fxgrad_convert_element_type_2, fxgrad_constant_pad_nd_5)
fxgrad_load_state = fxgrad.load_state.default(<0.multi_normalize>)
fxgrad_slice = aten.slice.Tensor(fxgrad_load_state, 0, 0, 2)
fxgrad_slice_1 = aten.slice.Tensor(fxgrad_load_state, 0, 2, 4)
fxgrad_slice_2 = aten.slice.Tensor(fxgrad_load_state, 0, 4, 6)
fxgrad_full = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias = aten.alias.default(fxgrad_full)
fxgrad_alias_1 = aten.alias.default(fxgrad_alias)
fxgrad_alias_2 = aten.alias.default(fxgrad_alias_1)
fxgrad_full_1 = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_3 = aten.alias.default(fxgrad_full_1)
fxgrad_alias_4 = aten.alias.default(fxgrad_alias_3)
fxgrad_alias_5 = aten.alias.default(fxgrad_alias_4)
fxgrad_full_2 = aten.full.default([2], False, dtype=torch.bool, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_6 = aten.alias.default(fxgrad_full_2)
fxgrad_alias_7 = aten.alias.default(fxgrad_alias_6)
fxgrad_alias_8 = aten.alias.default(fxgrad_alias_7)
fxgrad_full_3 = aten.full.default([2], 0.1, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_9 = aten.alias.default(fxgrad_full_3)
fxgrad_alias_10 = aten.alias.default(fxgrad_alias_9)
fxgrad_mul_6 = aten.mul.Tensor(fxgrad_add_6, 3)
fxgrad_floor = aten.floor.default(fxgrad_mul_6)
fxgrad_clamp_min_2 = aten.clamp_min.default(fxgrad_floor, 0)
fxgrad_clamp_max_2 = aten.clamp_max.default(fxgrad_clamp_min_2, 2)
fxgrad_full_4 = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_11 = aten.alias.default(fxgrad_full_4)
fxgrad_alias_12 = aten.alias.default(fxgrad_alias_11)
fxgrad_alias_13 = aten.alias.default(fxgrad_alias_12)
fxgrad_eq_2 = aten.eq.Scalar(fxgrad_clamp_max_2, 0)
fxgrad_convert_element_type_3 = prims.convert_element_type.default(fxgrad_eq_2, torch.float64)
fxgrad_mul_7 = aten.mul.Tensor(fxgrad_convert_element_type_3, 0)
fxgrad_add_7 = aten.add.Tensor(fxgrad_alias_13, fxgrad_mul_7)
fxgrad_eq_3 = aten.eq.Scalar(fxgrad_clamp_max_2, 1)
fxgrad_convert_element_type_4 = prims.convert_element_type.default(fxgrad_eq_3, torch.float64)
fxgrad_mul_8 = aten.mul.Tensor(fxgrad_convert_element_type_4, 2)
fxgrad_add_8 = aten.add.Tensor(fxgrad_add_7, fxgrad_mul_8)
fxgrad_eq_4 = aten.eq.Scalar(fxgrad_clamp_max_2, 2)
fxgrad_convert_element_type_5 = prims.convert_element_type.default(fxgrad_eq_4, torch.float64)
fxgrad_mul_9 = aten.mul.Tensor(fxgrad_convert_element_type_5, 1)
fxgrad_add_9 = aten.add.Tensor(fxgrad_add_8, fxgrad_mul_9)
fxgrad_eq_5 = aten.eq.Scalar(fxgrad_alias_2, 0)
fxgrad_where_2 = aten.where.self(fxgrad_eq_5, fxgrad_add_9, fxgrad_alias_5)
fxgrad_eq_6 = aten.eq.Scalar(fxgrad_slice, 0)
fxgrad_eq_7 = aten.eq.Scalar(fxgrad_slice, 2)
fxgrad_add_10 = aten.add.Tensor(fxgrad_eq_6, fxgrad_eq_7)
fxgrad_eq_8 = aten.eq.Scalar(fxgrad_slice, 1)
fxgrad_add_11 = aten.add.Tensor(fxgrad_add_10, fxgrad_eq_8)
fxgrad_where_3 = aten.where.self(fxgrad_eq_5, fxgrad_add_11, fxgrad_alias_8)
fxgrad_sub_2 = aten.sub.Tensor(fxgrad_add_6, fxgrad_slice_1)
fxgrad_abs_8 = aten.abs.default(fxgrad_sub_2)
fxgrad_clamp_min_3 = aten.clamp_min.default(fxgrad_slice_1, 0.001)
fxgrad_mul_10 = aten.mul.Tensor(fxgrad_alias_10, fxgrad_clamp_min_3)
fxgrad_gt = aten.gt.Tensor(fxgrad_abs_8, fxgrad_mul_10)
fxgrad_eq_9 = aten.eq.Scalar(fxgrad_slice_2, 0)
fxgrad_bitwise_or = aten.bitwise_or.Tensor(fxgrad_eq_9, fxgrad_gt)
fxgrad_bitwise_not = aten.bitwise_not.default(fxgrad_where_3)
fxgrad_bitwise_or_1 = aten.bitwise_or.Tensor(fxgrad_bitwise_or, fxgrad_bitwise_not)
fxgrad_where_4 = aten.where.self(fxgrad_bitwise_or_1, fxgrad_where_2, fxgrad_slice)
fxgrad_where_5 = aten.where.self(fxgrad_bitwise_or_1, fxgrad_add_6, fxgrad_slice_1)
fxgrad_add_12 = aten.add.Tensor(fxgrad_slice_2, 1)
fxgrad_abs_9 = aten.abs.default(fxgrad_add_6)
fxgrad_ne = aten.ne.Scalar(fxgrad_abs_9, inf)
fxgrad_eq_10 = aten.eq.Tensor(fxgrad_add_6, fxgrad_add_6)
fxgrad_mul_11 = aten.mul.Tensor(fxgrad_eq_10, fxgrad_ne)
fxgrad_logical_not = aten.logical_not.default(fxgrad_mul_11)
fxgrad_any = aten.any.dims(fxgrad_logical_not)
fxgrad_logical_not_1 = aten.logical_not.default(fxgrad_any)
fxgrad_where_6 = aten.where.self(fxgrad_logical_not_1, fxgrad_where_4, fxgrad_slice)
fxgrad_where_7 = aten.where.self(fxgrad_logical_not_1, fxgrad_where_5, fxgrad_slice_1)
fxgrad_where_8 = aten.where.self(fxgrad_logical_not_1, fxgrad_add_12, fxgrad_slice_2)
fxgrad_view_6 = aten.view.default(fxgrad_where_6, [-1])
fxgrad_view_7 = aten.view.default(fxgrad_where_7, [-1])
fxgrad_view_8 = aten.view.default(fxgrad_where_8, [-1])
fxgrad_constant_pad_nd_6 = aten.constant_pad_nd.default(fxgrad_view_6, [0, 4], 0.0)
fxgrad_constant_pad_nd_7 = aten.constant_pad_nd.default(fxgrad_view_7, [2, 2], 0.0)
fxgrad_add_13 = aten.add.Tensor(fxgrad_constant_pad_nd_6, fxgrad_constant_pad_nd_7)
fxgrad_constant_pad_nd_8 = aten.constant_pad_nd.default(fxgrad_view_8, [4, 0], 0.0)
fxgrad_add_14 = aten.add.Tensor(fxgrad_add_13, fxgrad_constant_pad_nd_8)
fxgrad_save_state = fxgrad.save_state.default(<0.multi_normalize>, fxgrad_add_14)
fxgrad_full_5 = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_14 = aten.alias.default(fxgrad_full_5)
fxgrad_alias_15 = aten.alias.default(fxgrad_alias_14)
fxgrad_alias_16 = aten.alias.default(fxgrad_alias_15)
fxgrad_eq_11 = aten.eq.Scalar(fxgrad_where_4, 0)
fxgrad_where_9 = aten.where.self(fxgrad_eq_11, fxgrad_add_4, fxgrad_alias_16)
fxgrad_eq_12 = aten.eq.Scalar(fxgrad_where_4, 1)
fxgrad_where_10 = aten.where.self(fxgrad_eq_12, fxgrad_add_5, fxgrad_where_9)
fxgrad_full_6 = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_17 = aten.alias.default(fxgrad_full_6)
fxgrad_alias_18 = aten.alias.default(fxgrad_alias_17)
fxgrad_alias_19 = aten.alias.default(fxgrad_alias_18)
fxgrad_clamp_min_4 = aten.clamp_min.default(fxgrad_add_4, 1e-30)
fxgrad_log = aten.log.default(fxgrad_clamp_min_4)
fxgrad_add_15 = aten.add.Tensor(fxgrad_log, 0)
fxgrad_clamp_min_5 = aten.clamp_min.default(fxgrad_add_5, 1e-30)
fxgrad_log_1 = aten.log.default(fxgrad_clamp_min_5)
fxgrad_add_16 = aten.add.Tensor(fxgrad_add_15, fxgrad_log_1)
fxgrad_div_4 = aten.div.Tensor(fxgrad_add_16, 2)
fxgrad_eq_13 = aten.eq.Scalar(fxgrad_alias_2, 0)
fxgrad_exp = aten.exp.default(fxgrad_div_4)
fxgrad_where_11 = aten.where.self(fxgrad_eq_13, fxgrad_exp, fxgrad_alias_19)
fxgrad_eq_14 = aten.eq.Scalar(fxgrad_where_4, 2)
fxgrad_where_12 = aten.where.self(fxgrad_eq_14, fxgrad_where_11, fxgrad_where_10)
fxgrad_add_17 = aten.add.Tensor(fxgrad_where_12, 1e-08)
fxgrad_reciprocal = aten.reciprocal.default(fxgrad_add_17)
fxgrad_mul_12 = aten.mul.Tensor(fxgrad_reciprocal, 1.0)
fxgrad_unbind = aten.unbind.int(fxgrad_mul_12)
fxgrad_getitem = getitem(fxgrad_unbind, 0)
fxgrad_getitem_1 = getitem(fxgrad_unbind, 1)
# scale gradients
fxgrad_mul_13 = aten.mul.Tensor(grad['0.weight'], fxgrad_getitem)
fxgrad_mul_14 = aten.mul.Tensor(grad['0.bias'], fxgrad_getitem)
fxgrad_mul_15 = aten.mul.Tensor(grad['2.weight'], fxgrad_getitem_1)
fxgrad_mul_16 = aten.mul.Tensor(grad['2.bias'], fxgrad_getitem_1)
# statistics
fxgrad_view_9 = aten.view.default(fxgrad_where_4, [-1])
fxgrad_view_10 = aten.view.default(fxgrad_add_6, [-1])
fxgrad_constant_pad_nd_9 = aten.constant_pad_nd.default(fxgrad_view_9, [0, 2], 0.0)
fxgrad_constant_pad_nd_10 = aten.constant_pad_nd.default(fxgrad_view_10, [2, 0], 0.0)
fxgrad_add_18 = aten.add.Tensor(fxgrad_constant_pad_nd_9, fxgrad_constant_pad_nd_10)
fxgrad_save_state_1 = fxgrad.save_state.default(<stats>, fxgrad_add_18)
return {
    '0.weight': fxgrad_mul_13,
    '0.bias': fxgrad_mul_14,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_mul_15,
    '2.bias': fxgrad_mul_16,
}
""",
        )

    def test_sinkhorn_one_iteration(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.sinkhorn(iters=1)),
            """\
# sinkhorn(iters=1) on [0, 2]
fxgrad_view = aten.view.default(grad['0.weight'], [3, 4])
fxgrad_mul = aten.mul.Tensor(fxgrad_view, fxgrad_view)
fxgrad_sum = aten.sum.dim_IntList(fxgrad_mul, [1], True)
fxgrad_sqrt = aten.sqrt.default(fxgrad_sum)
fxgrad_add = aten.add.Tensor(fxgrad_sqrt, 1e-08)
fxgrad_reciprocal = aten.reciprocal.default(fxgrad_add)
fxgrad_mul_1 = aten.mul.Tensor(fxgrad_reciprocal, 2.0)
fxgrad_mul_2 = aten.mul.Tensor(fxgrad_view, fxgrad_mul_1)
fxgrad_mul_3 = aten.mul.Tensor(fxgrad_mul_2, fxgrad_mul_2)
fxgrad_sum_1 = aten.sum.dim_IntList(fxgrad_mul_3, [0], True)
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_sum_1)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sqrt_1, 1e-08)
fxgrad_reciprocal_1 = aten.reciprocal.default(fxgrad_add_1)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_reciprocal_1, 1.7320508075688772)
fxgrad_mul_5 = aten.mul.Tensor(fxgrad_mul_2, fxgrad_mul_4)
fxgrad_view_1 = aten.view.default(fxgrad_mul_5, [3, 4])
fxgrad_mul_6 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_6)
fxgrad_sqrt_2 = aten.sqrt.default(fxgrad_sum_2)
fxgrad_add_2 = aten.add.Tensor(fxgrad_sqrt_2, 1e-08)
fxgrad_reciprocal_2 = aten.reciprocal.default(fxgrad_add_2)
fxgrad_mul_7 = aten.mul.Tensor(fxgrad_reciprocal_2, 1.7320508075688772)
fxgrad_mul_8 = aten.mul.Tensor(grad['0.bias'], fxgrad_mul_7)
fxgrad_view_2 = aten.view.default(grad['2.weight'], [2, 3])
fxgrad_mul_9 = aten.mul.Tensor(fxgrad_view_2, fxgrad_view_2)
fxgrad_sum_3 = aten.sum.dim_IntList(fxgrad_mul_9, [1], True)
fxgrad_sqrt_3 = aten.sqrt.default(fxgrad_sum_3)
fxgrad_add_3 = aten.add.Tensor(fxgrad_sqrt_3, 1e-08)
fxgrad_reciprocal_3 = aten.reciprocal.default(fxgrad_add_3)
fxgrad_mul_10 = aten.mul.Tensor(fxgrad_reciprocal_3, 1.7320508075688772)
fxgrad_mul_11 = aten.mul.Tensor(fxgrad_view_2, fxgrad_mul_10)
fxgrad_mul_12 = aten.mul.Tensor(fxgrad_mul_11, fxgrad_mul_11)
fxgrad_sum_4 = aten.sum.dim_IntList(fxgrad_mul_12, [0], True)
fxgrad_sqrt_4 = aten.sqrt.default(fxgrad_sum_4)
fxgrad_add_4 = aten.add.Tensor(fxgrad_sqrt_4, 1e-08)
fxgrad_reciprocal_4 = aten.reciprocal.default(fxgrad_add_4)
fxgrad_mul_13 = aten.mul.Tensor(fxgrad_reciprocal_4, 1.4142135623730951)
fxgrad_mul_14 = aten.mul.Tensor(fxgrad_mul_11, fxgrad_mul_13)
fxgrad_view_3 = aten.view.default(fxgrad_mul_14, [2, 3])
fxgrad_mul_15 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_5 = aten.sum.default(fxgrad_mul_15)
fxgrad_sqrt_5 = aten.sqrt.default(fxgrad_sum_5)
fxgrad_add_5 = aten.add.Tensor(fxgrad_sqrt_5, 1e-08)
fxgrad_reciprocal_5 = aten.reciprocal.default(fxgrad_add_5)
fxgrad_mul_16 = aten.mul.Tensor(fxgrad_reciprocal_5, 1.4142135623730951)
fxgrad_mul_17 = aten.mul.Tensor(grad['2.bias'], fxgrad_mul_16)
return {
    '0.weight': fxgrad_view_1,
    '0.bias': fxgrad_mul_8,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_view_3,
    '2.bias': fxgrad_mul_17,
}
""",
        )

    def test_adaptive_grad_clip_reads_weight_row_norms(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.adaptive_grad_clip()),
            """\
# adaptive_grad_clip(clipping=0.01, eps=0.001) on [0, 2]
fxgrad_load_state = fxgrad.load_state.default(<weight row norms of 0.adaptive_grad_clip>)
fxgrad_split_with_sizes = aten.split_with_sizes.default(fxgrad_load_state, [3, 1, 2, 1])
fxgrad_getitem = getitem(fxgrad_split_with_sizes, 0)
fxgrad_getitem_1 = getitem(fxgrad_split_with_sizes, 1)
fxgrad_getitem_2 = getitem(fxgrad_split_with_sizes, 2)
fxgrad_getitem_3 = getitem(fxgrad_split_with_sizes, 3)
fxgrad_view = aten.view.default(fxgrad_getitem, [3, 1])
fxgrad_view_1 = aten.view.default(fxgrad_getitem_1, [])
fxgrad_view_2 = aten.view.default(fxgrad_getitem_2, [2, 1])
fxgrad_view_3 = aten.view.default(fxgrad_getitem_3, [])
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.dim_IntList(fxgrad_mul, [1], True)
fxgrad_sqrt = aten.sqrt.default(fxgrad_sum)
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_view, torch.float32)
fxgrad_clamp_min = aten.clamp_min.default(fxgrad_convert_element_type, 0.001)
fxgrad_mul_1 = aten.mul.Tensor(fxgrad_clamp_min, 0.01)
fxgrad_clamp_min_1 = aten.clamp_min.default(fxgrad_sqrt, 1e-06)
fxgrad_div = aten.div.Tensor(fxgrad_mul_1, fxgrad_clamp_min_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['0.weight'], fxgrad_div)
fxgrad_lt = aten.lt.Tensor(fxgrad_sqrt, fxgrad_mul_1)
fxgrad_where = aten.where.self(fxgrad_lt, grad['0.weight'], fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_3)
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_sum_1)
fxgrad_convert_element_type_1 = prims.convert_element_type.default(fxgrad_view_1, torch.float32)
fxgrad_clamp_min_2 = aten.clamp_min.default(fxgrad_convert_element_type_1, 0.001)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_clamp_min_2, 0.01)
fxgrad_clamp_min_3 = aten.clamp_min.default(fxgrad_sqrt_1, 1e-06)
fxgrad_div_1 = aten.div.Tensor(fxgrad_mul_4, fxgrad_clamp_min_3)
fxgrad_mul_5 = aten.mul.Tensor(grad['0.bias'], fxgrad_div_1)
fxgrad_lt_1 = aten.lt.Tensor(fxgrad_sqrt_1, fxgrad_mul_4)
fxgrad_where_1 = aten.where.self(fxgrad_lt_1, grad['0.bias'], fxgrad_mul_5)
fxgrad_mul_6 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_2 = aten.sum.dim_IntList(fxgrad_mul_6, [1], True)
fxgrad_sqrt_2 = aten.sqrt.default(fxgrad_sum_2)
fxgrad_convert_element_type_2 = prims.convert_element_type.default(fxgrad_view_2, torch.float32)
fxgrad_clamp_min_4 = aten.clamp_min.default(fxgrad_convert_element_type_2, 0.001)
fxgrad_mul_7 = aten.mul.Tensor(fxgrad_clamp_min_4, 0.01)
fxgrad_clamp_min_5 = aten.clamp_min.default(fxgrad_sqrt_2, 1e-06)
fxgrad_div_2 = aten.div.Tensor(fxgrad_mul_7, fxgrad_clamp_min_5)
fxgrad_mul_8 = aten.mul.Tensor(grad['2.weight'], fxgrad_div_2)
fxgrad_lt_2 = aten.lt.Tensor(fxgrad_sqrt_2, fxgrad_mul_7)
fxgrad_where_2 = aten.where.self(fxgrad_lt_2, grad['2.weight'], fxgrad_mul_8)
fxgrad_mul_9 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_9)
fxgrad_sqrt_3 = aten.sqrt.default(fxgrad_sum_3)
fxgrad_convert_element_type_3 = prims.convert_element_type.default(fxgrad_view_3, torch.float32)
fxgrad_clamp_min_6 = aten.clamp_min.default(fxgrad_convert_element_type_3, 0.001)
fxgrad_mul_10 = aten.mul.Tensor(fxgrad_clamp_min_6, 0.01)
fxgrad_clamp_min_7 = aten.clamp_min.default(fxgrad_sqrt_3, 1e-06)
fxgrad_div_3 = aten.div.Tensor(fxgrad_mul_10, fxgrad_clamp_min_7)
fxgrad_mul_11 = aten.mul.Tensor(grad['2.bias'], fxgrad_div_3)
fxgrad_lt_3 = aten.lt.Tensor(fxgrad_sqrt_3, fxgrad_mul_10)
fxgrad_where_3 = aten.where.self(fxgrad_lt_3, grad['2.bias'], fxgrad_mul_11)
return {
    '0.weight': fxgrad_where,
    '0.bias': fxgrad_where_1,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_where_2,
    '2.bias': fxgrad_where_3,
}
""",
        )

    def test_trust_ratio_reads_weight_norms(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.scale_by_trust_ratio()),
            """\
# layer norms for scale_by_trust_ratio(trust_coefficient=1.0, eps=0.0, min_norm=0.0)
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
# scale_by_trust_ratio(trust_coefficient=1.0, eps=0.0, min_norm=0.0) on [0, 2]
fxgrad_load_state = fxgrad.load_state.default(<weight norms of 0.scale_by_trust_ratio>)
fxgrad_clamp_min = aten.clamp_min.default(fxgrad_load_state, 0.0)
fxgrad_sqrt = aten.sqrt.default(fxgrad_add)
fxgrad_view = aten.view.default(fxgrad_sqrt, [-1])
fxgrad_sqrt_1 = aten.sqrt.default(fxgrad_add_1)
fxgrad_view_1 = aten.view.default(fxgrad_sqrt_1, [-1])
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view, [0, 1], 0.0)
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_constant_pad_nd, torch.float64)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_1, [1, 0], 0.0)
fxgrad_add_2 = aten.add.Tensor(fxgrad_convert_element_type, fxgrad_constant_pad_nd_1)
fxgrad_clamp_min_1 = aten.clamp_min.default(fxgrad_add_2, 0.0)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_clamp_min, 1.0)
fxgrad_add_3 = aten.add.Tensor(fxgrad_clamp_min_1, 0.0)
fxgrad_div = aten.div.Tensor(fxgrad_mul_4, fxgrad_add_3)
fxgrad_eq = aten.eq.Scalar(fxgrad_clamp_min, 0)
fxgrad_eq_1 = aten.eq.Scalar(fxgrad_clamp_min_1, 0)
fxgrad_bitwise_or = aten.bitwise_or.Tensor(fxgrad_eq, fxgrad_eq_1)
fxgrad_full = aten.full.default([2], 1, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias = aten.alias.default(fxgrad_full)
fxgrad_alias_1 = aten.alias.default(fxgrad_alias)
fxgrad_alias_2 = aten.alias.default(fxgrad_alias_1)
fxgrad_where = aten.where.self(fxgrad_bitwise_or, fxgrad_alias_2, fxgrad_div)
fxgrad_unbind = aten.unbind.int(fxgrad_where)
fxgrad_getitem = getitem(fxgrad_unbind, 0)
fxgrad_getitem_1 = getitem(fxgrad_unbind, 1)
# scale gradients
fxgrad_mul_5 = aten.mul.Tensor(grad['0.weight'], fxgrad_getitem)
fxgrad_mul_6 = aten.mul.Tensor(grad['0.bias'], fxgrad_getitem)
fxgrad_mul_7 = aten.mul.Tensor(grad['2.weight'], fxgrad_getitem_1)
fxgrad_mul_8 = aten.mul.Tensor(grad['2.bias'], fxgrad_getitem_1)
# statistics
fxgrad_view_2 = aten.view.default(fxgrad_where, [-1])
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_2, [0, 0], 0.0)
fxgrad_save_state = fxgrad.save_state.default(<stats>, fxgrad_constant_pad_nd_2)
return {
    '0.weight': fxgrad_mul_5,
    '0.bias': fxgrad_mul_6,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_mul_7,
    '2.bias': fxgrad_mul_8,
}
""",
        )

    def test_weight_norm_drift(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.weight_norm_drift()),
            """\
# layer norms for weight_norm_drift(every=10, min_denominator=0.1)
fxgrad_mul = aten.mul.Tensor(grad['0.weight'], grad['0.weight'])
fxgrad_sum = aten.sum.default(fxgrad_mul)
fxgrad_mul_1 = aten.mul.Tensor(grad['0.bias'], grad['0.bias'])
fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
fxgrad_mul_2 = aten.mul.Tensor(grad['2.weight'], grad['2.weight'])
fxgrad_sum_2 = aten.sum.default(fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(grad['2.bias'], grad['2.bias'])
fxgrad_sum_3 = aten.sum.default(fxgrad_mul_3)
fxgrad_add_1 = aten.add.Tensor(fxgrad_sum_2, fxgrad_sum_3)
# weight_norm_drift(every=10, min_denominator=0.1) on [0, 2]
fxgrad_load_state = fxgrad.load_state.default(<weight norms of 0.weight_norm_drift>)
fxgrad_load_state_1 = fxgrad.load_state.default(<0.weight_norm_drift>)
fxgrad_slice = aten.slice.Tensor(fxgrad_load_state_1, 0, 0, 2)
fxgrad_slice_1 = aten.slice.Tensor(fxgrad_load_state_1, 0, 2, 4)
fxgrad_slice_2 = aten.slice.Tensor(fxgrad_load_state_1, 0, 4, 6)
fxgrad_eq = aten.eq.Scalar(fxgrad_slice_2, 0)
fxgrad_where = aten.where.self(fxgrad_eq, fxgrad_load_state, fxgrad_slice)
fxgrad_div = aten.div.Tensor(fxgrad_load_state, fxgrad_where)
fxgrad_log = aten.log.default(fxgrad_div)
fxgrad_add_2 = aten.add.Tensor(fxgrad_log, 1.0)
fxgrad_clamp_min = aten.clamp_min.default(fxgrad_add_2, 0.1)
fxgrad_reciprocal = aten.reciprocal.default(fxgrad_clamp_min)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_reciprocal, 1.0)
fxgrad_gt = aten.gt.Scalar(fxgrad_where, 0)
fxgrad_full = aten.full.default([2], 1, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias = aten.alias.default(fxgrad_full)
fxgrad_alias_1 = aten.alias.default(fxgrad_alias)
fxgrad_alias_2 = aten.alias.default(fxgrad_alias_1)
fxgrad_where_1 = aten.where.self(fxgrad_gt, fxgrad_mul_4, fxgrad_alias_2)
fxgrad_remainder = aten.remainder.Scalar(fxgrad_slice_2, 10)
fxgrad_eq_1 = aten.eq.Scalar(fxgrad_remainder, 0)
fxgrad_where_2 = aten.where.self(fxgrad_eq_1, fxgrad_where_1, fxgrad_slice_1)
fxgrad_add_3 = aten.add.Tensor(fxgrad_add, fxgrad_add_1)
fxgrad_sqrt = aten.sqrt.default(fxgrad_add_3)
fxgrad_add_4 = aten.add.Tensor(fxgrad_slice_2, 1)
fxgrad_abs = aten.abs.default(fxgrad_sqrt)
fxgrad_ne = aten.ne.Scalar(fxgrad_abs, inf)
fxgrad_eq_2 = aten.eq.Tensor(fxgrad_sqrt, fxgrad_sqrt)
fxgrad_mul_5 = aten.mul.Tensor(fxgrad_eq_2, fxgrad_ne)
fxgrad_where_3 = aten.where.self(fxgrad_mul_5, fxgrad_where, fxgrad_slice)
fxgrad_where_4 = aten.where.self(fxgrad_mul_5, fxgrad_where_2, fxgrad_slice_1)
fxgrad_where_5 = aten.where.self(fxgrad_mul_5, fxgrad_add_4, fxgrad_slice_2)
fxgrad_view = aten.view.default(fxgrad_where_3, [-1])
fxgrad_view_1 = aten.view.default(fxgrad_where_4, [-1])
fxgrad_view_2 = aten.view.default(fxgrad_where_5, [-1])
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view, [0, 4], 0.0)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_1, [2, 2], 0.0)
fxgrad_add_5 = aten.add.Tensor(fxgrad_constant_pad_nd, fxgrad_constant_pad_nd_1)
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_2, [4, 0], 0.0)
fxgrad_add_6 = aten.add.Tensor(fxgrad_add_5, fxgrad_constant_pad_nd_2)
fxgrad_save_state = fxgrad.save_state.default(<0.weight_norm_drift>, fxgrad_add_6)
fxgrad_unbind = aten.unbind.int(fxgrad_where_2)
fxgrad_getitem = getitem(fxgrad_unbind, 0)
fxgrad_getitem_1 = getitem(fxgrad_unbind, 1)
# scale gradients
fxgrad_mul_6 = aten.mul.Tensor(grad['0.weight'], fxgrad_getitem)
fxgrad_mul_7 = aten.mul.Tensor(grad['0.bias'], fxgrad_getitem)
fxgrad_mul_8 = aten.mul.Tensor(grad['2.weight'], fxgrad_getitem_1)
fxgrad_mul_9 = aten.mul.Tensor(grad['2.bias'], fxgrad_getitem_1)
# statistics
fxgrad_view_3 = aten.view.default(fxgrad_where_2, [-1])
fxgrad_constant_pad_nd_3 = aten.constant_pad_nd.default(fxgrad_view_3, [0, 0], 0.0)
fxgrad_save_state_1 = fxgrad.save_state.default(<stats>, fxgrad_constant_pad_nd_3)
return {
    '0.weight': fxgrad_mul_6,
    '0.bias': fxgrad_mul_7,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_mul_8,
    '2.bias': fxgrad_mul_9,
}
""",
        )

    def test_balance_norms(self):
        model, x = tiny()
        self.assertExpectedInline(
            inserted_code(model, x, transform=fxgrad.balance_norms(k=1)),
            """\
# balance_norms(k=1, lam=0.01, every=100, entropy_drop=0.05) on [0, 2]
fxgrad_load_state = fxgrad.load_state.default(<weight norms of 0.balance_norms>)
fxgrad_load_state_1 = fxgrad.load_state.default(<0.balance_norms>)
fxgrad_slice = aten.slice.Tensor(fxgrad_load_state_1, 0, 0, 1)
fxgrad_view = aten.view.default(fxgrad_slice, [])
fxgrad_slice_1 = aten.slice.Tensor(fxgrad_load_state_1, 0, 1, 2)
fxgrad_view_1 = aten.view.default(fxgrad_slice_1, [])
fxgrad_sum = aten.sum.default(fxgrad_load_state)
fxgrad_div = aten.div.Tensor(fxgrad_load_state, fxgrad_sum)
fxgrad_gt = aten.gt.Scalar(fxgrad_div, 0)
fxgrad_clamp_min = aten.clamp_min.default(fxgrad_div, 1e-30)
fxgrad_log = aten.log.default(fxgrad_clamp_min)
fxgrad_mul = aten.mul.Tensor(fxgrad_div, fxgrad_log)
fxgrad_full = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias = aten.alias.default(fxgrad_full)
fxgrad_alias_1 = aten.alias.default(fxgrad_alias)
fxgrad_alias_2 = aten.alias.default(fxgrad_alias_1)
fxgrad_where = aten.where.self(fxgrad_gt, fxgrad_mul, fxgrad_alias_2)
fxgrad_sum_1 = aten.sum.default(fxgrad_where)
fxgrad_neg = aten.neg.default(fxgrad_sum_1)
fxgrad_remainder = aten.remainder.Scalar(fxgrad_view_1, 100)
fxgrad_eq = aten.eq.Scalar(fxgrad_remainder, 0)
fxgrad_gt_1 = aten.gt.Scalar(fxgrad_view_1, 0)
fxgrad_bitwise_and = aten.bitwise_and.Tensor(fxgrad_eq, fxgrad_gt_1)
fxgrad_sub = aten.sub.Tensor(fxgrad_view, fxgrad_neg)
fxgrad_gt_2 = aten.gt.Scalar(fxgrad_sub, 0.05)
fxgrad_bitwise_and_1 = aten.bitwise_and.Tensor(fxgrad_bitwise_and, fxgrad_gt_2)
fxgrad_full_1 = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_3 = aten.alias.default(fxgrad_full_1)
fxgrad_alias_4 = aten.alias.default(fxgrad_alias_3)
fxgrad_alias_5 = aten.alias.default(fxgrad_alias_4)
fxgrad_sort = aten.sort.stable(fxgrad_load_state, stable=True)
fxgrad_getitem_1 = getitem(fxgrad_sort, 1)
fxgrad_slice_2 = aten.slice.Tensor(fxgrad_getitem_1, 0, -1, 9223372036854775807)
fxgrad_slice_3 = aten.slice.Tensor(fxgrad_getitem_1, 0, 0, 1)
fxgrad_index = aten.index.Tensor(fxgrad_load_state, [fxgrad_slice_2])
fxgrad_sum_2 = aten.sum.default(fxgrad_index)
fxgrad_index_1 = aten.index.Tensor(fxgrad_load_state, [fxgrad_slice_3])
fxgrad_sum_3 = aten.sum.default(fxgrad_index_1)
fxgrad_sub_1 = aten.sub.Tensor(fxgrad_sum_2, fxgrad_sum_3)
fxgrad_div_1 = aten.div.Tensor(fxgrad_sub_1, 2)
fxgrad_mul_1 = aten.mul.Tensor(fxgrad_div_1, 0.02)
fxgrad_expand = aten.expand.default(fxgrad_mul_1, [1])
fxgrad_index_put = aten.index_put.default(fxgrad_alias_5, [fxgrad_slice_2], fxgrad_expand)
fxgrad_neg_1 = aten.neg.default(fxgrad_mul_1)
fxgrad_expand_1 = aten.expand.default(fxgrad_neg_1, [1])
fxgrad_index_put_1 = aten.index_put.default(fxgrad_index_put, [fxgrad_slice_3], fxgrad_expand_1)
fxgrad_full_2 = aten.full.default([2], 0, dtype=torch.float64, layout=torch.strided, device=device(type='cpu'), pin_memory=False)
fxgrad_alias_6 = aten.alias.default(fxgrad_full_2)
fxgrad_alias_7 = aten.alias.default(fxgrad_alias_6)
fxgrad_alias_8 = aten.alias.default(fxgrad_alias_7)
fxgrad_where_1 = aten.where.self(fxgrad_bitwise_and_1, fxgrad_index_put_1, fxgrad_alias_8)
fxgrad_where_2 = aten.where.self(fxgrad_eq, fxgrad_neg, fxgrad_view)
fxgrad_add = aten.add.Tensor(fxgrad_view_1, 1)
fxgrad_view_2 = aten.view.default(fxgrad_where_2, [-1])
fxgrad_view_3 = aten.view.default(fxgrad_add, [-1])
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view_2, [0, 1], 0.0)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_3, [1, 0], 0.0)
fxgrad_add_1 = aten.add.Tensor(fxgrad_constant_pad_nd, fxgrad_constant_pad_nd_1)
fxgrad_save_state = fxgrad.save_state.default(<0.balance_norms>, fxgrad_add_1)
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_bitwise_and_1, torch.float64)
fxgrad_load_state_2 = fxgrad.load_state.default(<weights of 0.balance_norms>)
fxgrad_split_with_sizes = aten.split_with_sizes.default(fxgrad_load_state_2, [12, 3, 6, 2])
fxgrad_getitem_2 = getitem(fxgrad_split_with_sizes, 0)
fxgrad_getitem_3 = getitem(fxgrad_split_with_sizes, 1)
fxgrad_getitem_4 = getitem(fxgrad_split_with_sizes, 2)
fxgrad_getitem_5 = getitem(fxgrad_split_with_sizes, 3)
fxgrad_view_4 = aten.view.default(fxgrad_getitem_2, [3, 4])
fxgrad_view_5 = aten.view.default(fxgrad_getitem_3, [3])
fxgrad_view_6 = aten.view.default(fxgrad_getitem_4, [2, 3])
fxgrad_view_7 = aten.view.default(fxgrad_getitem_5, [2])
fxgrad_unbind = aten.unbind.int(fxgrad_where_1)
fxgrad_getitem_6 = getitem(fxgrad_unbind, 0)
fxgrad_getitem_7 = getitem(fxgrad_unbind, 1)
fxgrad_mul_2 = aten.mul.Tensor(fxgrad_getitem_6, fxgrad_view_4)
fxgrad_add_2 = aten.add.Tensor(grad['0.weight'], fxgrad_mul_2)
fxgrad_mul_3 = aten.mul.Tensor(fxgrad_getitem_6, fxgrad_view_5)
fxgrad_add_3 = aten.add.Tensor(grad['0.bias'], fxgrad_mul_3)
fxgrad_mul_4 = aten.mul.Tensor(fxgrad_getitem_7, fxgrad_view_6)
fxgrad_add_4 = aten.add.Tensor(grad['2.weight'], fxgrad_mul_4)
fxgrad_mul_5 = aten.mul.Tensor(fxgrad_getitem_7, fxgrad_view_7)
fxgrad_add_5 = aten.add.Tensor(grad['2.bias'], fxgrad_mul_5)
# statistics
fxgrad_view_8 = aten.view.default(fxgrad_neg, [-1])
fxgrad_view_9 = aten.view.default(fxgrad_convert_element_type, [-1])
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_8, [0, 1], 0.0)
fxgrad_constant_pad_nd_3 = aten.constant_pad_nd.default(fxgrad_view_9, [1, 0], 0.0)
fxgrad_add_6 = aten.add.Tensor(fxgrad_constant_pad_nd_2, fxgrad_constant_pad_nd_3)
fxgrad_save_state_1 = fxgrad.save_state.default(<stats>, fxgrad_add_6)
return {
    '0.weight': fxgrad_add_2,
    '0.bias': fxgrad_add_3,
    '1.weight': grad['1.weight'],
    '1.bias': grad['1.bias'],
    '2.weight': fxgrad_add_4,
    '2.bias': fxgrad_add_5,
}
""",
        )

    def test_whole_backward_of_one_linear(self):
        torch.manual_seed(0)
        model, x = nn.Linear(3, 2), torch.randn(4, 3)
        self.assertExpectedInline(
            backward_code(model, x, transform=fxgrad.clip_by_global_norm(1.0)),
            """\
def forward(self, primals_3, tangents_1):
    t_1 = aten.t.default(tangents_1)
    mm = aten.mm.default(t_1, primals_3)
    t_2 = aten.t.default(mm)
    sum_1 = aten.sum.dim_IntList(tangents_1, [0], True)
    view = aten.view.default(sum_1, [2])
    t_3 = aten.t.default(t_2)
    fxgrad_mul = aten.mul.Tensor(t_3, t_3)
    fxgrad_sum = aten.sum.default(fxgrad_mul)
    fxgrad_mul_1 = aten.mul.Tensor(view, view)
    fxgrad_sum_1 = aten.sum.default(fxgrad_mul_1)
    fxgrad_add = aten.add.Tensor(fxgrad_sum, fxgrad_sum_1)
    fxgrad_sqrt = aten.sqrt.default(fxgrad_add)
    fxgrad_add_1 = aten.add.Tensor(fxgrad_sqrt, 1e-06)
    fxgrad_reciprocal = aten.reciprocal.default(fxgrad_add_1)
    fxgrad_mul_2 = aten.mul.Tensor(fxgrad_reciprocal, 1.0)
    fxgrad_clamp_max = aten.clamp_max.default(fxgrad_mul_2, 1.0)
    fxgrad_mul_3 = aten.mul.Tensor(fxgrad_sqrt, fxgrad_clamp_max)
    fxgrad_mul_4 = aten.mul.Tensor(t_3, fxgrad_clamp_max)
    fxgrad_mul_5 = aten.mul.Tensor(view, fxgrad_clamp_max)
    fxgrad_view = aten.view.default(fxgrad_sqrt, [-1])
    fxgrad_view_1 = aten.view.default(fxgrad_mul_3, [-1])
    fxgrad_view_2 = aten.view.default(fxgrad_clamp_max, [-1])
    fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_view, [0, 2], 0.0)
    fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_constant_pad_nd, torch.float64)
    fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_view_1, [1, 1], 0.0)
    fxgrad_add_2 = aten.add.Tensor(fxgrad_convert_element_type, fxgrad_constant_pad_nd_1)
    fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_view_2, [2, 0], 0.0)
    fxgrad_add_3 = aten.add.Tensor(fxgrad_add_2, fxgrad_constant_pad_nd_2)
    fxgrad_save_state = fxgrad.save_state.default(<stats>, fxgrad_add_3)
    return (fxgrad_mul_4, fxgrad_mul_5, None)
""",
        )


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
