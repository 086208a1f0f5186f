"""Incremental saves: a checkpoint that reads its unchanged boxes from an earlier one behaves as
a full one (load, verify, inspect, diff, reshard, S3), retention keeps what it reads, and a
broken chain is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptkit
from ckptkit.manifest import seal
from ckptkit.io.catalog import locate
from ckptkit.io.chain import base_problems
from ckptkit.io import leases
from ckptkit.storage import open_storage
from ckptkit.writer import retention


def _flat(step: int) -> dict[str, torch.Tensor]:
    """A model whose first three layers are frozen (the same bytes every step) and whose head,
    optimizer moment and bf16 copy change every step."""
    frozen = torch.Generator().manual_seed(0)
    moving = torch.Generator().manual_seed(step)
    flat = {f"model/layers/{i}/w": torch.randn(48, 40, generator=frozen) for i in range(3)}
    flat["model/head"] = torch.randn(40, 24, generator=moving)
    flat["model/half"] = torch.randn(24, 16, generator=moving).to(torch.bfloat16)
    flat["optim/head/exp_avg"] = torch.randn(40, 24, generator=moving)
    return flat


def _state(step: int) -> dict:
    nested: dict = {}
    for name, value in _flat(step).items():
        *path, last = name.split("/")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


FROZEN = 3 * 48 * 40 * 4
MOVING = 40 * 24 * 4 * 2 + 24 * 16 * 2


def _chain(root: Path, steps: int, **options: object) -> list[ckptkit.Manifest]:
    return [ckptkit.save(_state(s), root / f"step_{s}", step=s, incremental=True, **options) for s in range(1, steps + 1)]


def _assert_state(loaded: dict, step: int) -> None:
    for name, value in _flat(step).items():
        got = loaded
        for part in name.split("/"):
            got = got[part]
        assert got.dtype == value.dtype and torch.equal(got, value), (step, name)


def test_unchanged_boxes_are_read_from_the_first_save_and_every_step_loads_bitwise(tmp_path: Path) -> None:
    manifests = _chain(tmp_path, 4)
    first, *later = manifests
    assert first.bases() == () and all(f.contents for f in first.files)
    for m in later:
        assert m.bases() == ("step_1",)  # flat: every step names the checkpoint holding the file
        own = [f for f in m.files if f.base is None]
        assert len(own) == 1 and sorted(own[0].contents or {}) == ["model/half", "model/head", "optim/head/exp_avg"]
    for step in range(1, 5):
        _assert_state(ckptkit.load(str(tmp_path / f"step_{step}")), step)
        assert ckptkit.verify(str(tmp_path / f"step_{step}")).ok
    # the bytes of a step's own file: the changed tensors and a header, never the frozen layers
    own_bytes = sum(f.size for f in later[-1].files if f.base is None)
    assert MOVING <= own_bytes < MOVING + 2048
    report = ckptkit.inspect(str(tmp_path / "step_4"))
    assert report.owned_bytes == own_bytes
    assert [(b.checkpoint, b.files, b.tensor_bytes) for b in report.borrowed] == [("step_1", 1, FROZEN)]


def test_an_incremental_step_equals_a_full_save_of_the_same_state(tmp_path: Path, run_ckptkit) -> None:
    _chain(tmp_path / "inc", 3)
    ckptkit.save(_state(3), tmp_path / "full" / "step_3", step=3)
    result = run_ckptkit("diff", str(tmp_path / "inc" / "step_3"), str(tmp_path / "full" / "step_3"))
    assert result.returncode == 0, result.stdout + result.stderr
    # load-time resharding reads boxes across the two files of the chain
    target = {"model": {"layers": {"1": {"w": ckptkit.ShardedTensor(torch.empty(24, 40), (48, 40), (24, 0))}}}}
    part = ckptkit.load(str(tmp_path / "inc" / "step_3"), target)["model"]["layers"]["1"]["w"]
    assert torch.equal(part.local, _flat(3)["model/layers/1/w"][24:])


def test_a_save_over_a_full_checkpoint_writes_everything_and_records_digests(tmp_path: Path) -> None:
    ckptkit.save(_state(1), tmp_path / "step_1", step=1)
    m = ckptkit.save(_state(2), tmp_path / "step_2", step=2, incremental=True)
    assert m.bases() == () and all(f.contents for f in m.files)
    assert ckptkit.save(_state(3), tmp_path / "step_3", step=3, incremental=True).bases() == ("step_2",)


def test_a_damaged_base_is_caught_by_load_and_verify(tmp_path: Path, run_ckptkit) -> None:
    _chain(tmp_path, 3)
    payload = tmp_path / "step_1" / "rank00000.safetensors"
    data = bytearray(payload.read_bytes())
    data[-100] ^= 0x01  # a byte of a frozen layer, which step 3 reads from step 1
    payload.write_bytes(bytes(data))
    with pytest.raises(ckptkit.IntegrityError, match="step_1/rank00000.safetensors: block"):
        ckptkit.load(str(tmp_path / "step_3"))
    report = ckptkit.verify(str(tmp_path / "step_3"))
    assert not report.ok and [(f.code, f.where) for f in report.findings] == [("checksum", "../step_1/rank00000.safetensors")]
    result = run_ckptkit("verify", str(tmp_path / "step_3"))
    assert result.returncode == 1 and "../step_1/rank00000.safetensors" in result.stdout + result.stderr


def test_a_missing_base_refuses_the_checkpoint_in_one_line(tmp_path: Path, run_ckptkit) -> None:
    _chain(tmp_path, 3)
    shutil.rmtree(tmp_path / "step_1")
    with pytest.raises(ckptkit.IntegrityError, match="refers to ../step_1: a base this checkpoint reads files of is not committed"):
        ckptkit.load(str(tmp_path / "step_3"))
    for command in ("inspect", "diff"):
        args = [str(tmp_path / "step_3")] + ([str(tmp_path / "step_2")] if command == "diff" else [])
        result = run_ckptkit(command, *args)
        assert result.returncode == 1, (command, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "step_1" in result.stderr
        assert "Traceback" not in result.stderr
    findings = ckptkit.verify(str(tmp_path / "step_3")).findings
    assert ("base", "../step_1") in [(f.code, f.where) for f in findings]


def _edit(path: Path, change) -> None:
    doc = json.loads((path / "manifest.json").read_bytes())
    change(doc)
    (path / "manifest.json").write_bytes(seal(doc))


@pytest.mark.parametrize("base, message", [
    ("step_3", "a base must be an earlier step, it is step 3"),  # a reference forward: a cycle with step 3's own
    ("step_2", "not an earlier checkpoint of the same root"),  # itself
    ("step_9", "not committed"),
])
def test_a_base_that_is_not_an_earlier_committed_checkpoint_is_refused(tmp_path: Path, base: str, message: str) -> None:
    _chain(tmp_path, 3)

    def rebase(doc: dict) -> None:
        for f in doc["files"]:
            if f.get("base"):
                f["base"] = base
    _edit(tmp_path / "step_2", rebase)
    with pytest.raises(ckptkit.IntegrityError, match=message):
        ckptkit.load(str(tmp_path / "step_2"))


def test_a_base_outside_the_root_is_refused(tmp_path: Path) -> None:
    _chain(tmp_path, 2)
    _edit(tmp_path / "step_2", lambda doc: [f.update(base="../elsewhere") for f in doc["files"] if f.get("base")])
    with pytest.raises(ckptkit.ManifestError, match="base is not the name of a checkpoint of the same root"):
        ckptkit.load(str(tmp_path / "step_2"))


def test_a_file_the_base_does_not_hold_as_its_own_is_refused(tmp_path: Path) -> None:
    _chain(tmp_path, 2)
    _edit(tmp_path / "step_2", lambda doc: [f.update(checksum="xxh3-128:" + "0" * 32, blocks=None)
                                             for f in doc["files"] if f.get("base")])
    problems = base_problems(locate(tmp_path / "step_2"), ckptkit.read_manifest(str(tmp_path / "step_2")))
    assert problems == [("../step_1/rank00000.safetensors",
                         "its base's manifest does not list it as its own file of this size and checksum")]


def test_retention_keeps_every_base_a_kept_checkpoint_reads(tmp_path: Path) -> None:
    with ckptkit.CheckpointManager(tmp_path, keep_last=2, sync=True, incremental=True) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step))
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".") and p.is_dir())
    assert names == ["step_00000001", "step_00000004", "step_00000005"]  # step 1 holds the frozen layers
    for step in (4, 5):
        _assert_state(ckptkit.load(str(tmp_path / f"step_{step:08d}")), step)


def test_prune_keeps_a_base_until_nothing_that_stays_reads_it(tmp_path: Path) -> None:
    _chain(tmp_path, 3)
    report = ckptkit.prune(str(tmp_path), keep_last=1)
    assert [r.name for r in report.removed] == ["step_2"] and report.bases == ["step_1"]
    _assert_state(ckptkit.load(str(tmp_path / "step_3")), 3)
    ckptkit.save({"model": {"other": torch.ones(3)}}, tmp_path / "step_4", step=4)  # a full save
    report = ckptkit.prune(str(tmp_path), keep_last=1)
    assert sorted(r.name for r in report.removed) == ["step_1", "step_3"] and report.bases == []


def test_a_deleter_backs_off_from_a_base_a_save_holds_or_a_committed_checkpoint_reads(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    _chain(tmp_path, 1)
    with leases.lease(storage, "step_1"):  # what an incremental save holds on its base until it commits
        assert retention.apply(storage, ["step_1"]) == []
    ckptkit.save(_state(2), tmp_path / "step_2", step=2, incremental=True)  # reads step_1, which a stale plan would still delete
    assert retention.apply(storage, ["step_1"]) == []
    assert ckptkit.verify(str(tmp_path / "step_2")).ok


def test_a_base_being_deleted_is_not_referred_to(tmp_path: Path) -> None:
    _chain(tmp_path, 1)
    mark = tmp_path / ".leases" / "step_1" / f"{leases.MARK_PREFIX}me"
    mark.parent.mkdir(parents=True)
    mark.write_text(json.dumps({"host": "elsewhere", "pid": 1}))  # another machine's deleter: live
    m = ckptkit.save(_state(2), tmp_path / "step_2", step=2, incremental=True)
    assert m.bases() == ()
    _assert_state(ckptkit.load(str(tmp_path / "step_2")), 2)


def test_incremental_saves_on_s3(s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/inc"
    for step in (1, 2):
        m = ckptkit.save(_state(step), f"{root}/step_{step}", step=step, incremental=True)
    assert m.bases() == ("step_1",)
    _assert_state(ckptkit.load(f"{root}/step_2"), 2)
    assert ckptkit.verify(f"{root}/step_2").ok
    assert ckptkit.compact(f"{root}/step_2").compacted
    assert ckptkit.read_manifest(f"{root}/step_2").bases() == ()
    _assert_state(ckptkit.load(f"{root}/step_2"), 2)
    assert ckptkit.verify(f"{root}/step_2").ok


def _rl_states(steps: int, scale: float = 1e-4) -> list[dict]:
    """bf16 weights of fp32 masters moved by small updates (few bf16 elements change per step),
    the masters themselves (every element changes) and a bf16 tensor of an odd size."""
    g = torch.Generator().manual_seed(7)
    master = torch.randn(256, 96, generator=g)
    out = []
    for _ in range(steps):
        master = master + torch.randn(master.shape, generator=g) * scale
        out.append({"model": {"w": master.to(torch.bfloat16), "odd": master[:3, :7].to(torch.bfloat16).contiguous()},
                    "optim": {"master": master.clone()}})
    return out


def _equal(loaded: dict, state: dict) -> None:
    for group, tensors in state.items():
        for name, value in tensors.items():
            assert torch.equal(loaded[group][name], value), (group, name)


def test_a_bf16_tensor_that_changed_in_few_elements_is_written_as_a_patch_and_restores_bitwise(tmp_path: Path) -> None:
    states = _rl_states(5)
    manifests = [ckptkit.save(s, tmp_path / f"step_{n}", step=n, incremental=True) for n, s in enumerate(states, 1)]
    w = [m.tensors["model/w"] for m in manifests]
    assert not w[0].patches and [len(e.patches) for e in w[1:]] == [1, 2, 3, 4]  # a chain of patches over step 1's box
    for n, state in enumerate(states, 1):
        changed = int((state["model"]["w"] != states[n - 2]["model"]["w"]).sum()) if n > 1 else 0
        if n > 1:
            assert 0 < w[n - 1].patches[-1].count == changed < 256 * 96 // 12
        _equal(ckptkit.load(str(tmp_path / f"step_{n}")), state)
        assert ckptkit.verify(str(tmp_path / f"step_{n}")).ok
    assert not manifests[-1].tensors["optim/master"].patches  # fp32: whole every time
    # a box read across the patches: only the patched elements inside it are applied
    target = {"model": {"w": ckptkit.ShardedTensor(torch.empty(50, 30, dtype=torch.bfloat16), (256, 96), (101, 33))}}
    part = ckptkit.load(str(tmp_path / "step_5"), target)["model"]["w"].local
    assert torch.equal(part, states[-1]["model"]["w"][101:151, 33:63])
    report = ckptkit.inspect(str(tmp_path / "step_5"))
    assert report.patches == 4 + len(manifests[-1].tensors["model/odd"].patches)  # counted over every tensor
    assert report.patched_elements == sum(p.count for t in manifests[-1].tensors.values() for p in t.patches)


def test_a_box_whose_patches_would_outgrow_it_is_written_whole_again(tmp_path: Path) -> None:
    states = _rl_states(6, scale=2e-4)  # about a tenth of the elements change each step
    manifests = [ckptkit.save(s, tmp_path / f"step_{n}", step=n, incremental=True) for n, s in enumerate(states, 1)]
    chain = [len(m.tensors["model/w"].patches) for m in manifests]
    assert chain == [0, 1, 2, 3, 0, 1]  # 30% of the box a patch: 3 fit in it, the 4th is written whole, a new start
    for m in manifests:  # never more patch bytes than the box itself
        assert sum(p.count * 6 for p in m.tensors["model/w"].patches) <= 256 * 96 * 2
    for n, state in enumerate(states, 1):
        _equal(ckptkit.load(str(tmp_path / f"step_{n}")), state)


def test_a_damaged_patch_is_caught(tmp_path: Path) -> None:
    states = _rl_states(2)
    for n, s in enumerate(states, 1):
        ckptkit.save(s, tmp_path / f"step_{n}", step=n, incremental=True)
    own = tmp_path / "step_2" / "rank00000.safetensors"
    data = bytearray(own.read_bytes())
    data[-3] ^= 0x40  # the last bytes of the file: the patch's values (the smallest element size, last)
    own.write_bytes(bytes(data))
    with pytest.raises(ckptkit.IntegrityError, match="does not match its checksum"):
        ckptkit.load(str(tmp_path / "step_2"))


def test_a_patch_that_claims_more_elements_than_its_box_is_refused(tmp_path: Path) -> None:
    for n, s in enumerate(_rl_states(2), 1):
        ckptkit.save(s, tmp_path / f"step_{n}", step=n, incremental=True)
    _edit(tmp_path / "step_2", lambda doc: doc["tensors"]["model/w"]["patches"][0].update(count=256 * 96 + 1))
    with pytest.raises(ckptkit.ManifestError, match="elements, its box holds"):
        ckptkit.load(str(tmp_path / "step_2"))


def test_reshard_of_a_patched_checkpoint_writes_whole_tensors(tmp_path: Path) -> None:
    states = _rl_states(3)
    for n, s in enumerate(states, 1):
        ckptkit.save(s, tmp_path / "run" / f"step_{n}", step=n, incremental=True)
    assert ckptkit.read_manifest(str(tmp_path / "run" / "step_3")).tensors["model/w"].patches
    assert ckptkit.diff(str(tmp_path / "run" / "step_3"), str(tmp_path / "run" / "step_3")).ok
    ckptkit.save(states[-1], tmp_path / "full" / "step_3", step=3)
    assert ckptkit.diff(str(tmp_path / "run" / "step_3"), str(tmp_path / "full" / "step_3")).ok


def _no_loop(why: str) -> None:
    if os.environ.get("CKPTKIT_REQUIRE_NATIVE"):
        pytest.fail(f"{why} (CKPTKIT_REQUIRE_NATIVE is set)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def portable_loop(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """ckptkit/ops/_changed.c built without SIMD compares (CKPT_PORTABLE), as on processors
    other than x86: the word-folding mask, which this machine's builds never use otherwise."""
    import importlib.util
    import subprocess
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        _no_loop(f"no C compiler ({cc}) to build the portable loop with")
    src = Path(ckptkit.__file__).parent / "ops" / "_changed.c"
    out = tmp_path_factory.mktemp("portable") / ("_changed" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-DCKPT_PORTABLE", f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(out)],
                   check=True)
    spec = importlib.util.spec_from_file_location("_changed", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["native", "portable", "numpy"])
def finder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`changed_positions` through the compiled loop as installed, through the loop built without
    SIMD, then through numpy alone."""
    from ckptkit.ops import incremental

    if request.param == "native" and incremental._native is None:
        _no_loop("ckptkit.ops._changed was not built (no C compiler at install)")
    if request.param == "portable":
        monkeypatch.setattr(incremental, "_native", request.getfixturevalue("portable_loop"))
    if request.param == "numpy":
        monkeypatch.setattr(incremental, "_native", None)
    return str(request.param)


# 0 to 5 and 1001 end inside a 64-element block; (1 << 19) + 3 spans numpy's chunks; the flips range from
# none to every element, so blocks hold 0, 1 to 8, and more than 8 changes
@pytest.mark.parametrize("n, flips", [(0, 0), (1, 1), (3, 2), (64, 64), (65, 9), (1001, 150), (4096, 4096), ((1 << 19) + 3, 75_000)])
@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_changed_positions_are_those_numpy_finds(finder: str, n: int, flips: int, dtype: type[np.integer]) -> None:
    from ckptkit.ops.incremental import changed_positions

    rng = np.random.default_rng(n)
    before = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    after = before.copy()
    after[rng.choice(n, size=flips, replace=False)] ^= rng.integers(1, 1 << 16, flips, dtype=np.uint16)
    expected = np.flatnonzero(before != after)
    got = changed_positions(before.view(np.uint8), after.view(np.uint8), n, dtype)
    assert got is not None and got.dtype == dtype and got.tolist() == expected.tolist()
    assert changed_positions(before.view(np.uint8), after.view(np.uint8), len(expected), dtype).tolist() == expected.tolist()
    if len(expected):
        assert changed_positions(before.view(np.uint8), after.view(np.uint8), len(expected) - 1, dtype) is None


def test_changed_positions_of_unaligned_bytes_with_an_odd_tail(finder: str) -> None:
    """Buffers that start at an odd address and end in half an element: the half is not an element."""
    from ckptkit.ops.incremental import changed_positions

    rng = np.random.default_rng(7)
    raw_before = rng.integers(0, 256, 2 * 1000 + 2, dtype=np.uint8)
    raw_after = raw_before.copy()
    raw_after[1 + 2 * np.array([0, 63, 64, 500, 999]) + 1] ^= 0x80  # the high byte of 5 elements
    raw_after[1 + 2000] ^= 1  # the odd byte past the last whole element
    got = changed_positions(raw_before[1:], raw_after[1:], 1000)
    assert got is not None and got.tolist() == [0, 63, 64, 500, 999]
    strided = np.stack([raw_before[1:], raw_after[1:]], axis=1)  # every other byte: neither array is contiguous
    got = changed_positions(strided[:, 0], strided[:, 1], 1000)
    assert got is not None and got.tolist() == [0, 63, 64, 500, 999]


def test_compaction_rewrites_a_chain_whole_in_place_and_frees_its_bases(tmp_path: Path, run_ckptkit) -> None:
    states = _rl_states(4)
    for n, s in enumerate(states, 1):
        ckptkit.save(s, tmp_path / f"step_{n}", step=n, incremental=True)
    later = ckptkit.save(_rl_states(5)[-1], tmp_path / "step_5", step=5, incremental=True)  # reads step_4's files
    assert "step_4" in later.bases()
    result = run_ckptkit("compact", str(tmp_path / "step_4"))
    assert result.returncode == 0 and "rewritten whole" in result.stdout, result.stderr
    compacted = ckptkit.read_manifest(str(tmp_path / "step_4"))
    assert compacted.bases() == () and not any(t.patches for t in compacted.tensors.values())
    assert [f.role for f in compacted.files if f.role == "kept"] == ["kept"]  # its own file, which step_5 reads
    _equal(ckptkit.load(str(tmp_path / "step_4")), states[3])
    _equal(ckptkit.load(str(tmp_path / "step_5")), _rl_states(5)[-1])
    for name in ("step_4", "step_5"):
        assert ckptkit.verify(str(tmp_path / name)).ok
    assert later.bases() == ("step_1", "step_2", "step_3", "step_4")
    assert ckptkit.prune(str(tmp_path), keep_last=1, dry_run=True).removed == []  # step_5 reads them all
    ckptkit.compact(str(tmp_path / "step_5"))
    assert [r.name for r in ckptkit.prune(str(tmp_path), keep_last=1).removed] == ["step_1", "step_2", "step_3", "step_4"]
    _equal(ckptkit.load(str(tmp_path / "step_5")), _rl_states(5)[-1])
    again = ckptkit.compact(str(tmp_path / "step_5"))
    assert not again.compacted and again.files_written == 0


def test_an_interrupted_compaction_changes_nothing_and_clean_removes_what_it_left(tmp_path: Path, run_ckptkit) -> None:
    for n, s in enumerate(_rl_states(2), 1):
        ckptkit.save(s, tmp_path / f"step_{n}", step=n, incremental=True)
    left = tmp_path / "step_2" / ".compact-0123456789ab"
    left.mkdir()
    (left / "part00000.safetensors").write_bytes(b"cut off")
    assert ckptkit.verify(str(tmp_path / "step_2")).ok  # not damage: the manifest names none of it
    listing = ckptkit.list_checkpoints(str(tmp_path))
    assert [(x.name, x.reason) for x in listing.leftovers] == [("step_2/.compact-0123456789ab",
                                                                "files of an interrupted compaction of step_2")]
    assert [r.name for r in ckptkit.clean(str(tmp_path)).removed] == ["step_2/.compact-0123456789ab"]
    assert not left.exists() and ckptkit.verify(str(tmp_path / "step_2")).ok
    assert run_ckptkit("compact", str(tmp_path / "nothing")).returncode == 2


def test_the_temporary_files_of_interrupted_writes_are_not_damage_and_clean_removes_them(tmp_path: Path) -> None:
    for n, s in enumerate(_rl_states(2), 1):
        ckptkit.save(s, tmp_path / f"step_{n}", step=n, incremental=True)
    ckptkit.compact(str(tmp_path / "step_2"))  # its files now in a folder of the checkpoint
    folder = next(f.path.split("/")[0] for f in ckptkit.read_manifest(str(tmp_path / "step_2")).files if "/" in f.path)
    inner = tmp_path / "step_2" / folder / ".part00000.safetensors.tmp-0123abcd"
    top = tmp_path / "step_2" / ".manifest.json.tmp-89abcdef"
    inner.write_bytes(b"cut off")  # as a writer killed before its rename leaves it
    top.write_bytes(b"{")
    assert ckptkit.verify(str(tmp_path / "step_2")).ok
    reason = "the temporary file of an interrupted write in step_2"
    assert sorted((x.name, x.reason) for x in ckptkit.list_checkpoints(str(tmp_path)).leftovers) == [
        (f"step_2/{folder}/{inner.name}", reason), (f"step_2/{top.name}", reason)]
    assert len(ckptkit.clean(str(tmp_path)).removed) == 2
    assert not inner.exists() and not top.exists() and ckptkit.verify(str(tmp_path / "step_2")).ok
    _equal(ckptkit.load(str(tmp_path / "step_2")), _rl_states(2)[-1])


def test_the_manager_compacts_a_save_whose_patches_reach_its_bound(tmp_path: Path) -> None:
    states = _rl_states(4)
    with ckptkit.CheckpointManager(tmp_path, sync=True, incremental=True, compact_after=2) as manager:
        for n, s in enumerate(states, 1):
            manager.save(n, s)
    depth = [len(ckptkit.read_manifest(str(tmp_path / f"step_{n:08d}")).tensors["model/w"].patches) for n in range(1, 5)]
    assert depth == [0, 1, 0, 1]  # step 3 reached 2 patches and was compacted; step 4 patches it
    for n, s in enumerate(states, 1):
        _equal(ckptkit.load(str(tmp_path / f"step_{n:08d}")), s)
