"""The test jobs' rank runner fails in bounded time instead of hanging, and reports a failing rank."""

from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp

from .ranks import run_ranks


def _sleeps(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def _fails(rank: int) -> None:
    raise ValueError(f"rank {rank} says no")


def test_ranks_that_do_not_finish_in_time_are_killed_and_fail() -> None:
    # Had it waited for the ranks, they would have finished and nothing would be raised.
    with pytest.raises(TimeoutError, match="did not finish in 1 s"):
        run_ranks(_sleeps, (120.0,), 2, seconds=1)


def test_a_failing_rank_is_reported_with_its_error() -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 says no|rank 1 says no"):
        run_ranks(_fails, (), 2)
