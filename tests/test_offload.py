"""Activation offload (memopt.offload, memopt.OffloadEngine).

On CPU the engine runs its whole path (pack, host copy, pool, coalescing, unpack) with
``allow_cpu_source=True`` on pageable memory; the CUDA tests (marked gpu) check streams, peak
memory and stale reads on a GPU.
"""

from __future__ import annotations

import copy
import importlib
import random
import warnings

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy

import memopt
from tests.helpers import gpu

checkpoint_module = importlib.import_module("memopt.checkpoint")
offload_module = importlib.import_module("memopt.offload")


def cpu_engine(**kwargs) -> memopt.OffloadEngine:
    kwargs.setdefault("pin_memory", False)
    kwargs.setdefault("allow_cpu_source", True)
    kwargs.setdefault("coalesce_bytes", 0)
    kwargs.setdefault("staging_bytes", 0)
    return memopt.OffloadEngine(**kwargs)


def cpu_offload(**kwargs) -> memopt.Offload:
    kwargs.setdefault("pin_memory", False)
    kwargs.setdefault("allow_cpu_source", True)
    kwargs.setdefault("min_bytes", 0)
    return memopt.offload(**kwargs)


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, exact_offset: bool = True) -> None:
    """Same dtype, device, sizes, strides and values. Coalesced tensors come back inside their
    group's shared buffer, so their storage offset is shifted (``exact_offset=False``)."""
    assert got.dtype == want.dtype and got.device == want.device
    assert got.shape == want.shape and got.stride() == want.stride()
    if exact_offset:
        assert got.storage_offset() == want.storage_offset()
    assert torch.equal(got, want)


def random_tensor(shape, dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, dtype=dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.complex64]


# --- engine round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("coalesce", [False, True], ids=["single", "coalesced"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_dtypes(dtype, coalesce):
    engine = cpu_engine(coalesce_bytes=2**20 if coalesce else 0, staging_bytes=2**20)
    tensors = [random_tensor(s, dtype) for s in [(), (0,), (97,), (7, 13), (2, 3, 5)]]
    handles = [engine.pack(t) for t in tensors]
    engine.end_group()
    assert all(h >= 0 for h in handles)
    for h, t in zip(handles, tensors):
        got = engine.unpack(h)
        assert_same_tensor(got, t, exact_offset=not coalesce)
        if t.numel():
            assert got.data_ptr() != t.data_ptr()
    assert engine.stats()["copies_to_host"] == (1 if coalesce else len(tensors))


@pytest.mark.parametrize("coalesce", [False, True], ids=["single", "coalesced"])
def test_round_trip_non_contiguous(coalesce):
    engine = cpu_engine(coalesce_bytes=2**20 if coalesce else 0, staging_bytes=2**20)
    tensors = [
        torch.randn(12, 9).t(),                       # transposed
        torch.randn(10, 11)[1::3, 2::2],              # strided slice with an offset
        torch.randn(5, 1).expand(5, 4),               # stride 0
        torch.randn(4, 6, 8).permute(2, 0, 1),        # permuted
        torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
        torch.randn(30)[7:],                          # storage offset
    ]
    handles = [engine.pack(t) for t in tensors]
    engine.end_group()
    for h, t in zip(handles, tensors):
        assert_same_tensor(engine.unpack(h), t, exact_offset=not coalesce)


@pytest.mark.parametrize("coalesce", [False, True], ids=["single", "coalesced"])
def test_views_of_one_storage_are_copied_once_and_share_the_restored_storage(coalesce):
    engine = cpu_engine(coalesce_bytes=2**20 if coalesce else 0, staging_bytes=2**20)
    base = torch.randn(16, 8)
    views = [base, base[2:], base.t(), base.view(8, 16), base[:, 3]]
    handles = [engine.pack(v) for v in views]
    engine.end_group()
    stats = engine.stats()
    assert stats["copies_to_host"] == 1
    assert stats["bytes_to_host"] == base.untyped_storage().nbytes()
    assert stats["tensors_deduplicated"] == len(views) - 1
    restored = [engine.unpack(h) for h in handles]
    for got, want in zip(restored, views):
        assert_same_tensor(got, want, exact_offset=not coalesce)
    # The views keep their offsets relative to one another inside the one restored storage.
    shift = restored[0].storage_offset()
    assert all(got.storage_offset() - shift == want.storage_offset() for got, want in zip(restored, views))
    pointers = {r.untyped_storage().data_ptr() for r in restored}
    assert len(pointers) == 1 and base.untyped_storage().data_ptr() not in pointers
    assert engine.stats()["copies_to_device"] == 1


def test_tensor_saved_twice_is_copied_once():
    engine = cpu_engine()
    x = torch.randn(64, 64)
    h1, h2 = engine.pack(x), engine.pack(x)
    assert engine.stats()["copies_to_host"] == 1
    assert_same_tensor(engine.unpack(h2), x)
    assert_same_tensor(engine.unpack(h1), x)


def test_storage_modified_between_two_saves_is_copied_again():
    engine = cpu_engine()
    x = torch.randn(32, 32)
    first = engine.pack(x)
    x.mul_(2)
    second = engine.pack(x)
    assert engine.stats()["copies_to_host"] == 2
    assert_same_tensor(engine.unpack(second), x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        engine.unpack(first)


def test_in_place_modification_after_save_raises_like_autograd():
    def run(ctx):
        a = torch.randn(8, 8, requires_grad=True)
        with ctx:
            y = a.exp()  # exp saves its result
        y.add_(1)
        y.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(torch.enable_grad())  # plain autograd: the behaviour to match
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*expected version 0"):
        run(cpu_offload())


def test_release_returns_blocks_to_the_pool_and_unknown_handles_raise():
    engine = cpu_engine()
    handles = [engine.pack(torch.randn(1000)) for _ in range(3)]
    held = engine.stats()["pool_bytes_held"]
    assert engine.stats()["pool_bytes_in_use"] == held > 0
    for h in handles:
        engine.release(h)
    stats = engine.stats()
    assert stats["pool_bytes_in_use"] == 0 and stats["pool_bytes_held"] == held and stats["live_handles"] == 0
    handles = [engine.pack(torch.randn(1000)) for _ in range(3)]
    stats = engine.stats()
    assert stats["pool_hits"] == 3 and stats["pool_misses"] == 3 and stats["pool_bytes_held"] == held
    with pytest.raises(RuntimeError, match="handle 123456 is unknown"):
        engine.unpack(123456)


def test_coalescing_many_small_tensors_makes_one_copy_per_group():
    engine = cpu_engine(coalesce_bytes=4096, staging_bytes=2**20)
    tensors = [torch.randn(n) for n in (1, 3, 17, 100, 255)]
    handles = [engine.pack(t) for t in tensors]
    big = torch.randn(2048)  # 8 KiB >= coalesce_bytes: its own copy
    big_handle = engine.pack(big)
    engine.begin_group()
    later = torch.randn(5)
    later_handle = engine.pack(later)
    engine.end_group()
    stats = engine.stats()
    assert stats["tensors_coalesced"] == 6
    assert stats["copies_to_host"] == 3  # group 1's staging, the big tensor, group 2's staging
    for h, t in zip(handles + [big_handle, later_handle], tensors + [big, later]):
        assert_same_tensor(engine.unpack(h), t, exact_offset=t is big)


def test_counters_and_layer_ahead_prefetch():
    engine = cpu_engine(prefetch=1)
    sizes = [(100,), (200,), (300,)]
    tensors, handles = [], []
    for s in sizes:
        engine.begin_group()
        tensors.append(torch.randn(s))
        handles.append(engine.pack(tensors[-1]))
    engine.end_group()
    expected = sum(t.untyped_storage().nbytes() for t in tensors)
    stats = engine.stats()
    assert (stats["bytes_to_host"], stats["copies_to_host"], stats["tensors_offloaded"]) == (expected, 3, 3)
    assert stats["bytes_to_device"] == 0
    # Backward order: the last group first. Unpacking group g restores g-1 ahead of need.
    assert_same_tensor(engine.unpack(handles[2]), tensors[2])
    stats = engine.stats()
    assert stats["demand_transfers"] == 1 and stats["prefetched_transfers"] == 1 and stats["copies_to_device"] == 2
    assert_same_tensor(engine.unpack(handles[1]), tensors[1])
    assert_same_tensor(engine.unpack(handles[0]), tensors[0])
    stats = engine.stats()
    assert (stats["demand_transfers"], stats["prefetched_transfers"]) == (1, 2)
    assert (stats["bytes_to_device"], stats["copies_to_device"]) == (expected, 3)
    assert stats["wait_seconds"] == 0.0


def test_prefetch_skips_groups_without_copies():
    engine = cpu_engine(prefetch=1)
    first = torch.randn(10)
    h_first = engine.pack(first)
    engine.begin_group()  # a layer that saved nothing
    engine.begin_group()
    last = torch.randn(10)
    h_last = engine.pack(last)
    engine.end_group()
    assert_same_tensor(engine.unpack(h_last), last)
    assert engine.stats()["prefetched_transfers"] == 1
    assert_same_tensor(engine.unpack(h_first), first)
    assert engine.stats()["demand_transfers"] == 1


def test_prefetch_group_restores_on_request():
    engine = cpu_engine(prefetch=0)
    x = torch.randn(50)
    h = engine.pack(x)
    group = engine.current_group()
    engine.prefetch_group(group)
    assert engine.stats()["prefetched_transfers"] == 1
    assert_same_tensor(engine.unpack(h), x)
    assert engine.stats()["demand_transfers"] == 0


def test_host_budget_refuses_and_counts():
    budget = 3 * 4096
    engine = cpu_engine(max_host_bytes=budget)
    tensors = [torch.randn(1024) for _ in range(5)]  # 4 KiB each, one 4 KiB size class each
    handles = [engine.pack(t) for t in tensors]
    assert handles[3] == handles[4] == -1 and min(handles[:3]) >= 0
    stats = engine.stats()
    assert stats["refused_tensors"] == 2 and stats["refused_bytes"] == 2 * 4096
    assert stats["pool_bytes_held"] <= budget
    engine.release(handles[0])
    assert engine.pack(tensors[3]) >= 0  # room again


def test_host_budget_evicts_idle_blocks_of_other_classes():
    engine = cpu_engine(max_host_bytes=16384)
    h = engine.pack(torch.randn(4096))  # 16 KiB class
    engine.release(h)
    small = [engine.pack(torch.randn(1024)) for _ in range(4)]  # 4 x 4 KiB, needs the idle 16 KiB back
    assert min(small) >= 0
    assert engine.stats()["pool_bytes_held"] <= 16384


def test_host_budget_below_staging_bytes_takes_the_small_tensors_that_fit():
    """A staging buffer holds the budget of the bytes packed into it so far (their size class),
    not of staging_bytes (64 MiB by default): under a smaller budget small tensors go to the host
    until it is full, and a large tensor still fits beside them."""
    piece, big_bytes = 2**18, 4 * 2**20  # 256 KiB: coalesced under the default coalesce_bytes (4 MiB)
    budget = 3 * piece + big_bytes
    engine = cpu_engine(max_host_bytes=budget, coalesce_bytes=offload_module.DEFAULT_COALESCE_BYTES,
                        staging_bytes=offload_module.DEFAULT_STAGING_BYTES)
    small = [torch.randn(piece // 4) for _ in range(4)]
    big = torch.randn(big_bytes // 4)  # not under coalesce_bytes: a copy of its own
    handles = [engine.pack(small[0])]
    assert engine.stats()["host_bytes_committed"] == piece
    handles.append(engine.pack(big))
    handles += [engine.pack(t) for t in small[1:]]
    assert min(handles[:4]) >= 0 and handles[4] == -1  # the fourth small tensor is past the budget
    engine.end_group()
    stats = engine.stats()
    assert (stats["tensors_coalesced"], stats["copies_to_host"], stats["bytes_to_host"]) == (3, 2, budget)
    assert (stats["refused_tensors"], stats["refused_bytes"]) == (1, piece)
    assert stats["host_bytes_committed"] == stats["pool_bytes_in_use"] == budget
    for h, t in zip(handles, [small[0], big, small[1], small[2]]):
        assert_same_tensor(engine.unpack(h), t, exact_offset=t is big)
    for h in handles[:4]:
        engine.release(h)
    stats = engine.stats()
    assert (stats["live_transfers"], stats["host_bytes_committed"], stats["pool_bytes_in_use"]) == (0, 0, 0)


def test_storage_grown_after_pack_keeps_its_packed_bytes():
    """A coalesced storage is copied at flush time into the segment laid out at pack time: only
    the bytes it had when packed fit there (copying its current size ran past the staging buffer)."""
    engine = cpu_engine(coalesce_bytes=2**20, staging_bytes=2**20)
    first, second = torch.randn(100), torch.randn(100)
    want = [first.clone(), second.clone()]
    handles = [engine.pack(first), engine.pack(second)]
    second.untyped_storage().resize_(8 * second.untyped_storage().nbytes())  # keeps its bytes as a prefix
    engine.end_group()
    for h, t in zip(handles, want):
        assert_same_tensor(engine.unpack(h), t, exact_offset=False)


def test_failed_flush_raises_and_leaves_the_engine_consistent():
    engine = cpu_engine(coalesce_bytes=2**20, staging_bytes=2**20)
    kept, shrunk = torch.randn(100), torch.randn(100)
    handles = [engine.pack(kept), engine.pack(shrunk)]
    group = engine.current_group()
    shrunk.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="shrank from 400 to 0 bytes"):
        engine.end_group()
    # Its tensors never reached the host: unpack says so instead of restoring uncopied bytes.
    with pytest.raises(RuntimeError, match="never reached the host"):
        engine.unpack(handles[0])
    engine.prefetch_group(group)
    assert engine.stats()["prefetched_transfers"] == 0
    for h in handles:
        engine.release(h)
    stats = engine.stats()
    assert (stats["live_transfers"], stats["host_bytes_committed"], stats["pool_bytes_in_use"]) == (0, 0, 0)
    later = torch.randn(50)
    handle = engine.pack(later)
    engine.end_group()
    assert_same_tensor(engine.unpack(handle), later, exact_offset=False)


def test_pack_whose_host_block_cannot_be_allocated_gives_its_budget_back():
    if not hasattr(torch._C, "_construct_storage_from_data_pointer"):
        pytest.skip("this torch cannot make a storage over foreign memory")
    backing = torch.zeros(4)
    # A storage that claims 4 PiB over 16 real bytes: allocating its host block fails before
    # anything is read from it.
    huge = torch._C._construct_storage_from_data_pointer(backing.data_ptr(), backing.device, 2**52)
    tensor = torch.empty(0).set_(huge, 0, (4,), (1,))
    engine = cpu_engine()
    with pytest.raises(RuntimeError):
        engine.pack(tensor)
    stats = engine.stats()
    assert (stats["live_transfers"], stats["host_bytes_committed"], stats["pool_bytes_in_use"]) == (0, 0, 0)
    small = torch.randn(64)
    assert_same_tensor(engine.unpack(engine.pack(small)), small)


# --- through autograd -----------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def transformer_stack(depth=3, d_model=32, dropout=0.1, device="cpu", dtype=torch.float32):
    layers = nn.ModuleList(
        nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=64, dropout=dropout, batch_first=True,
                                   norm_first=True)
        for _ in range(depth))
    return layers.to(device=device, dtype=dtype)


def run_stack(layers, x):
    # The math attention backend: fused attention backward kernels may accumulate with atomics,
    # which would make two runs differ in the last bit with or without offload.
    with sdpa_kernel(SDPBackend.MATH):
        for layer in layers:
            x = layer(x)
    return x


def grads_of(model, inputs, forward, off=None, seed=1):
    """(output, input grad, parameter grads) of forward(model, x).square().mean()."""
    x = inputs.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if off is None:
        out = forward(model, x)
    else:
        with off:
            out = forward(model, x)
    out.float().square().mean().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


def assert_bit_identical(got, want):
    out_g, xg_g, pg_g = got
    out_w, xg_w, pg_w = want
    assert torch.equal(out_g, out_w)
    assert torch.equal(xg_g, xg_w)
    assert all(torch.equal(a, b) for a, b in zip(pg_g, pg_w))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("coalesce_bytes", [0, 2**20])
def test_mlp_gradients_bit_identical(prefetch, coalesce_bytes):
    model = MLP()
    x = torch.randn(6, 32)
    want = grads_of(model, x, lambda m, t: m(t))
    off = cpu_offload(prefetch=prefetch, coalesce_bytes=coalesce_bytes)
    groups = memopt.offload_module_groups(off, model.layers)
    got = grads_of(model, x, lambda m, t: m(t), off)
    groups.remove()
    assert_bit_identical(got, want)
    stats = off.stats()
    assert stats["tensors_offloaded"] > 0 and stats["live_handles"] == 0
    assert stats["bytes_to_device"] == stats["bytes_to_host"]


def test_transformer_gradients_bit_identical_with_dropout():
    layers = transformer_stack()
    x = torch.randn(2, 7, 32)
    want = grads_of(layers, x, run_stack)
    off = cpu_offload(prefetch=1)
    memopt.offload_module_groups(off, layers)
    got = grads_of(layers, x, run_stack, off)
    assert_bit_identical(got, want)
    assert off.stats()["prefetched_transfers"] > 0


def test_retain_graph_second_backward_matches():
    model = MLP(depth=2)
    x = torch.randn(4, 32, requires_grad=True)
    off = cpu_offload()
    memopt.offload_module_groups(off, model.layers)
    with off:
        loss = model(x).square().sum()
    first = torch.autograd.grad(loss, [x, *model.parameters()], retain_graph=True)
    second = torch.autograd.grad(loss, [x, *model.parameters()])
    want = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    for a, b, c in zip(first, second, want):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_budget_through_autograd_keeps_gradients_identical():
    model = MLP()
    x = torch.randn(6, 32)
    want = grads_of(model, x, lambda m, t: m(t))
    off = cpu_offload(max_host_bytes=3 * 4096, coalesce_bytes=0, staging_bytes=0)
    got = grads_of(model, x, lambda m, t: m(t), off)
    assert_bit_identical(got, want)
    stats = off.stats()
    assert stats["refused_tensors"] > 0 and stats["tensors_offloaded"] > 0


@pytest.mark.parametrize("group_per_layer", [True, False], ids=["group-per-layer", "one-group"])
def test_budget_below_staging_bytes_through_autograd(group_per_layer):
    """Default coalescing (tensors under 4 MiB share a 64 MiB staging buffer) under a budget of
    3.5 saved tensors: the first three go to the host, the fourth stays, gradients are unchanged."""
    piece = 2**18  # each tanh saves its 256 KiB output
    layers = nn.ModuleList(nn.Tanh() for _ in range(4))
    x = torch.randn(piece // 8, dtype=torch.float64)

    def forward(m, t):
        for layer in m:
            t = layer(t)
        return t

    want = grads_of(layers, x, forward)
    off = cpu_offload(max_host_bytes=3 * piece + piece // 2)
    if group_per_layer:
        memopt.offload_module_groups(off, layers)
    got = grads_of(layers, x, forward, off)
    assert_bit_identical(got, want)
    stats = off.stats()
    assert (stats["tensors_offloaded"], stats["tensors_coalesced"], stats["bytes_to_host"]) == (3, 3, 3 * piece)
    assert (stats["refused_tensors"], stats["refused_bytes"]) == (1, piece)
    assert (stats["live_handles"], stats["host_bytes_committed"]) == (0, 0)


def test_min_bytes_and_parameters_are_never_offloaded():
    weight = nn.Parameter(torch.randn(64, 64))
    leaf = torch.randn(16, 64, requires_grad=True)
    off = cpu_offload(min_bytes=16 * 64 * 4)
    with off:
        big = leaf * 2              # 4 KiB activation, saved by the linear below
        small = big[:2] * 1.0       # 512 B
        out = torch.nn.functional.linear(big, weight).sum() + (small * small).sum()
    out.backward()
    stats = off.stats()
    # linear saves big (offloaded) and weight (a parameter); small * small saves small twice.
    assert stats["tensors_offloaded"] == 1
    assert stats["bytes_to_host"] == big.untyped_storage().nbytes()


def test_tensor_saved_twice_through_autograd_is_copied_once():
    leaf = torch.randn(32, 32, requires_grad=True)
    off = cpu_offload()
    with off:
        a = leaf * 2
        y = a * a  # mul saves both operands: the same tensor twice
    y.sum().backward()
    stats = off.stats()
    assert (stats["tensors_offloaded"], stats["tensors_deduplicated"], stats["copies_to_host"]) == (2, 1, 1)
    assert torch.equal(leaf.grad, 8 * leaf.detach())


@pytest.mark.parametrize("use_offload", [False, True])
def test_offloaded_activation_is_freed_after_forward(use_offload):
    """The point of offload: autograd no longer holds the activation once it was copied out."""
    import weakref

    leaf = torch.randn(64, 64, requires_grad=True)
    off = cpu_offload(coalesce_bytes=0, staging_bytes=0)
    with off if use_offload else torch.enable_grad():
        a = leaf * 2
        y = a.sin()  # sin saves its input a
    alive = weakref.ref(a)
    del a
    assert (alive() is None) == use_offload
    y.sum().backward()
    assert torch.equal(leaf.grad, 2 * torch.cos(2 * leaf.detach()))


def test_cpu_default_is_a_no_op():
    model = MLP()
    x = torch.randn(6, 32)
    want = grads_of(model, x, lambda m, t: m(t))
    off = memopt.offload(min_bytes=0)
    got = grads_of(model, x, lambda m, t: m(t), off)
    assert_bit_identical(got, want)
    stats = off.stats()
    assert stats["tensors_offloaded"] == 0 and stats["copies_to_host"] == 0 and stats["skipped_tensors"] > 0


def test_pool_does_not_grow_over_50_training_steps():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    off = cpu_offload(coalesce_bytes=1024, staging_bytes=2**16)
    memopt.offload_module_groups(off, model.layers)
    held, misses = [], []
    for _ in range(50):
        x = torch.randn(6, 32)
        with off:
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = off.stats()
        held.append(stats["pool_bytes_held"])
        misses.append(stats["pool_misses"])
        assert stats["live_handles"] == 0 and stats["pool_bytes_in_use"] == 0
    assert held[0] > 0 and held[-1] == held[0]
    assert misses[-1] == misses[0]
    assert off.stats()["pool_hits"] > 0


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="min_bytes"):
        memopt.offload(min_bytes=-1)
    with pytest.raises(ValueError, match="prefetch"):
        memopt.offload(prefetch=1.5)
    with pytest.raises(ValueError, match="max_host_bytes"):
        memopt.offload(max_host_bytes=-5)
    with pytest.raises(ValueError, match="staging_bytes"):
        memopt.offload(coalesce_bytes=10, staging_bytes=5)
    with pytest.raises(RuntimeError, match="allow_cpu_source"):
        memopt.OffloadEngine(pin_memory=False).pack(torch.randn(4))
    with pytest.raises(TypeError, match="off must be a memopt.Offload"):
        memopt.offload_module_groups(object(), [])
    off = cpu_offload()
    with off:
        with pytest.raises(RuntimeError, match="already active"):
            off.__enter__()


def test_offload_module_groups_registers_no_hook_when_an_item_is_not_a_module():
    off = cpu_offload()
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(TypeError, match="modules must be nn.Modules") as info:
        memopt.offload_module_groups(off, [a, b, "not a module"])
    assert len(a._forward_pre_hooks) == len(b._forward_pre_hooks) == 0
    assert "got str at index 2" in str(info.value)
    with off:
        group = off.engine.current_group()
        b(a(torch.randn(2, 4)))
        assert off.engine.current_group() == group
    # A one-shot iterable is read once: every module of a generator gets its hook.
    hooks = memopt.offload_module_groups(off, (m for m in (a, b)))
    assert len(a._forward_pre_hooks) == len(b._forward_pre_hooks) == 1
    with off:
        group = off.engine.current_group()
        b(a(torch.randn(2, 4)))
        assert off.engine.current_group() == group + 2
    hooks.remove()
    assert len(a._forward_pre_hooks) == len(b._forward_pre_hooks) == 0


# --- the version check on tensors kept where they are ----------------------------------------
#
# While saved-tensors hooks are active autograd checks no version counter itself: the hooks must.
# The engine checks what it copies; ``Offload`` checks what it keeps where it is (parameters,
# tensors under min_bytes, CPU tensors by default, inputs kept on the device by
# ``memopt.checkpoint(offload=...)``, tensors the host budget refuses). Each case is run with
# ``offload`` False (plain PyTorch: the behaviour to match) and True.

KEPT_MESSAGE = "modified by an inplace operation: .*which memopt.offload saved for backward, is at version"


def _kept_parameter(engine):
    def run(offload, mutate):
        torch.manual_seed(0)
        lin = nn.Linear(8, 8).double()
        x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        off = engine() if offload else None
        with off if offload else torch.enable_grad():
            y = torch.tanh(lin(x))
        if mutate:
            with torch.no_grad():
                lin.weight.mul_(2)  # an optimizer step or an EMA update before the backward
        y.sum().backward()
        if off is not None:
            assert off.stats()["skipped_tensors"] > 0  # the weight (and bias) stayed where they are
        return [x.grad, lin.weight.grad, lin.bias.grad]

    return run


def _kept_checkpoint_input(policy):
    def run(offload, mutate):
        torch.manual_seed(0)
        w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
        mask = torch.randn(4, 8, dtype=torch.float64)  # needs no grad: held by the caller, kept on the device

        def fn(m):
            return torch.tanh(m @ w)

        off = cpu_offload()
        y = memopt.checkpoint(fn, mask, policy=policy, offload=off) if offload else fn(mask)
        if mutate:
            mask.add_(1.0)
        y.sum().backward()
        if offload:
            assert off.stats()["skipped_tensors"] > 0
        return [w.grad]

    return run


def _exp_of_activation(**engine_kwargs):
    def run(offload, mutate):
        torch.manual_seed(0)
        leaf = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
        off = cpu_offload(**engine_kwargs)
        with off if offload else torch.enable_grad():
            y = (leaf * 2).exp()  # exp saves its result, an activation
        z = y * 1.0
        if mutate:
            with torch.no_grad():
                y.add_(1)
        z.sum().backward()
        if offload:
            stats = off.stats()
            assert stats["tensors_offloaded"] == 0
            if engine_kwargs.get("max_host_bytes") == 0:
                assert stats["refused_tensors"] > 0
        return [leaf.grad]

    return run


def _fused_block_cpu_default(offload, mutate):
    torch.manual_seed(0)
    block = memopt.FusedCheckpointBlock(16, 2, 24, dtype=torch.float64, offload=offload)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    y = block(x)
    if mutate:
        with torch.no_grad():
            block.fc2.weight.mul_(2)
    y.sum().backward()
    return [x.grad, *[p.grad for p in block.parameters()]]


KEPT_CASES = {
    "parameter": _kept_parameter(cpu_offload),
    "parameter-cpu-default": _kept_parameter(lambda: memopt.offload(min_bytes=0)),
    "checkpoint-input-full": _kept_checkpoint_input("full"),
    "checkpoint-input-selective": _kept_checkpoint_input("selective"),
    "under-min-bytes": _exp_of_activation(min_bytes=2**20),
    "budget-refused": _exp_of_activation(max_host_bytes=0),
    "fused-block-cpu-default": _fused_block_cpu_default,
}


@pytest.mark.parametrize("case", KEPT_CASES)
def test_kept_tensor_modified_in_place_raises_like_autograd(case):
    run = KEPT_CASES[case]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(offload=False, mutate=True)  # plain PyTorch: the behaviour to match
    with pytest.raises(RuntimeError, match=KEPT_MESSAGE):
        run(offload=True, mutate=True)


@pytest.mark.parametrize("case", KEPT_CASES)
def test_kept_tensors_without_in_place_changes_give_identical_gradients(case):
    run = KEPT_CASES[case]
    want = run(offload=False, mutate=False)
    got = run(offload=True, mutate=False)
    assert len(got) == len(want)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_kept_tensor_error_names_shape_and_versions_as_the_engine_does():
    off = memopt.offload(min_bytes=0)  # CPU tensors stay where they are
    weight = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    with off:
        y = (weight * 1).exp()
    with torch.no_grad():
        y.add_(1)
        y.mul_(2)
    with pytest.raises(RuntimeError) as kept:
        y.sum().backward()
    engine = cpu_offload()
    with engine:
        y = (weight * 1).exp()
    with torch.no_grad():
        y.add_(1)
        y.mul_(2)
    with pytest.raises(RuntimeError) as copied:
        y.sum().backward()
    assert engine.stats()["tensors_offloaded"] == 1
    assert str(kept.value) == str(copied.value)  # one wording, whichever way the tensor went
    assert "[Double [3, 5]], which memopt.offload saved for backward, is at version 2; expected version 0" in str(
        kept.value
    )


def test_kept_tensor_modified_before_it_was_saved_is_fine():
    """The version is the one at save time: writes before the save, and a retained graph's
    second backward, are as plain autograd has them."""

    def run(ctx):
        leaf = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with ctx:
            a = leaf * 2
            a.add_(1)  # before sin saves it
            y = a.sin()
        y.sum().backward(retain_graph=True)
        first = leaf.grad.clone()
        y.sum().backward()
        return first, leaf.grad

    want = run(torch.enable_grad())
    for off in (memopt.offload(min_bytes=0), cpu_offload(min_bytes=2**20), cpu_offload(max_host_bytes=0)):
        got = run(off)
        assert all(torch.equal(g, w) for g, w in zip(got, want))



class _MatmulThenInPlace(nn.Module):
    """Linear then ReLU(inplace=True), and a matmul output scaled in place: selective
    checkpointing caches both matmul outputs and the forward writes into both."""

    def __init__(self, d=8):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.act = nn.ReLU(inplace=True)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(x))).mul_(2).tanh()


def _offload_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


KEEPING_ENGINES = {
    "cpu-default": lambda: memopt.offload(min_bytes=0),
    "under-min-bytes": lambda: cpu_offload(min_bytes=2**30),
    "budget-refused": lambda: cpu_offload(max_host_bytes=0),
}


@pytest.mark.parametrize("hooks_path", ["torch", "fallback"])
@pytest.mark.parametrize(
    "policy, how",
    [("selective", "offload="), ("selective", "active engine"), ("cpu-offload-function", "offload="),
     ("cpu-offload-function", "active engine"), ("cpu-offload-function", "default engine")],
)  # fmt: skip
@pytest.mark.parametrize("kind", KEEPING_ENGINES)
def test_kept_cache_entries_written_into_during_the_forward_stay_exact(monkeypatch, kind, policy, how, hooks_path):
    """memopt.checkpoint's guard hands the recompute a copy of a cached output the forward wrote
    into (note [what a recompute may rely on] in memopt/checkpoint.py) and drops the cache's own
    entry unread: the version check on kept tensors must not turn that legal case into an error.
    A write into a cached output after the forward still raises."""
    if policy != "selective" and not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):
        pytest.skip("this torch's CheckpointPolicy has no CPU-offload values")
    if hooks_path == "fallback":
        monkeypatch.setattr(checkpoint_module, "_CHECKPOINT_RESPECTS_HOOKS", False)  # torch 2.11..2.13's path
    engine = KEEPING_ENGINES[kind]()
    monkeypatch.setattr(offload_module, "_DEFAULT", engine)  # what a CPU-offload answer takes outside any engine
    policy_arg = "selective" if policy == "selective" else _offload_matmuls
    torch.manual_seed(0)
    layer = _MatmulThenInPlace().double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(layer(x).square().sum(), [x, *layer.parameters()])

    def run(fn, *args):
        if how == "offload=":
            return memopt.checkpoint(fn, *args, policy=policy_arg, offload=engine)
        if how == "active engine":
            with engine:
                return memopt.checkpoint(fn, *args, policy=policy_arg)
        return memopt.checkpoint(fn, *args, policy=policy_arg)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 asked nothing on the fallback path
        got = torch.autograd.grad(run(layer, x).square().sum(), [x, *layer.parameters()])
        y, z = run(lambda x, w: ((y := x @ w), y.sin()), x, w)
    assert engine.stats()["tensors_offloaded"] == 0  # everything stayed where it was
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        y.mul_(2)  # after the forward: the value at save time is gone
    with pytest.raises(RuntimeError, match="modified by an inplace operation|changed in place after the checkpointed"):
        z.sum().backward()

# --- benchmark ------------------------------------------------------------------------------


def test_bench_cpu_preset_writes_rows(tmp_path):
    from bench import offload as bench_offload

    path = bench_offload.main(["--preset", "cpu", "--out", str(tmp_path / "rows.json")])
    import json

    rows = json.loads(open(path).read())
    keys = {"config", "provider", "metric", "unit", "value", "device", "torch", "commit", "date"}
    assert rows and all(keys <= set(r) for r in rows)
    providers = {r["provider"] for r in rows}
    assert {"none", "offload"} <= providers
    moved = [r["value"] for r in rows if r["provider"] == "offload" and r["metric"] == "bytes_to_host"]
    assert moved and all(v > 0 for v in moved)


# --- GPU ------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gpu_gradients_bit_identical(dtype, prefetch):
    layers = transformer_stack(depth=4, d_model=128, device="cuda", dtype=dtype)
    x = torch.randn(4, 256, 128, device="cuda", dtype=dtype)
    want = grads_of(layers, x, run_stack)
    off = memopt.offload(min_bytes=2**14, prefetch=prefetch)
    memopt.offload_module_groups(off, layers)
    got = grads_of(layers, x, run_stack, off)
    assert_bit_identical(got, want)
    stats = off.stats()
    assert stats["tensors_offloaded"] > 0 and stats["bytes_to_device"] == stats["bytes_to_host"]


def _peak_activation_bytes(depth, use_offload):
    torch.manual_seed(0)
    layers = transformer_stack(depth=depth, d_model=256, dropout=0.0, device="cuda")
    x = torch.randn(8, 512, 256, device="cuda", requires_grad=True)
    param_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    off = memopt.offload(min_bytes=2**16, prefetch=1) if use_offload else None
    if off is not None:
        memopt.offload_module_groups(off, layers)
    for _ in range(2):  # the second step runs with a warm pool and allocator
        layers.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if off is None:
            out = run_stack(layers, x)
        else:
            with off:
                out = run_stack(layers, x)
        out.square().mean().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - param_bytes  # parameter grads
    return peak


@gpu
def test_gpu_peak_memory_does_not_grow_with_depth():
    plain4, plain16 = _peak_activation_bytes(4, False), _peak_activation_bytes(16, False)
    per_layer = (plain16 - plain4) / 12
    assert per_layer > 0
    off4, off16 = _peak_activation_bytes(4, True), _peak_activation_bytes(16, True)
    assert off16 < plain16
    assert off16 - off4 <= 2 * per_layer, (off4, off16, per_layer)


@gpu
def test_gpu_host_pool_flat_over_200_steps():
    layers = transformer_stack(depth=4, d_model=128, device="cuda")
    opt = torch.optim.SGD(layers.parameters(), lr=1e-4)
    off = memopt.offload(min_bytes=2**14)
    memopt.offload_module_groups(off, layers)
    held = []
    for _ in range(200):
        x = torch.randn(4, 128, 128, device="cuda")
        with off:
            loss = run_stack(layers, x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        held.append(off.stats()["pool_bytes_held"])
    assert held[0] > 0 and held[-1] == held[1]
    assert off.stats()["live_handles"] == 0


@gpu
def test_gpu_stress_random_delays_no_stale_reads():
    """Random device-side sleeps on the compute stream around every layer, forward and backward:
    a missing stream wait shows up as a stale or half-copied tensor, so gradients would differ."""
    layers = transformer_stack(depth=6, d_model=128, dropout=0.0, device="cuda")
    rng = random.Random(0)

    def sleep(*_):
        torch.cuda._sleep(rng.randint(0, 200_000))

    for layer in layers:
        layer.register_forward_pre_hook(sleep)
        layer.register_forward_hook(sleep)
        layer.register_full_backward_pre_hook(sleep)
    reference = copy.deepcopy(layers)
    for step in range(10):
        x = torch.randn(4, 256, 128, device="cuda")
        want = grads_of(reference, x, run_stack, seed=step)
        off = memopt.offload(min_bytes=2**12, prefetch=rng.randint(0, 2), coalesce_bytes=2**16)
        groups = memopt.offload_module_groups(off, layers)
        got = grads_of(layers, x, run_stack, off, seed=step)
        groups.remove()
        assert_bit_identical(got, want)


# A device-side sleep long enough (about 0.1 s on an H100/H200 clock) that the host gets far ahead.
SLEEP_CYCLES = 200_000_000


@gpu
@pytest.mark.parametrize("coalesce", [False, True], ids=["single", "coalesced"])
def test_gpu_copy_out_waits_for_the_stream_that_produced_the_tensor(coalesce):
    """A tensor produced and packed on a side stream: its group is flushed later under the default
    stream, which has nothing queued, so the copy out must wait on the producer's stream itself."""
    engine = memopt.OffloadEngine(coalesce_bytes=2**20 if coalesce else 0, staging_bytes=2**20)
    base = torch.randn(4096, device="cuda")
    want = base * 3
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)
        x = base * 3  # allocated on the producer stream and written after its sleep
        handle = engine.pack(x)
    engine.end_group()
    got = engine.unpack(handle)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert engine.stats()["tensors_coalesced"] == int(coalesce)


@gpu
def test_gpu_restored_buffer_is_not_reused_while_another_stream_reads_it():
    """Prefetched on one stream, consumed on another: freeing the restored buffer must wait for
    the consumer, or the prefetch stream's next allocation takes the memory while it is read."""
    torch.cuda.empty_cache()  # the reuse below then finds this buffer and no other cached block
    engine = memopt.OffloadEngine(prefetch=0, coalesce_bytes=0)
    numel = 2**19  # 2 MiB of float32
    x = torch.randn(numel, device="cuda")
    want = x.clone()
    handle = engine.pack(x)
    group = engine.current_group()
    engine.end_group()
    del x
    prefetcher = torch.cuda.Stream()
    with torch.cuda.stream(prefetcher):
        engine.prefetch_group(group)  # the restored buffer is allocated on `prefetcher`
    torch.cuda.synchronize()  # the copy back has finished
    torch.cuda._sleep(SLEEP_CYCLES)  # the consumer (the default stream) is busy for a while
    got = engine.unpack(handle)
    result = got * 1  # queued behind the sleep: reads the restored buffer late
    engine.release(handle)
    del got  # the restored buffer goes back to the allocator now
    with torch.cuda.stream(prefetcher):
        junk = torch.full((numel,), 7.0, device="cuda")  # runs at once on the idle prefetch stream
    torch.cuda.synchronize()
    assert torch.equal(result, want)
    del junk


@gpu
def test_gpu_refuses_cuda_graph_capture():
    engine = memopt.OffloadEngine(coalesce_bytes=0)
    x = torch.randn(4096, device="cuda")
    handle = engine.pack(x)
    group = engine.current_group()
    engine.end_group()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        calls = [lambda: engine.pack(y), lambda: engine.unpack(handle), engine.begin_group, engine.end_group,
                 lambda: engine.prefetch_group(group), engine.synchronize]
        for call in calls:
            with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
                call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
    assert torch.equal(engine.unpack(handle), x)  # the refusals left the engine usable


@gpu
def test_gpu_host_blocks_are_pinned_at_the_pools_size_class():
    """What max_host_bytes counts is what is pinned: a 5 MiB tensor takes a 5 MiB block (torch's
    pinned allocator would have pinned 8 MiB, the next power of two, and kept it cached)."""
    torch.cuda.synchronize()
    host_stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    host_allocs_before = host_stats().get("num_host_alloc")
    engine = memopt.OffloadEngine(coalesce_bytes=0, prefetch=0)
    x = torch.randn(5 * 2**18, device="cuda")  # 5 MiB of float32: size class 1.25 * 2^22
    handle = engine.pack(x)
    engine.end_group()
    engine.synchronize()
    assert engine.stats()["pool_bytes_held"] == 5 * 2**20
    assert host_stats().get("num_host_alloc") == host_allocs_before
    assert torch.equal(engine.unpack(handle), x)


@gpu
def test_gpu_prefetch_that_finds_the_device_full_is_skipped_and_restored_on_demand():
    engine = memopt.OffloadEngine(prefetch=0, coalesce_bytes=0)
    x = torch.randn(2**24, device="cuda")  # 64 MiB
    want = x.cpu()
    handle = engine.pack(x)
    group = engine.current_group()
    engine.end_group()
    engine.synchronize()
    del x
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    # The allocator may hold 16 MiB more than it does now: too little for the 64 MiB restore.
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2**24) / total)
    try:
        engine.prefetch_group(group)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    stats = engine.stats()
    assert stats["prefetches_skipped_oom"] == 1 and stats["prefetched_transfers"] == 0
    assert torch.equal(engine.unpack(handle).cpu(), want)
    assert engine.stats()["demand_transfers"] == 1
