"""Golden tests of rewritten backward graphs.

The text is what ``fxgrad.testing`` renders: only the inserted nodes, with
the original gradients named ``grad['<parameter>']`` and one comment line per
route. Refresh with ``EXPECTTEST_ACCEPT=1 pytest tests/test_graphs.py``.
"""

import math

import expecttest
import torch
import torch.nn as nn

import fxgrad
from fxgrad.testing import backward_code, inserted_code


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)), torch.randn(5, 4)


class TestInsertedGraphs(expecttest.TestCase):
    def test_clip_by_global_norm_covers_norm_layers(self):
        model, x = tiny()
        self.assertExpectedInline(inserted_code(model, x, transform=fxgrad.clip_by_global_norm(1.0)), """\
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
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_view, torch.float64)
fxgrad_view_1 = aten.view.default(fxgrad_mul_7, [-1])
fxgrad_convert_element_type_1 = prims.convert_element_type.default(fxgrad_view_1, torch.float64)
fxgrad_view_2 = aten.view.default(fxgrad_clamp_max, [-1])
fxgrad_convert_element_type_2 = prims.convert_element_type.default(fxgrad_view_2, torch.float64)
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_convert_element_type, [0, 2], 0.0)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_convert_element_type_1, [1, 1], 0.0)
fxgrad_add_6 = aten.add.Tensor(fxgrad_constant_pad_nd, fxgrad_constant_pad_nd_1)
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_convert_element_type_2, [2, 0], 0.0)
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
""")

    def test_clip_by_norm_skips_layernorm(self):
        model, x = tiny()
        self.assertExpectedInline(inserted_code(model, x, transform=fxgrad.clip_by_norm(1.0)), """\
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
""")

    def test_clip_by_value(self):
        model, x = tiny()
        self.assertExpectedInline(inserted_code(model, x, transform=fxgrad.clip_by_value(0.5)), """\
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
""")

    def test_rescale_with_multiplier(self):
        model, x = tiny()
        transform = fxgrad.rescale(alpha=0.5, multipliers={"2": 2.0})
        self.assertExpectedInline(inserted_code(model, x, transform=transform), """\
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
""")

    def test_by_type_then_global_inf_norm(self):
        model, x = tiny()
        transform = fxgrad.chain(
            fxgrad.by_type({nn.Linear: fxgrad.clip_by_norm(0.5)}),
            fxgrad.clip_by_global_norm(1.0, norm_type=math.inf),
        )
        self.assertExpectedInline(inserted_code(model, x, transform=transform), """\
# layer norms for clip_by_norm(max_norm=0.5), clip_by_global_norm(max_norm=1.0, norm_type=inf)
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
fxgrad_mul_4 = aten.mul.Tensor(grad['1.weight'], grad['1.weight'])
fxgrad_sum_4 = aten.sum.default(fxgrad_mul_4)
fxgrad_mul_5 = aten.mul.Tensor(grad['1.bias'], grad['1.bias'])
fxgrad_sum_5 = aten.sum.default(fxgrad_mul_5)
fxgrad_add_2 = aten.add.Tensor(fxgrad_sum_4, fxgrad_sum_5)
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
fxgrad_mul_8 = aten.mul.Tensor(fxgrad_clamp_max, fxgrad_clamp_max)
fxgrad_mul_9 = aten.mul.Tensor(fxgrad_add, fxgrad_mul_8)
fxgrad_mul_10 = aten.mul.Tensor(fxgrad_maximum, fxgrad_clamp_max)
fxgrad_mul_11 = aten.mul.Tensor(fxgrad_clamp_max_1, fxgrad_clamp_max_1)
fxgrad_mul_12 = aten.mul.Tensor(fxgrad_add_1, fxgrad_mul_11)
fxgrad_mul_13 = aten.mul.Tensor(fxgrad_maximum_1, fxgrad_clamp_max_1)
# clip_by_global_norm(max_norm=1.0, norm_type=inf) on [0, 1, 2]
fxgrad_maximum_3 = aten.maximum.default(fxgrad_mul_10, fxgrad_maximum_2)
fxgrad_maximum_4 = aten.maximum.default(fxgrad_maximum_3, fxgrad_mul_13)
fxgrad_add_5 = aten.add.Tensor(fxgrad_maximum_4, 1e-06)
fxgrad_reciprocal_2 = aten.reciprocal.default(fxgrad_add_5)
fxgrad_mul_14 = aten.mul.Tensor(fxgrad_reciprocal_2, 1.0)
fxgrad_clamp_max_2 = aten.clamp_max.default(fxgrad_mul_14, 1.0)
fxgrad_mul_15 = aten.mul.Tensor(fxgrad_maximum_4, fxgrad_clamp_max_2)
fxgrad_mul_16 = aten.mul.Tensor(fxgrad_clamp_max, fxgrad_clamp_max_2)
fxgrad_mul_17 = aten.mul.Tensor(fxgrad_clamp_max_1, fxgrad_clamp_max_2)
# scale gradients
fxgrad_mul_18 = aten.mul.Tensor(grad['0.weight'], fxgrad_mul_16)
fxgrad_mul_19 = aten.mul.Tensor(grad['0.bias'], fxgrad_mul_16)
fxgrad_mul_20 = aten.mul.Tensor(grad['2.weight'], fxgrad_mul_17)
fxgrad_mul_21 = aten.mul.Tensor(grad['2.bias'], fxgrad_mul_17)
fxgrad_mul_22 = aten.mul.Tensor(grad['1.weight'], fxgrad_clamp_max_2)
fxgrad_mul_23 = aten.mul.Tensor(grad['1.bias'], fxgrad_clamp_max_2)
# statistics
fxgrad_view = aten.view.default(fxgrad_maximum_4, [-1])
fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_view, torch.float64)
fxgrad_view_1 = aten.view.default(fxgrad_mul_15, [-1])
fxgrad_convert_element_type_1 = prims.convert_element_type.default(fxgrad_view_1, torch.float64)
fxgrad_view_2 = aten.view.default(fxgrad_clamp_max_2, [-1])
fxgrad_convert_element_type_2 = prims.convert_element_type.default(fxgrad_view_2, torch.float64)
fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_convert_element_type, [0, 2], 0.0)
fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_convert_element_type_1, [1, 1], 0.0)
fxgrad_add_6 = aten.add.Tensor(fxgrad_constant_pad_nd, fxgrad_constant_pad_nd_1)
fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_convert_element_type_2, [2, 0], 0.0)
fxgrad_add_7 = aten.add.Tensor(fxgrad_add_6, fxgrad_constant_pad_nd_2)
fxgrad_save_state = fxgrad.save_state.default(<stats>, fxgrad_add_7)
return {
    '0.weight': fxgrad_mul_18,
    '0.bias': fxgrad_mul_19,
    '1.weight': fxgrad_mul_22,
    '1.bias': fxgrad_mul_23,
    '2.weight': fxgrad_mul_20,
    '2.bias': fxgrad_mul_21,
}
""")

    def test_whole_backward_of_one_linear(self):
        torch.manual_seed(0)
        model, x = nn.Linear(3, 2), torch.randn(4, 3)
        self.assertExpectedInline(backward_code(model, x, transform=fxgrad.clip_by_global_norm(1.0)), """\
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
    fxgrad_convert_element_type = prims.convert_element_type.default(fxgrad_view, torch.float64)
    fxgrad_view_1 = aten.view.default(fxgrad_mul_3, [-1])
    fxgrad_convert_element_type_1 = prims.convert_element_type.default(fxgrad_view_1, torch.float64)
    fxgrad_view_2 = aten.view.default(fxgrad_clamp_max, [-1])
    fxgrad_convert_element_type_2 = prims.convert_element_type.default(fxgrad_view_2, torch.float64)
    fxgrad_constant_pad_nd = aten.constant_pad_nd.default(fxgrad_convert_element_type, [0, 2], 0.0)
    fxgrad_constant_pad_nd_1 = aten.constant_pad_nd.default(fxgrad_convert_element_type_1, [1, 1], 0.0)
    fxgrad_add_2 = aten.add.Tensor(fxgrad_constant_pad_nd, fxgrad_constant_pad_nd_1)
    fxgrad_constant_pad_nd_2 = aten.constant_pad_nd.default(fxgrad_convert_element_type_2, [2, 0], 0.0)
    fxgrad_add_3 = aten.add.Tensor(fxgrad_add_2, fxgrad_constant_pad_nd_2)
    fxgrad_save_state = fxgrad.save_state.default(<stats>, fxgrad_add_3)
    return (fxgrad_mul_4, fxgrad_mul_5, None)
""")


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
