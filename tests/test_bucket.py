"""A worker's swap commit as one storage swap (``SlotBucket``): real segments and tensors in
this process, then through the scheme with loopback workers (the same sockets and shared
memory as across processes)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from asyncsync import Layout, MultiProcessWeightSyncScheme
from asyncsync._io._shm import Segment
from asyncsync._local._bucket import SlotBucket, swap_supported
from asyncsync.testing import open_loopback


class Many(nn.Module):
    """Many small tensors of two dtypes, an empty buffer and a frozen parameter."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(n))
        self.norm = nn.BatchNorm1d(3)  # int64 num_batches_tracked: a second dtype bucket
        self.register_buffer("empty", torch.zeros(0))
        self.layers[0].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _stamp(model: nn.Module, value: float) -> None:
    """Tensor i of *model* holds ``value + i`` (integers too): every tensor tells where it came from."""
    with torch.no_grad():
        for i, t in enumerate(model.state_dict().values()):
            t.fill_(value + i)


def _stamped(model: nn.Module, value: float) -> bool:
    return all(bool((t == value + i).all()) for i, t in enumerate(model.state_dict().values()))


def _slot(layout: Layout, source: nn.Module) -> Segment:
    """A segment holding *source*'s tensors in *layout* (what a sender's slot holds)."""
    seg = Segment(layout.nbytes)
    sd = source.state_dict()
    with torch.no_grad():
        for key, view in layout.views(seg.buf).items():
            view.copy_(sd[key])
    return seg


def _commit(bucket: SlotBucket, targets: dict[str, torch.Tensor], seg: Segment) -> bool:
    """What the receiver does; True if it took one swap."""
    views = bucket.commit(seg)
    if views is None:
        return True
    for key, t in targets.items():
        t.data = views[key]
    return False


def _setup(model: nn.Module) -> tuple[Layout, dict[str, torch.Tensor], SlotBucket]:
    layout = Layout.from_tensors(model.state_dict())
    targets = {k: t for k, t in model.state_dict(keep_vars=True).items()}
    return layout, targets, SlotBucket(layout, [targets[k] for k in layout.keys])


pytestmark = pytest.mark.skipif(not swap_supported(), reason="this torch has no UntypedStorage._swap_data_ptr_")


def test_first_commit_arranges_then_one_swap_moves_every_tensor() -> None:
    model = Many()
    layout, targets, bucket = _setup(model)
    params = list(model.parameters())
    grads = [p.requires_grad for p in params]
    keys = list(model.state_dict())
    src = Many()
    segs = []
    try:
        for k in range(4):
            _stamp(src, 10.0 * k)
            segs.append(_slot(layout, src))
            assert _commit(bucket, targets, segs[-1]) == (k > 0)  # per tensor once, then swaps
            assert _stamped(model, 10.0 * k)
            storages = {t.untyped_storage()._cdata for t in targets.values()}
            assert len(storages) == 1  # one storage for both dtypes
            if k == 1:
                model_storage = storages
            if k > 1:
                assert storages == model_storage  # the same storage object, other memory
        assert (bucket.swaps, bucket.per_tensor) == (3, 1)
        assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
        assert [p.requires_grad for p in model.parameters()] == grads
        assert list(model.state_dict()) == keys
        # the model still trains and runs forward
        model(torch.randn(5, 3)).sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    finally:
        for s in segs:
            s.close(unmap=False)


def test_a_swap_never_moves_the_slots_own_memory() -> None:
    model = Many()
    layout, targets, bucket = _setup(model)
    src = Many()
    _stamp(src, 1.0)
    a = _slot(layout, src)
    _stamp(src, 2.0)
    b = _slot(layout, src)
    try:
        _commit(bucket, targets, a)
        a_views = layout.views(a.buf)
        assert _commit(bucket, targets, b)
        # slot a still holds its version, for every other worker mapping it
        assert all(bool((a_views[k] == 1.0 + i).all()) for i, k in enumerate(layout.keys))
        # the model views slot b now, and no longer slot a
        a_views["layers.1.weight"].fill_(-1.0)
        assert bool((model.layers[1].weight == 2.0 + list(model.state_dict()).index("layers.1.weight")).all())
        layout.views(b.buf)["layers.1.weight"].fill_(-5.0)
        assert bool((model.layers[1].weight == -5.0).all())
    finally:
        a.close()
        b.close()


def _with(model: nn.Module, value: float) -> nn.Module:
    _stamp(model, value)
    return model


def test_the_displaced_memory_goes_with_the_temporary_storage() -> None:
    model = Many()
    layout, targets, bucket = _setup(model)
    src = _with(Many(), 0.0)
    a, b = _slot(layout, src), _slot(layout, src)
    _commit(bucket, targets, a)
    mapping_a = weakref.ref(a._mmap)  # type: ignore[arg-type]
    a.close()  # the worker's close: what still views the mapping keeps it
    gc.collect()
    assert mapping_a() is not None  # the model views it
    assert _commit(bucket, targets, b)
    gc.collect()
    assert mapping_a() is None  # nothing holds slot a any more: unmapped
    assert _stamped(model, 0.0)
    b.close()


def test_a_repointed_tensor_makes_the_next_commit_per_tensor() -> None:
    model = Many()
    layout, targets, bucket = _setup(model)
    src = Many()
    segs = [_slot(layout, _with(src, float(k))) for k in range(4)]
    _commit(bucket, targets, segs[0])
    assert bucket.arranged()
    model.layers[3].weight.data = model.layers[3].weight.data.clone()  # the user's own memory
    assert not bucket.arranged()
    assert not _commit(bucket, targets, segs[1])  # per tensor: re-points every tensor
    assert _stamped(model, 1.0)
    assert _commit(bucket, targets, segs[2])  # arranged again: one swap
    assert _stamped(model, 2.0)
    for s in segs:
        s.close()


def test_views_assigned_only_in_part_are_not_arranged() -> None:
    model = Many()
    layout, targets, bucket = _setup(model)
    src = Many()
    a, b, c = (_slot(layout, _with(src, float(k))) for k in range(3))
    _commit(bucket, targets, a)
    live = layout.views(a.buf)  # the receiver's live set: the slot's own views
    views = bucket.commit(b)
    assert views is None  # arranged: one swap to b
    # a per-tensor commit that fails half way is undone onto the live set (slot b's own views)
    model.layers[0].weight.data = model.layers[0].weight.data.clone()
    views = bucket.commit(c)
    assert views is not None
    done = list(targets.items())[:5]
    for key, t in done:
        t.data = views[key]
    live_b = layout.views(b.buf)
    for key, t in done:
        t.data = live_b[key]
    model.layers[0].weight.data = live_b["layers.0.weight"]
    assert not bucket.arranged()  # same addresses as before, not the bucket's storage: never swapped
    d = _slot(layout, _with(src, 3.0))
    assert not _commit(bucket, targets, d)
    assert _stamped(model, 3.0)
    assert bool((live["layers.1.weight"] == list(model.state_dict()).index("layers.1.weight")).all())  # slot a untouched
    for s in (a, b, c, d):
        s.close()


def test_tied_weights_move_together() -> None:
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    layout = Layout.from_tensors(model.state_dict())
    assert layout.aliases  # one tensor under two names
    targets = {k: model.state_dict(keep_vars=True)[k] for k in layout.keys}
    bucket = SlotBucket(layout, list(targets.values()))
    segs = []
    for value in (1.0, 2.0):
        seg = Segment(layout.nbytes)
        layout.views(seg.buf)["0.weight"].fill_(value)
        segs.append(seg)
        _commit(bucket, targets, seg)
        assert model[1].weight is model[0].weight and bool((model[1].weight == value).all())
    assert bucket.swaps == 1
    for s in segs:
        s.close()


class _Tagged(nn.Parameter):
    """A parameter subclass (it could intercept ``.data =`` in ``__torch_function__``)."""


def test_usable_only_with_swap_data_ptr_bytes_and_plain_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Many()
    sd = model.state_dict(keep_vars=True)
    layout = Layout.from_tensors(sd)
    assert SlotBucket.usable(layout, sd.values())
    assert not SlotBucket.usable(Layout.from_tensors({"e": torch.zeros(0)}), [torch.zeros(0)])
    model.layers[1].bias = _Tagged(torch.zeros(3))
    assert not SlotBucket.usable(layout, model.state_dict(keep_vars=True).values())
    monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", None)  # as on a torch without it
    assert not swap_supported() and not SlotBucket.usable(layout, sd.values())


# ----------------------------------------------------------------- through the scheme


def _receivers(lb: object) -> list:  # type: ignore[type-arg]
    return [w.receiver for w in lb.workers.values()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("commit_mode", ["auto", "manual"])
async def test_many_tensor_workers_commit_by_one_swap(commit_mode: str) -> None:
    trainer = Many(n=128)  # 256 parameters, 4 buffers
    scheme = MultiProcessWeightSyncScheme(timeout=30, commit_mode=commit_mode)
    scheme.init_on_sender(model=trainer, num_workers=2)
    lb = open_loopback(scheme, lambda: Many(n=128))
    params = {i: list(m.parameters()) for i, m in lb.models.items()}
    async with lb:
        storages: dict[int, set[int]] = {i: set() for i in lb.models}
        for k in range(1, 6):
            _stamp(trainer, 100.0 * k)
            v = await scheme.send_async()
            for r in _receivers(lb):
                await r.wait_for_version(v)
                if commit_mode == "manual":
                    assert r.commit() == v
            await scheme.wait_async(v)
            for i, m in lb.models.items():
                assert _stamped(m, 100.0 * k)
                assert all(a is b for a, b in zip(params[i], m.parameters(), strict=True))
                assert len({t.untyped_storage()._cdata for t in m.state_dict().values()}) == 1
                storages[i].add(m.layers[5].weight.untyped_storage()._cdata)
        assert all(r._committer.bucket is not None and r._committer.bucket.swaps >= 4 for r in _receivers(lb))
        assert all(len(s) == 1 for s in storages.values())  # one storage object, memory swapped under it
        assert lb.models[0].layers[0].bias.requires_grad is False
    # closed: the models keep the last version, in memory of their own
    for m in lb.models.values():
        assert _stamped(m, 500.0)


async def test_a_worker_that_repoints_a_parameter_still_gets_every_version() -> None:
    trainer = Many()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, Many) as lb:
        worker = lb.models[0]
        sd0 = worker.state_dict()
        for k in range(1, 4):
            _stamp(trainer, float(k))
            await scheme.send()
        worker.layers[2].weight.data = torch.full((3, 3), 7.0)  # the worker's own memory
        worker.layers[4].bias = nn.Parameter(torch.zeros(3))  # a new Parameter: not the model the receiver binds
        _stamp(trainer, 9.0)
        await scheme.send()
        assert bool((worker.layers[2].weight == 9.0 + list(sd0).index("layers.2.weight")).all())  # at the slot again
        _stamp(trainer, 11.0)
        await scheme.send()
        sd = worker.state_dict()
        assert all(bool((t == 11.0 + i).all()) for i, (k, t) in enumerate(sd.items()) if k != "layers.4.bias")


async def test_without_swap_data_ptr_commits_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", None)  # as on a torch without it
    trainer = Many()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, Many) as lb:
        for k in range(1, 4):
            _stamp(trainer, float(k))
            await scheme.send()
            assert _stamped(lb.models[0], float(k))
        assert _receivers(lb)[0]._committer.bucket is None


def _inference_many() -> nn.Module:
    with torch.inference_mode():
        return Many()


@pytest.mark.parametrize(
    ("options", "make"),
    [({"commit": "copy"}, Many), ({"transfer_dtype": torch.bfloat16}, Many), ({}, _inference_many)],
    ids=["copy", "transfer_dtype", "inference_mode"],
)
async def test_copy_staged_and_inference_commits_take_no_bucket(options: dict, make: Any) -> None:  # type: ignore[type-arg]
    """commit="copy" writes in place; a cast and an inference model (slot views are no
    inference tensors) are staged first: all commit per tensor, as before."""
    trainer = Many()
    scheme = MultiProcessWeightSyncScheme(timeout=30, **options)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, make) as lb:
        ptrs = [p.data_ptr() for p in lb.models[0].parameters()]
        for k in range(1, 4):
            _stamp(trainer, float(k))
            await scheme.send()
            assert _stamped(lb.models[0], float(k))
        assert _receivers(lb)[0]._committer.bucket is None
        if options.get("commit") == "copy":
            assert [p.data_ptr() for p in lb.models[0].parameters()] == ptrs  # stable addresses
        if make is _inference_many:
            assert all(t.is_inference() for t in lb.models[0].state_dict().values())
