"""A stage's state travels in pages from one snapshot: big tensors as row ranges, reassembled bit for bit."""

import pytest
import torch

from agora.net.state_transfer import StateAssembler, StateSnapshots, split_pieces
from agora.net.transport import RpcError


def _state():
    gen = torch.Generator().manual_seed(0)
    names = ["param/embed", "param/w", "opt/step/w", "param/norm"]
    tensors = [torch.randn(1000, 16, generator=gen), torch.randn(64, 64, generator=gen), torch.tensor([7.0]),
               torch.randn(16, generator=gen)]
    return names, tensors


def test_pages_rebuild_every_tensor_bit_for_bit_with_big_ones_cut_into_rows():
    names, tensors = _state()
    page = 20_000  # bytes: the 64 KB embedding must travel as row ranges
    snaps = StateSnapshots()
    token = snaps.add(5, "fp", names, [t.clone() for t in tensors], page_bytes=page)
    pages, offset, n_pages = StateAssembler(), 0, 0
    while offset is not None:
        reply, part = snaps.serve(token, offset, page_bytes=page)
        assert sum(t.numel() * t.element_size() for t in part) <= page or len(part) == 1
        assert reply["step"] == 5 and reply["snapshot"] == token
        pages.add(reply, part)
        offset, n_pages = reply["next"], n_pages + 1
    assert n_pages > 4
    got_names, got = pages.result()
    assert got_names == names
    for a, b in zip(got, tensors):
        assert torch.equal(a, b)
    with pytest.raises(RpcError, match="start the download again"):  # the last page released the snapshot
        snaps.serve(token, 0)


def test_snapshots_are_bounded_checked_and_expire():
    names, tensors = _state()
    snaps = StateSnapshots(max_snapshots=2, ttl_s=0.0)
    snaps.add(1, None, names, tensors)
    snaps.add(1, None, names, tensors)
    assert snaps.has_room()  # ttl 0: both expired and were dropped
    snaps = StateSnapshots(max_snapshots=1, ttl_s=60.0)
    token = snaps.add(1, None, names, tensors)
    with pytest.raises(RpcError) as err:
        snaps.add(1, None, names, tensors)
    assert err.value.code == "busy"
    for bad in (-1, 10**6, "0", True, None):
        with pytest.raises(RpcError) as err:
            snaps.serve(token, bad)
        assert err.value.code == "bad_request"
    with pytest.raises(RpcError) as err:
        snaps.serve(123, 0)
    assert err.value.code == "unknown_snapshot"
    with pytest.raises(RpcError, match="do not line up"):
        StateAssembler().add({"names": ["a"], "rows": [None, None]}, [torch.zeros(1)])


def test_a_tensor_is_cut_only_when_it_exceeds_a_page():
    pieces = split_pieces(["a", "b"], [torch.zeros(10, 10), torch.zeros(3)], page_bytes=400)
    assert [(n, r) for n, r, _ in pieces] == [("a", None), ("b", None)]
    pieces = split_pieces(["a"], [torch.zeros(10, 10)], page_bytes=120)
    assert [r for _, r, _ in pieces] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_downloads_of_one_step_share_one_copy_and_each_reads_to_its_own_end():
    names, tensors = _state()
    snaps = StateSnapshots(max_snapshots=1, ttl_s=60.0)
    first = snaps.add(3, "fp", names, tensors, page_bytes=20_000, kind="full")
    assert snaps.join(3, "fp", "params_only") is None  # another kind of copy
    assert snaps.join(4, "fp", "full") is None  # another step
    second = snaps.join(3, "fp", "full")
    assert second is not None and second != first
    assert not snaps.has_room()  # still one copy, and the bound counts copies
    results = {}
    for token in (second, first):  # each download pages through the shared copy independently
        pages, offset = StateAssembler(), 0
        while offset is not None:
            reply, part = snaps.serve(token, offset, page_bytes=20_000)
            pages.add(reply, part)
            offset = reply["next"]
        results[token] = pages.result()[1]
    for got in results.values():
        assert all(torch.equal(a, b) for a, b in zip(got, tensors))
    assert snaps.has_room() and snaps.join(3, "fp", "full") is None  # both finished: the copy is gone
