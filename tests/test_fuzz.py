"""The seeded fuzz of every read command (tests/fuzz.py): no damaged checkpoint may crash,
hang, exhaust memory, load as wrong data, leave a DST behind or pass as sound.

CKPTKIT_FUZZ_COUNT sets the number of mutations (each runs all nine read commands);
CKPTKIT_FUZZ_SEED the seed. Reproduce a failure with
``.venv/bin/python -m tests.fuzz --count N --seed S --json out.json``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .fuzz import fuzz, violation_classes

# 80 mutations (720 runs): about 1.5 minutes on 2 busy cores (50 took 60 s at load average 6,
# building the checkpoints included); 0.6-1.3 s per mutation.
COUNT = int(os.environ.get("CKPTKIT_FUZZ_COUNT", "80"))
SEED = int(os.environ.get("CKPTKIT_FUZZ_SEED", "20240601"))
SHOWN = 200


@pytest.mark.slow
def test_no_read_command_misbehaves_on_damaged_checkpoints(tmp_path: Path) -> None:
    outcomes = fuzz(COUNT, SEED, work=tmp_path, wall_s=20.0, idle_s=2.5)
    assert {o.command for o in outcomes} >= {"load", "verify", "export"}, "the fuzz ran no commands"
    bad = [o for o in outcomes if o.violation]
    lines = [
        f"#{o.index} {o.base} {o.mutation} ({o.detail[:120]}) -> {o.command}: exit {o.code}, {o.outcome}: "
        f"{o.message[:200]}" + (f" [{o.where}]" if o.where else "")
        for o in bad[:SHOWN]
    ]
    if len(bad) > SHOWN:
        lines.append(f"... and {len(bad) - SHOWN} more")
    if bad:
        classes = violation_classes(outcomes)
        pytest.fail(f"{len(bad)} violation(s) in {len(outcomes)} runs (seed {SEED}, {COUNT} mutations), "
                    f"{len(classes)} distinct:\n" + "\n".join(lines), pytrace=False)
