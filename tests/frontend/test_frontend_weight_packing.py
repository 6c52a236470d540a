"""Capture packs q/k/v and gate/up into one buffer each (same values), so no later step re-points a weight."""

import pytest
import torch

from tkcc.frontend.weight_packing import is_packed, pack_group, packed_view


@pytest.mark.parametrize("name", ["llama-tiny", "olmoe-tiny"])
def test_capture_packs_projections_without_changing_outputs(name):
    from tkcc.frontend.capture import capture
    from tkcc.frontend.models import build_model

    m = build_model(name, torch.float32, "cpu")
    ids = torch.randint(0, m.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids).logits
    values = {n: p.detach().clone() for n, p in m.named_parameters()}
    capture(m, max_cache_len=16, phases=["decode"])
    a = m.model.layers[0].self_attn
    assert is_packed([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    if hasattr(m.model.layers[0].mlp, "gate_proj"):
        mlp = m.model.layers[0].mlp
        assert is_packed([mlp.gate_proj.weight, mlp.up_proj.weight])
    assert all(torch.equal(values[n], p) for n, p in m.named_parameters())
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref)


def test_packed_view_reads_in_place_and_unpacked_weights_are_not_touched():
    from tkcc.kernels.lowered import pack_rows

    ps = [torch.nn.Parameter(torch.randn(r, 8)) for r in (4, 2, 2)]
    ptrs = [p.data_ptr() for p in ps]
    assert packed_view([p.data for p in ps]) is None
    cat = pack_rows([p.data for p in ps])  # not packed: a copy, the parameters stay where they are
    assert [p.data_ptr() for p in ps] == ptrs and torch.equal(cat, torch.cat([p.data for p in ps]))
    assert pack_group(ps) and not pack_group(ps)
    view = pack_rows([p.data for p in ps])
    assert view.data_ptr() == ps[0].data_ptr() and torch.equal(view, cat)
    ps[1].data.add_(1)
    assert torch.equal(view[4:6], ps[1].data)  # a view: the lowered step reads the parameters themselves


def test_mismatched_groups_are_left_alone():
    ps = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(4, 6))]
    ptrs = [p.data_ptr() for p in ps]
    assert not pack_group(ps) and [p.data_ptr() for p in ps] == ptrs
