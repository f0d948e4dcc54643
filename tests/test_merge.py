"""The merge on its own: exact, order independent, absent paths and empty rows contribute nothing."""
import itertools

import pytest
import torch

from vllm_gaudi_unified.merge import Partial, Scattered, merge, merge_all, merge_rows, normalize, scatter_merge


def partial_of(scores, values):
    """Partial of full softmax rows: scores [rows, heads, keys], values [keys, dim]."""
    m = scores.amax(-1)
    p = torch.exp(scores - m[..., None])
    return Partial(p @ values, m, p.sum(-1))


def empty(rows, heads, dim):
    return Partial(torch.zeros(rows, heads, dim, dtype=torch.float64),
                   torch.full((rows, heads), float("-inf"), dtype=torch.float64),
                   torch.zeros(rows, heads, dtype=torch.float64))


def test_merging_splits_of_the_keys_equals_softmax_over_all():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 3, 12, generator=g, dtype=torch.float64) * 4
    values = torch.randn(12, 7, generator=g, dtype=torch.float64)
    full = torch.softmax(scores, -1) @ values
    parts = [partial_of(scores[..., a:b], values[a:b]) for a, b in ((0, 3), (3, 4), (4, 12))]
    for order in itertools.permutations(parts):
        torch.testing.assert_close(normalize(merge_all(list(order))), full, atol=1e-12, rtol=0)


def test_absent_path_and_empty_rows_contribute_nothing_and_never_nan():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 2, 6, generator=g, dtype=torch.float64)
    values = torch.randn(6, 3, generator=g, dtype=torch.float64)
    p = partial_of(scores, values)
    for merged in (merge(p, empty(4, 2, 3)), merge(empty(4, 2, 3), p)):
        torch.testing.assert_close(normalize(merged), normalize(p), atol=0, rtol=0)
    both_empty = normalize(merge(empty(4, 2, 3), empty(4, 2, 3)))
    assert torch.equal(both_empty, torch.zeros_like(both_empty))


def test_scatter_merge_equals_merging_each_destination():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(6, 2, 5, generator=g, dtype=torch.float64) * 3
    values = torch.randn(5, 4, generator=g, dtype=torch.float64)
    rows = partial_of(scores, values)
    index = torch.tensor([2, 0, 2, 3, 0, 3])  # destination 3 = dropped; destination 1 receives nothing
    out = scatter_merge(rows, index, 3)
    for dest in (0, 2):
        members = [i for i in range(6) if index[i] == dest]
        want = merge_all([Partial(rows.acc[i:i + 1], rows.max[i:i + 1], rows.sum[i:i + 1]) for i in members])
        torch.testing.assert_close(normalize(Partial(out.acc[dest:dest + 1], out.max[dest:dest + 1],
                                                     out.sum[dest:dest + 1])), normalize(want), atol=1e-12, rtol=0)
    assert torch.isinf(out.max[1]).all() and (out.sum[1] == 0).all()
    assert torch.equal(normalize(out)[1], torch.zeros(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_normalize_writes_the_output_dtype_in_one_rounding(dtype):
    """`normalize(p, dtype)` divides straight into `dtype`: the same values as dividing in the partial's dtype and
    converting after (one rounding either way), and rows that saw no key give 0."""
    g = torch.Generator().manual_seed(0)
    acc, m = torch.randn(5, 3, 8, generator=g), torch.randn(5, 3, generator=g)
    total = torch.rand(5, 3, generator=g) + 0.5
    total[1] = 0  # (a row that saw no key: its acc holds zeros)
    acc[1] = 0
    out = normalize(Partial(acc, m, total), dtype)
    assert out.dtype == dtype
    assert torch.equal(out, normalize(Partial(acc, m, total)).to(dtype))
    assert torch.equal(out[1], torch.zeros(3, 8, dtype=dtype))


def test_merge_rows_equals_merging_the_scattered_paths_first():
    """`merge_rows` (one accumulator) is `normalize(merge_all(...))` of the same parts with each `Scattered`
    path merged into its tokens first: rows that see no key and dropped rows add nothing, a NaN row keeps its
    NaN for its own token alone, a 16-bit acc (the self pair's values) is scaled in the compute dtype."""
    g = torch.Generator().manual_seed(3)
    first = partial_of(torch.randn(4, 2, 1, generator=g, dtype=torch.float64),
                       torch.randn(1, 3, generator=g, dtype=torch.float64))
    rows = partial_of(torch.randn(7, 2, 5, generator=g, dtype=torch.float64) * 3,
                      torch.randn(5, 3, generator=g, dtype=torch.float64))
    rows.max[2], rows.sum[2], rows.acc[2] = float("-inf"), 0.0, float("nan")  # (saw no key: its acc is not read)
    rows.acc[5, 1, 0] = float("nan")  # (met a bad value: token 1 alone)
    index = torch.tensor([0, 3, 1, 4, 3, 1, 0])  # 4 = dropped; token 2 takes only the first part
    more = partial_of(torch.randn(3, 2, 4, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g,
                                                                                          dtype=torch.float64))
    parts = [first, Scattered(rows, index), Scattered(more, torch.tensor([2, 4, 0]))]
    want = normalize(merge_all([first, scatter_merge(rows, index, 4), scatter_merge(more, torch.tensor([2, 4, 0]), 4)]))
    got = merge_rows(parts, 4)
    assert torch.isnan(got[1]).any() and not torch.isnan(got[[0, 2, 3]]).any()
    torch.testing.assert_close(got[[0, 2, 3]], want[[0, 2, 3]], atol=1e-12, rtol=0)
    half = Partial(first.acc.to(torch.bfloat16), first.max, first.sum)
    wide = Partial(half.acc.double(), first.max, first.sum)
    out = merge_rows([half, Scattered(more, torch.tensor([2, 4, 0]))], 4, torch.float64)
    assert torch.equal(out, merge_rows([wide, Scattered(more, torch.tensor([2, 4, 0]))], 4, torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scatter_max_dense_form_equals_the_scatter(monkeypatch, dtype):
    """The masked reduction and the scatter give the same maxima bit for bit; a NaN row's token alone gets NaN."""
    from vllm_gaudi_unified import merge as m

    g = torch.Generator().manual_seed(3)
    rows_max = torch.randn(48, 4, generator=g, dtype=dtype) * 10
    rows_max[torch.rand(48, 4, generator=g) < 0.3] = float("-inf")
    index = torch.randint(0, 9, (48,), generator=g)
    index[:5] = 9  # dropped rows
    start = torch.full((10, 4), float("-inf"), dtype=dtype)
    start[2] = 50.0
    rows_max[index == 3] = torch.where(torch.arange(4) == 1, float("nan"), rows_max[index == 3])
    assert m.DENSE_MAX_WORK >= start.shape[0] * rows_max.numel()
    dense = m.scatter_max(rows_max, index, start)
    monkeypatch.setattr(m, "DENSE_MAX_WORK", 0)
    scattered = m.scatter_max(rows_max, index, start)
    assert torch.equal(dense.isnan(), scattered.isnan())
    assert dense.isnan().sum() == 1 and dense[3, 1].isnan()
    assert torch.equal(dense.nan_to_num(), scattered.nan_to_num())
    for t in range(10):
        want = torch.cat([start[t:t + 1], rows_max[index == t]]).amax(0)
        assert torch.equal(dense[t].nan_to_num(), want.nan_to_num())
