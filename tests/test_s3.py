"""ckptkit on S3 (a real SeaweedFS server on loopback): commit without rename, every command, concurrency."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import CheckpointExistsError, ShardedTensor
from ckptkit.io.catalog import resolve
from ckptkit.storage.s3 import S3Storage

pytestmark = pytest.mark.s3


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {"model": {"w": w, "b": torch.randn(32, generator=g)}, "meta": {"seed": seed}}


def test_save_load_verify_inspect_ls_on_s3(s3_bucket: str, run_ckptkit, tmp_path: Path) -> None:
    root = f"s3://{s3_bucket}/runs/a"
    state = _state(1)
    manifest = ckptkit.save(state, f"{root}/step_00000001", step=1, tokenizer=_tokenizer(tmp_path))
    # Written in place (no rename): every file under the writer's own prefix, the manifest last.
    prefixes = {f.path.split("/")[0] for f in manifest.files}
    assert len(prefixes) == 1 and len(prefixes.pop()) == 12
    back = ckptkit.load(root)  # through the root's latest pointer
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["meta"] == {"seed": 1}
    assert ckptkit.verify(root).ok
    for args in (["ls", root], ["inspect", f"{root}/step_00000001"], ["verify", f"{root}/step_00000001", "--json"]):
        done = run_ckptkit(*args)
        assert done.returncode == 0, (args, done.stderr)
    assert "step_00000001\tstep 1" in run_ckptkit("ls", root).stdout
    assert json.loads(run_ckptkit("verify", root, "--json").stdout)["ok"] is True
    missing = run_ckptkit("verify", f"s3://{s3_bucket}/nothing/here")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    # A corrupted payload object is caught.
    storage = S3Storage(root)
    key = f"step_00000001/{manifest.files[0].path}"
    data = bytearray(storage.read(key))
    data[-1] ^= 0xFF
    storage.write(key, [bytes(data)])
    assert not ckptkit.verify(root).ok


def test_load_time_resharding_reads_only_the_needed_ranges(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkit.io import checksum

    block = 256
    monkeypatch.setattr(checksum, "MIN_BLOCK", block)  # blocks smaller than the box, to see which are read
    root = f"s3://{s3_bucket}/reshard"
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    ckptkit.save({"model": {"w": [ShardedTensor(full[i * 16 : (i + 1) * 16].clone(), (64, 32), (i * 16, 0)) for i in range(4)]}},
                 f"{root}/step_1", step=1, max_file_bytes=3000)
    read: list[tuple[str, int, int]] = []

    class Counting(S3Storage):
        def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:  # readinto calls it too
            read.append((key, offset, sum(b.nbytes for b in buffers)))
            super().readv(key, offset, buffers)

    counting = Counting(root)
    target = ShardedTensor(torch.empty(8, 32), (64, 32), (20, 0))  # rows 20..27, inside one saved shard
    ckptkit.load("step_1", {"model": {"w": target}}, storage=counting)
    assert torch.equal(target.local, full[20:28])
    payload = [r for r in read if r[0].endswith(".safetensors")]
    assert len({key for key, _, _ in payload}) == 1  # one payload object touched
    header_len = int.from_bytes(counting.read(payload[0][0], 0, 8), "little")
    # Its header (length, then JSON) and the blocks holding it (checked); then, in one ranged GET,
    # exactly the box's bytes (8 rows of 32 floats) and the rest of the two blocks at their ends.
    prefix = 8 + header_len
    start, end = prefix + 4 * 32 * 4, prefix + 12 * 32 * 4
    assert start % block and end % block and -(-prefix // block) * block <= start // block * block  # ends inside blocks
    assert [(o, n) for _, o, n in payload] == [
        (0, 8), (8, header_len), (0, -(-prefix // block) * block),
        (start // block * block, (end // block + 1) * block - start // block * block)]


def _race(write: Callable[[int], object]) -> dict[int, str]:
    """Run write(0) and write(1) at once; return each one's outcome ("committed" or "refused: ...")."""
    barrier = threading.Barrier(2)
    outcomes: dict[int, str] = {}

    def writer(i: int) -> None:
        barrier.wait()
        try:
            write(i)
            outcomes[i] = "committed"
        except CheckpointExistsError as exc:
            outcomes[i] = f"refused: {exc}"

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outcomes


@pytest.mark.parametrize("round_", range(5))
def test_two_writers_of_the_same_step_exactly_one_commits(s3_bucket: str, round_: int) -> None:
    path = f"s3://{s3_bucket}/race/step_00000007"
    outcomes = _race(lambda i: ckptkit.save(_state(100 + i), path, step=7))
    winners = [i for i, o in outcomes.items() if o == "committed"]
    assert len(winners) == 1 and len(outcomes) == 2, outcomes
    loser = 1 - winners[0]
    assert "already exists" in outcomes[loser]
    assert ckptkit.verify(path).ok
    loaded = ckptkit.load(path)
    assert torch.equal(loaded["model"]["w"], _state(100 + winners[0])["model"]["w"])
    # The loser's files are gone; only the winner's prefix and the manifest remain.
    storage = resolve(path).storage
    prefixes = {k.split("/")[1] for k in storage.list("step_00000007")}
    assert len(prefixes) == 2 and "manifest.json" in prefixes


def test_async_manager_and_retention_on_s3(s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/managed"
    with ckptkit.CheckpointManager(root, keep_last=2) as manager:
        for step in range(1, 5):
            manager.save(step, _state(step))
    assert manager.committed_steps() == [3, 4]
    assert [e.step for e in ckptkit.list_checkpoints(root).checkpoints] == [3, 4]
    assert torch.equal(ckptkit.load(root)["model"]["w"], _state(4)["model"]["w"])


def _tokenizer(tmp_path: Path) -> Path:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    return tok


@pytest.mark.multiprocess
def test_train_to_s3_reshard_to_local_export_to_s3_and_back(s3_bucket: str, tmp_path: Path, run_ckptkit) -> None:
    from ckptkit.trainer.train import config_from, launch, prepare

    remote = f"s3://{s3_bucket}/train"
    for out in (remote, str(tmp_path / "local")):  # the same run, saved to S3 and locally
        cfg = config_from(tp=2, pp=1, dp=2, zero=1, steps=4, save_every=4, out=out)
        prepare(cfg)
        launch(cfg)
    assert run_ckptkit("verify", remote).returncode == 0
    same = run_ckptkit("diff", f"{remote}/step_00000004", str(tmp_path / "local" / "step_00000004"))
    assert same.returncode == 0, same.stdout + same.stderr
    # Reshard S3 -> local, export local -> S3, read the export back.
    done = run_ckptkit("reshard", f"{remote}/step_00000004", str(tmp_path / "flat"), "--tp", "1", "--dp", "1")
    assert done.returncode == 0, done.stderr
    assert run_ckptkit("diff", str(tmp_path / "flat"), str(tmp_path / "local" / "step_00000004")).returncode == 0
    done = run_ckptkit("export", str(tmp_path / "flat"), f"s3://{s3_bucket}/hf", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load as load_safetensors

    storage = S3Storage(f"s3://{s3_bucket}/hf")
    weights = load_safetensors(storage.read("model-00001-of-00001.safetensors"))
    local = ckptkit.load(str(tmp_path / "local" / "step_00000004"))["model"]
    assert torch.equal(weights["model.embed_tokens.weight"], local["embed.weight"])
    assert json.loads(storage.read("export_report.json"))["format"] == "hf"


def _faulty(root: str, max_attempts: int = 6) -> tuple[S3Storage, "Faults"]:
    from .s3faults import Faults

    storage = S3Storage(root, part_size=5 << 20, concurrency=2, max_attempts=max_attempts)
    return storage, Faults().install(storage.client)


@pytest.mark.parametrize("operation, kind", [
    ("PutObject", "reset"), ("PutObject", "503"), ("PutObject", "500"), ("UploadPart", "500"), ("UploadPart", "reset"),
    ("GetObject", "reset"), ("GetObject", "503"), ("GetObject", "truncate"), ("HeadObject", "503"),
])
def test_transient_faults_are_retried_to_success(s3_bucket: str, operation: str, kind: str) -> None:
    storage, faults = _faulty(f"s3://{s3_bucket}/faults")
    rule = faults.add(operation, kind, times=2)
    big = torch.randn(3 << 20)  # 12 MiB: a multipart upload of 5 MiB parts
    state = {"model": {"big": big, "w": _state(3)["model"]["w"]}, "meta": {"n": 1}}
    ckptkit.save(state, "step_1", step=1, storage=storage)
    loaded = ckptkit.load("step_1", storage=storage)
    assert rule.fired == 2  # the faults did happen, and were retried
    assert torch.equal(loaded["model"]["big"], big) and torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert ckptkit.verify("step_1", storage=storage).ok


@pytest.mark.parametrize("operation, kind", [("PutObject", "503"), ("UploadPart", "500"), ("PutObject", "reset")])
def test_persistent_faults_fail_clearly_and_commit_nothing(s3_bucket: str, operation: str, kind: str, run_ckptkit) -> None:
    root = f"s3://{s3_bucket}/persistent"
    ckptkit.save(_state(1), f"{root}/step_1", step=1)  # an earlier checkpoint, committed
    storage, faults = _faulty(root, max_attempts=2)
    faults.add(operation, kind, times=-1)
    state = {"model": {"big": torch.randn(3 << 20)}}
    with pytest.raises(ckptkit.StorageError) as raised:
        ckptkit.save(state, "step_2", step=2, storage=storage)
    assert "\n" not in str(raised.value) and operation.lower().replace("object", "_object").replace("part", "_part") in str(raised.value)
    listing = ckptkit.list_checkpoints(root)
    assert [e.step for e in listing.checkpoints] == [1] and listing.latest == "step_1"
    assert ckptkit.verify(f"{root}/step_1").ok
    client = S3Storage(root).client
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")  # aborted, not left open
    failed = run_ckptkit("verify", f"{root}/step_2")
    assert failed.returncode == 2  # nothing committed there


def test_the_zarr_form_is_written_to_s3_with_tensorstore_and_read_back(s3_bucket: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorstore")
    state = _state(5)
    state["model"]["h"] = torch.randn(9, 4).to(torch.bfloat16)
    ckptkit.save(state, tmp_path / "src", step=5)
    form = f"s3://{s3_bucket}/forms/step_5"
    report = ckptkit.export(str(tmp_path / "src"), form, format="zarr", chunk_bytes=512)
    assert report.format == "zarr"
    assert ckptkit.verify(form).ok
    back = ckptkit.load(form)
    for name in ("w", "b", "h"):
        assert torch.equal(back["model"][name].view(torch.uint8), state["model"][name].contiguous().view(torch.uint8)), name
    import tensorstore as ts

    import os

    spec = {"driver": "zarr3", "kvstore": {"driver": "s3", "bucket": s3_bucket, "path": "forms/step_5/model/w/",
                                            "endpoint": os.environ["AWS_ENDPOINT_URL"], "aws_region": "us-east-1",
                                            "aws_credentials": {"type": "environment"}}}
    got = ts.open(spec).result()[10:20, 3:7].read().result()
    assert (got == state["model"]["w"][10:20, 3:7].numpy()).all()


def test_bad_urls_and_settings_are_one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ckptkit.StorageError, match="not an s3://bucket"):
        S3Storage("s3:///nobucket")
    monkeypatch.setenv("CKPTKIT_S3_PART_SIZE", "lots")
    with pytest.raises(ckptkit.StorageError, match="CKPTKIT_S3_PART_SIZE='lots' is not a whole number"):
        S3Storage("s3://bucket/prefix")
    monkeypatch.setenv("CKPTKIT_S3_PART_SIZE", str(8 << 20))
    monkeypatch.setenv("CKPTKIT_S3_CONCURRENCY", "3")
    storage = S3Storage("s3://bucket/prefix/")
    assert (storage.part_size, storage.concurrency, storage.root) == (8 << 20, 3, "s3://bucket/prefix")


def test_a_failure_after_the_manifest_keeps_the_committed_files(s3_bucket: str) -> None:
    class NoLatest(S3Storage):
        def write(self, key: str, chunks) -> int:  # type: ignore[no-untyped-def]
            if key == "latest":
                raise ckptkit.StorageError("latest: throttled for good")
            return super().write(key, chunks)

    storage = NoLatest(f"s3://{s3_bucket}/late")
    with pytest.raises(ckptkit.StorageError, match="throttled"):
        ckptkit.save(_state(9), "step_9", step=9, storage=storage)
    # The manifest was created: the checkpoint committed, and its files were not discarded.
    assert ckptkit.verify("step_9", storage=storage).ok
    assert torch.equal(ckptkit.load("step_9", storage=storage)["model"]["w"], _state(9)["model"]["w"])
    # A create retried after its first try succeeded finds its own bytes: not a conflict.
    storage.create("k", b"mine")
    storage.create("k", b"mine")
    with pytest.raises(CheckpointExistsError):
        storage.create("k", b"theirs")


@pytest.mark.parametrize("fmt", ["hf", "zarr"])
def test_two_exports_to_one_destination_exactly_one_commits(s3_bucket: str, fmt: str) -> None:
    from ckptkit.io.checksum import checksum_of

    source = str(Path(__file__).resolve().parents[1] / "fixtures" / "llama-v1.1")
    dst = f"s3://{s3_bucket}/race-{fmt}"
    outcomes = _race(lambda i: ckptkit.export(source, dst, format=fmt, dtype="fp32" if fmt == "hf" else None))
    assert sorted(outcomes.values())[0] == "committed" and len(outcomes) == 2, outcomes
    assert sorted(outcomes.values())[1].startswith("refused: "), outcomes  # the other wrote nothing
    storage = S3Storage(dst)
    report = json.loads(storage.read("export_report.json"))
    listed = {f["path"]: f["checksum"] for f in report["file_list"]}
    assert {path: checksum_of(storage.read(path)) for path in listed} == listed  # one writer's files, whole
    assert not storage.exists(".ckptkit-claim")
    if fmt == "zarr":
        assert ckptkit.verify(dst).ok


def test_an_export_that_claims_a_committed_destination_backs_off_and_deletes_nothing(s3_bucket: str) -> None:
    from ckptkit.io.catalog import locate
    from ckptkit.io.commit import staging

    source = str(Path(__file__).resolve().parents[1] / "fixtures" / "llama-v1.1")
    dst = f"s3://{s3_bucket}/late"
    ckptkit.export(source, dst, dtype="fp32")
    storage = S3Storage(dst)
    files = storage.list("")
    # As a second export would, had it checked for DST just before the first one committed.
    with pytest.raises(CheckpointExistsError, match="another writer committed it"):
        staging(locate(dst), "late0123", fixed_paths=True)
    assert storage.list("") == files and ".ckptkit-claim" not in files
