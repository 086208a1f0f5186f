from __future__ import annotations

import pytest

from ckptkit.boxes import Box, full_box
from ckptkit.errors import LayoutError
from ckptkit.plan.save import MIN_SPLIT_BYTES, ItemDesc, plan_save


def _item(fqn: str, shape: tuple[int, ...], box: Box | None = None) -> ItemDesc:
    return ItemDesc(fqn, "float32", shape, box or full_box(shape))


def test_replicas_are_written_once_and_spread_over_their_holders() -> None:
    replicated = [_item(f"norm{i}", (1024,)) for i in range(8)]
    plan = plan_save([replicated, replicated, replicated, replicated])
    writers = [len(files[0].items) if files else 0 for files in plan.files]
    assert writers == [2, 2, 2, 2]
    written = sorted(item.fqn for f in plan.all_files() for item, _ in f.items)
    assert written == sorted(f"norm{i}" for i in range(8))


def test_a_large_rank_payload_is_split_into_equal_files_for_parallel_writes() -> None:
    rows = MIN_SPLIT_BYTES // 4 // 1024  # one MIN_SPLIT_BYTES tensor of 1024 columns
    items = [_item(f"w{i}", (rows // 4, 1024)) for i in range(8)]  # 2 x MIN_SPLIT_BYTES in all
    plan = plan_save([items], files_per_rank=2)
    sizes = [sum(i.nbytes for i, _ in f.items) for f in plan.files[0]]
    assert [f.path for f in plan.files[0]] == ["rank00000-000.safetensors", "rank00000-001.safetensors"]
    assert sizes[0] == sizes[1]


def test_a_small_payload_stays_in_one_file() -> None:
    plan = plan_save([[_item("w", (16, 16))]], files_per_rank=4)
    assert [f.path for f in plan.files[0]] == ["rank00000.safetensors"]


def test_two_boxes_of_one_tensor_in_one_file_get_distinct_keys() -> None:
    items = [_item("w", (4, 4), Box((0, 0), (2, 4))), _item("w", (4, 4), Box((2, 0), (2, 4)))]
    plan = plan_save([items])
    assert [k for _, k in plan.files[0][0].items] == ["w", "w#1"]


def test_every_problem_is_listed_at_once() -> None:
    ranks = [[_item("a", (4,)), _item("b", (4,), Box((0,), (2,)))], [_item("a", (5,))]]
    with pytest.raises(LayoutError) as err:
        plan_save(ranks)
    assert "2 problem(s)" in str(err.value)
    assert "a: rank 1 has float32[5]" in str(err.value) and "b: gap" in str(err.value)
