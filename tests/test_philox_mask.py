"""philox_keep_mask and philox_dropout_scale: bit-exact against the plain PyTorch Philox reference, opcheck,
errors, CUDA == CPU."""

import pytest
import torch

from memopt.ops._philox import dropout_keep_mask
from memopt.ops._rng import rng_key
from memopt.ops.philox_mask import philox_dropout_scale, philox_keep_mask, philox_keep_mask_ref

from helpers import gpu

# Offsets and seeds at the edges of the 32- and 64-bit words: the counter offset + i // 4 carries
# from its low word into its high word, and wraps past 2^63 - 1 (as uint64) at the top.
KEYS = [
    (0, 0),
    (1234, 8),
    (7, 2**32 - 3),
    (2**63 - 1, 2**32 - 1),
    (2**62 + 12345, 2**63 - 2),
    (-1, 2**31),
]


@pytest.mark.parametrize("seed,offset", KEYS)
@pytest.mark.parametrize("shape", [(1,), (5,), (3, 7), (97, 33), (2, 3, 5, 11)])
def test_consecutive_indices_match_reference(seed, offset, shape):
    numel = 1
    for s in shape:
        numel *= s
    index = torch.arange(numel, dtype=torch.int64).view(shape)
    keep = philox_keep_mask(index, 0.3, rng_key(seed, offset))
    assert keep.dtype == torch.bool and keep.shape == index.shape
    assert torch.equal(keep, dropout_keep_mask(shape, 0.3, seed, offset))


@pytest.mark.parametrize("seed,offset", KEYS)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.97])
def test_random_index_sets_match_reference(seed, offset, p):
    generator = torch.Generator().manual_seed(seed & 0xFFFF)
    # Scattered indices, repeats, and short runs that start off a multiple of 4.
    scattered = torch.randint(0, 2**40, (301,), generator=generator)
    runs = torch.randint(0, 10**6, (17, 1), generator=generator) + torch.arange(6)
    for index in (scattered, runs, scattered.view(7, 43).t(), torch.tensor([2**62, 2**62 + 3, 0, 0, 1])):
        key = rng_key(seed, offset)
        assert torch.equal(philox_keep_mask(index, p, key), philox_keep_mask_ref(index, p, key))


def test_attention_chunk_layout_matches_full_mask():
    # Columns 5:12 of a (2, 3, 9, 13) tensor: rows strided by 13, runs of 7 not aligned to 4.
    shape = (2, 3, 9, 13)
    full = dropout_keep_mask(shape, 0.25, 99, 2**32 - 2)
    rows = torch.arange(0, 2 * 3 * 9 * 13, 13).view(2, 3, 9, 1)
    keep = philox_keep_mask(rows + torch.arange(5, 12), 0.25, rng_key(99, 2**32 - 2))
    assert torch.equal(keep, full[..., 5:12])


def test_keep_rate_follows_p():
    index = torch.arange(200_000)
    for p in (0.1, 0.5, 0.9):
        rate = philox_keep_mask(index, p, rng_key(5)).double().mean().item()
        assert abs(rate - (1 - p)) < 0.005


def test_empty_and_threaded_results_agree():
    assert philox_keep_mask(torch.empty(0, 3, dtype=torch.int64), 0.5, rng_key(1)).shape == (0, 3)
    index = torch.arange(50_000) * 3
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = philox_keep_mask(index, 0.4, rng_key(3, 11))
        torch.set_num_threads(max(2, previous))
        multi = philox_keep_mask(index, 0.4, rng_key(3, 11))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(single, multi)


def test_opcheck():
    index = torch.randint(0, 1000, (4, 33))
    torch.library.opcheck(torch.ops.memopt.philox_keep_mask.default, (index, 0.2, rng_key(1, 3)))


def test_compile_fullgraph(compile_cache):
    key = rng_key(11, 4)
    fn = torch.compile(lambda i: philox_keep_mask(i + 1, 0.5, key), backend="aot_eager", fullgraph=True)
    index = torch.arange(40).view(5, 8)
    assert torch.equal(fn(index), philox_keep_mask_ref(index + 1, 0.5, key))


@pytest.mark.parametrize(
    "index,p,error,match",
    [
        (None, 0.1, TypeError, "index must be a tensor"),
        ([0, 1, 2], 0.1, TypeError, "index must be a tensor"),
        (torch.arange(4, dtype=torch.int32), 0.1, ValueError, "index must be int64"),
        (torch.arange(4.0), 0.1, ValueError, "index must be int64"),
        (torch.arange(4), 1.0, ValueError, r"p must be a float in \[0, 1\)"),
        (torch.arange(4), -0.1, ValueError, r"p must be a float in \[0, 1\)"),
        (torch.arange(4), float("nan"), ValueError, r"p must be a float in \[0, 1\)"),
        (torch.arange(4), "0.1", TypeError, r"p must be a float in \[0, 1\)"),
        (torch.arange(4), True, TypeError, r"p must be a float in \[0, 1\)"),
    ],
)
def test_bad_input_names_the_argument(index, p, error, match):
    with pytest.raises(error, match=r"memopt\.philox_keep_mask: " + match):
        philox_keep_mask(index, p, rng_key(1))


def test_negative_index_is_refused_by_the_kernel():
    # Data, not an argument's type: only the kernel sees it (a RuntimeError naming index).
    with pytest.raises(RuntimeError, match="index must hold element indices >= 0"):
        philox_keep_mask(torch.tensor([3, -1]), 0.1, rng_key(1))


# Keys that are not an int64 CPU tensor of shape [2] (memopt.attention's rule). A meta key sent the
# ops to their fake impls: philox_dropout_scale, which has no other tensor argument, returned
# uninitialised memory as a CPU tensor.
BAD_KEYS = {
    "meta": torch.tensor([1, 2], device="meta"),
    "int32": torch.tensor([1, 2], dtype=torch.int32),
    "3 elements": torch.tensor([1, 2, 3]),
    "shape [1, 2]": torch.tensor([[1, 2]]),
}
KEY_RULE = r"rng_key must be an int64 CPU tensor \(seed, offset\) of shape \[2\]"


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_bad_rng_key_is_refused_by_name(key):
    with pytest.raises(ValueError, match=r"memopt\.philox_keep_mask: " + KEY_RULE):
        philox_keep_mask(torch.arange(8), 0.5, key)
    with pytest.raises(ValueError, match=r"memopt\.philox_dropout_scale: " + KEY_RULE):
        philox_dropout_scale([8], [1], 0, 0.5, key)


def test_rng_key_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match=r"memopt\.philox_keep_mask: rng_key must be a tensor"):
        philox_keep_mask(torch.arange(8), 0.5, [1, 2])
    with pytest.raises(TypeError, match=r"memopt\.philox_dropout_scale: rng_key must be a tensor"):
        philox_dropout_scale([8], [1], 0, 0.5, (1, 2))


def test_registered_ops_refuse_a_meta_key():
    # The fake impls are also the ops' Meta kernels, where a meta key dispatches them.
    key = torch.tensor([1, 2], device="meta")
    with pytest.raises(ValueError, match=r"memopt\.philox_keep_mask: rng_key must be an int64 CPU tensor"):
        torch.ops.memopt.philox_keep_mask(torch.arange(8), 0.5, key)
    with pytest.raises(ValueError, match=r"memopt\.philox_dropout_scale: rng_key must be an int64 CPU tensor"):
        torch.ops.memopt.philox_dropout_scale([8], [1], 0, 0.5, key, torch.float32)


@gpu
@pytest.mark.parametrize("seed,offset", KEYS)
def test_cuda_matches_cpu(seed, offset):
    generator = torch.Generator().manual_seed(0)
    index = torch.cat([torch.randint(0, 2**40, (1000,), generator=generator), torch.arange(1025)]).view(5, -1)
    key = rng_key(seed, offset)
    cpu = philox_keep_mask(index, 0.3, key)
    cuda = philox_keep_mask(index.cuda(), 0.3, key)
    assert cuda.device.type == "cuda" and cuda.dtype == torch.bool
    assert torch.equal(cuda.cpu(), cpu)
    assert torch.equal(cpu, philox_keep_mask_ref(index, 0.3, key))


# ---------------------------------------------------------------------------------------------
# philox_dropout_scale: the factor 1 / (1 - p) or 0 of a strided window, no index tensor.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,offset", KEYS)
@pytest.mark.parametrize(
    "full,window",
    [
        ((2, 3, 48, 300), (slice(None), slice(None), slice(5, None), slice(7, 207))),  # lanes, head and tail
        ((1, 2, 33, 30), (slice(None), slice(None), slice(None), slice(None))),  # the whole tensor
        ((2, 2, 20, 129), (slice(None), slice(1, 2), slice(19, None), slice(128, 129))),  # one element per row
        ((3, 1000), (slice(1, 3), slice(3, 1000))),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_scale_of_a_window_matches_reference(seed, offset, full, window, dtype):
    p = 0.3
    strides = [1] * len(full)
    for d in range(len(full) - 2, -1, -1):
        strides[d] = strides[d + 1] * full[d + 1]
    starts = [w.start or 0 for w in window]
    size = [len(range(*w.indices(n))) for w, n in zip(window, full)]
    first = sum(s * st for s, st in zip(starts, strides))
    scale = philox_dropout_scale(size, strides, first, p, rng_key(seed, offset), dtype)
    keep = dropout_keep_mask(full, p, seed, offset)[window]
    assert scale.dtype == dtype and scale.shape == keep.shape and scale.is_contiguous()
    expected = torch.where(keep, torch.tensor(1.0 / (1.0 - p), dtype=dtype), torch.tensor(0.0, dtype=dtype))
    assert torch.equal(scale, expected)


def test_dropout_scale_opcheck_and_compile(compile_cache):
    key = rng_key(4, 9)
    args = ([2, 5, 70], [700, 70, 1], 3, 0.25, key, torch.float32)
    torch.library.opcheck(torch.ops.memopt.philox_dropout_scale.default, args)
    fn = torch.compile(lambda k: philox_dropout_scale([2, 5, 70], [700, 70, 1], 3, 0.25, k), backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(key), philox_dropout_scale(*args))


@pytest.mark.parametrize(
    "args,match",
    [
        (([2, 3], [3, 2], 0, 0.1), "last index stride must be 1"),
        (([2, 3], [3], 0, 0.1), "one entry per dim"),
        (([2, 3], [3, 1], -1, 0.1), "index_offset must be >= 0"),
        (([2, 3], [3, 1], 0, 1.0), r"p must be in \[0, 1\)"),
        (([2, -3], [3, 1], 0, 0.1), "must be >= 0"),
    ],
)
def test_dropout_scale_rejects_bad_windows(args, match):
    with pytest.raises(RuntimeError, match=match):
        philox_dropout_scale(*args, rng_key(1))
