from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.boxes import Box, byte_runs, chunk_cuts, flat_range_to_boxes, full_box, tiling_problems

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)


@st.composite
def shape_and_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = draw(shapes)
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    stop = draw(st.integers(start, total))
    return shape, start, stop


@st.composite
def shape_and_subbox(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box]:
    shape = draw(shapes)
    outer_off = tuple(draw(st.integers(0, s - 1)) for s in shape)
    outer_len = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, outer_off))
    inner_off = tuple(draw(st.integers(o, o + n - 1)) for o, n in zip(outer_off, outer_len))
    inner_len = tuple(draw(st.integers(1, o + n - i)) for o, n, i in zip(outer_off, outer_len, inner_off))
    return shape, Box(outer_off, outer_len), Box(inner_off, inner_len)


@settings(deadline=None)
@given(shape_and_range())
def test_flat_range_boxes_cover_exactly_the_range_in_order(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, start, stop = case
    boxes = flat_range_to_boxes(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    index = np.arange(math.prod(shape)).reshape(shape)
    covered = np.concatenate([index[b.slices()].reshape(-1) for b in boxes]) if boxes else np.array([], dtype=int)
    assert covered.tolist() == list(range(start, stop))


@settings(deadline=None)
@given(shape_and_subbox(), st.sampled_from([1, 2, 4, 8]))
def test_byte_runs_concatenate_to_the_inner_box(case: tuple[tuple[int, ...], Box, Box], itemsize: int) -> None:
    _, outer, inner = case
    values = np.arange(outer.volume, dtype=np.int64).reshape(outer.lengths)
    raw = np.repeat(values.reshape(-1), itemsize)  # one "byte" per element byte, tagged with its element
    runs = byte_runs(outer, inner, itemsize)
    got = np.concatenate([raw[o : o + runs.run_length] for o in runs.offsets()])
    expected = np.repeat(values[inner.shifted(outer.offsets).slices()].reshape(-1), itemsize)
    assert got.tolist() == expected.tolist()
    assert runs.nbytes == inner.volume * itemsize
    assert runs.end <= outer.volume * itemsize


@settings(deadline=None)
@given(st.integers(0, 50), st.integers(1, 12))
def test_chunk_cuts_match_torch_chunk(size: int, count: int) -> None:
    import torch

    cuts = chunk_cuts(size, count)
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    torch_sizes = [c.numel() for c in torch.arange(size).chunk(count)] if size else []
    assert [s for s in sizes if s] == torch_sizes
    assert cuts[0] == 0 and cuts[-1] == size and len(cuts) == count + 1


@settings(max_examples=200, deadline=None)
@given(shapes, st.data())
def test_random_partitions_tile_and_damaged_ones_do_not(shape: tuple[int, ...], data: st.DataObject) -> None:
    cuts = [sorted({0, s} | set(data.draw(st.lists(st.integers(1, s), max_size=3)))) for s in shape]
    boxes = []
    for idx in np.ndindex(*[len(c) - 1 for c in cuts]):
        boxes.append(Box(tuple(c[i] for c, i in zip(cuts, idx)), tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx))))
    assert tiling_problems(shape, boxes) == []
    if len(boxes) > 1:
        assert any("gap" in p for p in tiling_problems(shape, boxes[1:]))
        assert any("overlap" in p for p in tiling_problems(shape, [*boxes, boxes[0]]))


def test_out_of_bounds_box_is_reported() -> None:
    problems = tiling_problems((4, 4), [Box((0, 0), (4, 5))])
    assert problems and "outside" in problems[0]


def test_scalar_tensor_tiles_with_one_box() -> None:
    assert tiling_problems((), [full_box(())]) == []
    assert any("gap" in p for p in tiling_problems((), []))
