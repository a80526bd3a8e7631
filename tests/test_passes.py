"""The pure graph passes and the recorder, on hand-made graphs."""

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from fxgrad import _compat, passes
from fxgrad.passes.record import GraphRecorder


def traced_backward():
    """A stand-in backward graph returning (grad_a, None, grad_b), with fake metadata."""

    def backward(x, w):
        return (x * 2.0, None, (w @ x).t().contiguous())

    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake_mode:
        gm = make_fx(backward, tracing_mode="real")(torch.randn(3, 3), torch.randn(3, 3))
    return gm, fake_mode


def record(gm, fake_mode, nodes, rule, label="rule"):
    recorder = GraphRecorder(gm, fake_mode, _compat.inductor_decompositions())
    values = [recorder.bind(node) for node in nodes]
    with recorder.recording():
        recorder.label = label
        results = rule(values)
    return [recorder.node(r) for r in results]


def test_recorded_rule_keeps_contract_and_tags_nodes():
    gm, fake_mode = traced_backward()
    signature = passes.output_signature(gm)
    outputs = passes.gradient_outputs(gm, num_forward_inputs=3)
    assert outputs[1] is None
    new = record(gm, fake_mode, [outputs[0], outputs[2]], lambda gs: [g * 0.5 for g in gs], "halve")
    passes.replace_gradient_outputs(gm, {0: new[0], 2: new[1]})
    gm.graph.lint()
    passes.check_outputs(gm, signature)
    inserted = passes.inserted_nodes(gm)
    assert [n.name for n in inserted] == ["fxgrad_mul", "fxgrad_mul_1"]
    assert all(n.meta[passes.TAG] == "halve" and "val" in n.meta for n in inserted)
    out = gm(torch.ones(3, 3), torch.eye(3))
    torch.testing.assert_close(out[0], torch.ones(3, 3))
    assert out[1] is None


def test_recorder_decomposes_like_inductor():
    gm, fake_mode = traced_backward()
    outputs = passes.gradient_outputs(gm, num_forward_inputs=3)
    record(gm, fake_mode, [outputs[0]], lambda gs: [gs[0].clamp(-1.0, 1.0)])
    assert [n.target for n in passes.inserted_nodes(gm)] == [
        torch.ops.aten.clamp_min.default,
        torch.ops.aten.clamp_max.default,
    ]


def test_check_outputs_catches_dtype_change():
    gm, fake_mode = traced_backward()
    signature = passes.output_signature(gm)
    outputs = passes.gradient_outputs(gm, num_forward_inputs=3)
    new = record(gm, fake_mode, [outputs[0]], lambda gs: [g.double() for g in gs])
    passes.replace_gradient_outputs(gm, {0: new[0]})
    with pytest.raises(AssertionError, match="output 0"):
        passes.check_outputs(gm, signature)


def test_gradient_outputs_refuses_count_mismatch():
    gm, _ = traced_backward()
    with pytest.raises(passes.GraphMismatchError, match="3 values"):
        passes.gradient_outputs(gm, num_forward_inputs=4)


def test_rule_with_tensor_constant_is_rejected():
    gm, fake_mode = traced_backward()
    outputs = passes.gradient_outputs(gm, num_forward_inputs=3)
    with pytest.raises(ValueError, match="tensor constant"):
        record(gm, fake_mode, [outputs[0]], lambda gs: [gs[0] * torch.tensor([1.0, 2.0, 3.0])])


def test_repeated_signatures_get_the_metadata_a_fake_dispatch_gives():
    """The recorder reuses fake results per signature; each must match a real fake dispatch
    (pointwise ops, reductions, padding, casts, factory ops from decompositions, and views,
    which must also share their input's storage at the right offset)."""

    def layouts(x):
        return (
            x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
            x[0, 0].t(),
            x[0, 0, 0],
            x.sum().double(),
            x[0, 0].bfloat16(),
        )

    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake_mode:
        gm = make_fx(layouts, tracing_mode="real")(torch.randn(2, 3, 4, 4))
    outputs = passes.gradient_outputs(gm, num_forward_inputs=5)

    def rule(values):
        results = []
        for _ in range(2):  # the second round hits the per-signature results
            for a in values:
                for b in values:
                    results += [a * b, a + b, torch.maximum(a, b.to(a.dtype)) if a.dim() >= b.dim() else a - b]
                results += [(a * 0.5).sum(), a.abs().amax(), a.clamp_max(1.0).sqrt().reciprocal(), a.pow(3.0) / 2]
                results += [
                    torch.nn.functional.pad(a.reshape(-1), (1, 2)),
                    torch.nn.functional.pad(a.reshape(-1), (2, 1)),
                    a.sum(dim=0),
                    a.to(torch.float64),
                    torch.where(a > 0, a, 0.0),
                    torch.linalg.vector_norm(a, dim=-1, keepdim=True),
                ]
                results += [a.reshape(-1)[1:].unsqueeze(0), a.reshape(-1, 1).t(), a.unsqueeze(-1).squeeze(-1)]
                results += [a.reshape(-1)[i : i + 1].view([]) for i in range(min(3, a.numel()))]  # other offsets
                results += [torch.nn.functional.pad(a, pad) for pad in ((1, 2), (2, 1), (3, 0))] if a.dim() else []
        return results

    record(gm, fake_mode, outputs, rule)
    assert _check_against_fake_dispatch(gm, fake_mode) > 200


def _check_against_fake_dispatch(gm, fake_mode) -> int:
    """Lint ``gm`` and check each inserted node's metadata against a real fake dispatch; how
    many were checked."""
    gm.graph.lint()
    checked = 0
    for node in passes.inserted_nodes(gm):
        args = torch.fx.node.map_arg(node.args, lambda n: n.meta["val"])
        with fake_mode:
            expected = node.target(*args, **node.kwargs)
        got = node.meta["val"]
        assert type(got) is type(expected) and got.fake_mode is fake_mode, node.format_node()
        assert vars(got) == vars(expected), node.format_node()  # the fake mode, device, empty memos
        assert (got.shape, got.stride(), got.dtype, got.device, got.storage_offset()) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
            expected.device,
            expected.storage_offset(),
        ), node.format_node()
        if node.target in _compat.VIEWS:  # a view shares its input's storage
            assert got.untyped_storage()._cdata == args[0].untyped_storage()._cdata, node.format_node()
        checked += 1
    return checked


def test_replayed_recordings_are_copies_with_the_metadata_a_fake_dispatch_gives():
    """A per-tensor function is recorded once per signature and copied for tensors like the
    first one (here views of one storage at other offsets); a function that reads a tensor
    other than its arguments is recorded again each time."""

    def rows(x):
        return x[0], x[1], x[2].t()

    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake_mode:
        gm = make_fx(rows, tracing_mode="real")(torch.randn(3, 4, 4))
    outputs = passes.gradient_outputs(gm, num_forward_inputs=3)

    runs = []

    def per_tensor(x, scale):
        runs.append(x)
        y = x.reshape(-1)[1:].unsqueeze(0) * scale
        return (y / (y * y).sum(dim=1, keepdim=True).sqrt()).squeeze(0)

    recorder = GraphRecorder(gm, fake_mode, _compat.inductor_decompositions())
    values = [recorder.bind(node) for node in outputs]
    with recorder.recording():
        copied = [recorder.replay(per_tensor, v, 2.0) for v in values]
        closure = values[0]
        again = [recorder.replay(lambda x: runs.append(x) or x * closure.sum(), v) for v in values[:2]]
    # values[1] is like values[0]: copied; values[2] (transposed) is not; the closure ran twice
    assert [id(x) for x in runs] == [id(values[0]), id(values[2]), id(values[0]), id(values[1])]
    calls = [[recorder.node(t)] for t in copied]
    for call in calls:  # walk each call's nodes back to the gradient it read
        while call[-1] not in outputs:
            call.append(call[-1].args[0])
    assert [n.target for n in calls[0]] == [n.target for n in calls[1]]
    assert calls[0][-1] is outputs[0] and calls[1][-1] is outputs[1]
    assert recorder.node(again[0]).args[1] is not recorder.node(again[1]).args[1]
    assert _check_against_fake_dispatch(gm, fake_mode) == len(passes.inserted_nodes(gm))


def test_ops_on_sparse_values_get_sparse_results():
    """The per-signature reuse makes strided tensors only: a sparse gradient's ops are dispatched."""

    def backward(x):
        return (torch.sparse_coo_tensor(torch.tensor([[0, 2, 2]]), x, (5, 4)),)

    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake_mode:
        gm = make_fx(backward, tracing_mode="real")(torch.randn(3, 4))
    (grad,) = passes.gradient_outputs(gm, num_forward_inputs=1)
    results = record(gm, fake_mode, [grad], lambda values: [v * v for v in values for _ in range(2)])
    assert [node.meta["val"].layout for node in results] == [torch.sparse_coo] * 2
