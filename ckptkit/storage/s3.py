"""S3 object storage through boto3: ranged reads, parallel multipart writes, conditional creates.

The root is ``s3://bucket/prefix``; keys are relative to the prefix. Endpoint, region and
credentials come from the standard AWS environment and configuration (``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, profiles...). Retries with backoff on throttling,
5xx and connection errors are botocore's ("standard" mode, `max_attempts`); a body that
arrives short is read again. Uploads carry a checksum that the server checks (botocore's
default CRC32), and downloads are checked against the response's checksum when the server
sends one; ckptkit's own checksums check payloads end to end.

S3 cannot rename: a checkpoint is written in place, payloads first, and appears when its
manifest is created with ``If-None-Match: *`` (`create`), so two writers never both commit
the same name. Listings are only a hint: committed checkpoints are found by their manifests.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from ..errors import CheckpointExistsError, StorageError
from .base import Buffer, Capabilities, byte_view, check_key

PART_SIZE = 8 << 20
CONCURRENCY = 5
READ_ATTEMPTS = 5


class S3Storage:
    """Keys under ``s3://bucket/prefix``, through one boto3 client (thread-safe)."""

    def __init__(
        self,
        url: str,
        *,
        part_size: int | None = None,
        concurrency: int | None = None,
        max_attempts: int | None = None,
        client: Any = None,
    ) -> None:
        """Defaults: `part_size` 8 MiB, `concurrency` 5 parts in flight per write, `max_attempts` 8
        tries per request; the environment's ``CKPTKIT_S3_PART_SIZE`` (bytes),
        ``CKPTKIT_S3_CONCURRENCY`` and ``CKPTKIT_S3_MAX_ATTEMPTS`` override them (for URLs opened
        by the commands)."""
        part_size = part_size or _env_int("CKPTKIT_S3_PART_SIZE", PART_SIZE)
        concurrency = concurrency or _env_int("CKPTKIT_S3_CONCURRENCY", CONCURRENCY)
        max_attempts = max_attempts or _env_int("CKPTKIT_S3_MAX_ATTEMPTS", 8)
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise StorageError(f"{url}: not an s3://bucket[/prefix] URL")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""
        self.root = f"s3://{bucket}/{prefix}".rstrip("/")
        self.part_size = max(part_size, 5 << 20)  # S3's smallest part (but the last)
        self.concurrency = max(1, concurrency)
        self.client = client if client is not None else _client(max_attempts, self.concurrency)

    def __repr__(self) -> str:
        return f"S3Storage({self.root!r})"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(rename=False)

    def local_path(self, key: str) -> str:
        raise StorageError(f"{self.root}/{key}: an object store has no local files")

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    # --- reads --------------------------------------------------------------------------------

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            self.size(key)
            return b""
        total = length if length is not None else self.size(key) - offset
        if total < 0:
            raise StorageError(f"{self.root}/{key}: short read, offset {offset} is past the end")
        buf = bytearray(total)
        if buf:
            self.readinto(key, offset, memoryview(buf))
        return bytes(buf)

    def readinto(self, key: str, offset: int, buffer: memoryview) -> None:
        self.readv(key, offset, [buffer])

    def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [v for v in (byte_view(b) for b in buffers) if len(v)]
        want = sum(len(v) for v in views)
        if not want:
            return
        where = f"{self.root}/{key}"
        ranged = f"bytes={offset}-{offset + want - 1}"
        for attempt in range(READ_ATTEMPTS):
            response = self._call("get_object", where, Bucket=self.bucket, Key=self._key(key), Range=ranged)
            got = 0
            try:
                for chunk in response["Body"].iter_chunks(1 << 20):
                    if got + len(chunk) > want:
                        raise StorageError(f"{where}: the server sent more than the {want} bytes asked")
                    _scatter(views, got, memoryview(chunk))
                    got += len(chunk)
            except StorageError:
                raise
            except Exception as exc:  # a connection dropped mid-body: read the range again
                if attempt + 1 == READ_ATTEMPTS:
                    raise StorageError(f"{where}: read failed: {exc}") from exc
                _backoff(attempt)
                continue
            finally:
                response["Body"].close()
            if got == want:
                return
            total = _total_size(response)
            if total is not None and offset + want > total:
                raise StorageError(f"{where}: short read, wanted {want} bytes at {offset}, have {total}")
            if attempt + 1 == READ_ATTEMPTS:
                raise StorageError(f"{where}: short read, wanted {want} bytes at {offset}, got {got}")
            _backoff(attempt)  # a truncated body: read the range again

    def size(self, key: str) -> int:
        head = self._call("head_object", f"{self.root}/{key}", Bucket=self.bucket, Key=self._key(key))
        return int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except StorageError:
            return self.is_prefix(key)

    def is_prefix(self, key: str) -> bool:
        page = self._call("list_objects_v2", self.root, Bucket=self.bucket, Prefix=self._key(key) + "/", MaxKeys=1)
        return bool(page.get("KeyCount", 0))

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
        head = self.prefix + (check_key(prefix) + "/" if prefix else "")
        options: dict[str, Any] = {"Bucket": self.bucket, "Prefix": head}
        if not recursive:
            options["Delimiter"] = "/"
        out = []
        token = None
        while True:
            page = self._call("list_objects_v2", self.root, **options, **({"ContinuationToken": token} if token else {}))
            out += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
            out += [p["Prefix"][len(self.prefix) :] for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                return sorted(out)
            token = page["NextContinuationToken"]

    # --- writes -------------------------------------------------------------------------------

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        """Store the chunks under `key`: one PUT up to `part_size`, else a multipart upload with
        up to `concurrency` parts in flight (each part a copy). Nothing appears unless it completes."""
        target = self._key(key)
        parts = _parts(chunks, self.part_size)
        first = next(parts, bytearray())
        second = next(parts, None)
        if second is None:
            self._call("put_object", f"{self.root}/{key}", Bucket=self.bucket, Key=target, Body=first)
            return len(first)
        return self._multipart(key, target, first, second, parts)

    def create(self, key: str, data: bytes) -> None:
        """Store `data` under `key` only if nothing is there (``If-None-Match: *``).

        Raises:
            CheckpointExistsError: the key exists (another writer created it first).
        """
        try:
            self._call("put_object", f"{self.root}/{key}", Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except _Precondition:
            # A retried request whose first try succeeded also ends here: then the bytes are ours.
            if self.read(key) == bytes(data):
                return
            raise CheckpointExistsError(f"{self.root}/{key}: already exists (another writer got there first)") from None

    def _multipart(self, key: str, target: str, first: bytearray, second: bytearray, rest: Iterator[bytearray]) -> int:
        where = f"{self.root}/{key}"
        upload = self._call("create_multipart_upload", where, Bucket=self.bucket, Key=target)["UploadId"]
        size = 0
        try:
            with ThreadPoolExecutor(self.concurrency) as pool:
                pending: list[Future[dict[str, Any]]] = []
                number = 0
                for part in _chain(first, second, rest):
                    number += 1
                    size += len(part)
                    running = [f for f in pending if not f.done()]
                    if len(running) >= self.concurrency:
                        wait(running, return_when=FIRST_COMPLETED)
                    pending.append(pool.submit(self._upload_part, where, target, upload, number, part))
                done = [f.result() for f in pending]
            self._call("complete_multipart_upload", where, Bucket=self.bucket, Key=target, UploadId=upload,
                       MultipartUpload={"Parts": done})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=target, UploadId=upload)
            except Exception:  # the upload expires by lifecycle rules; nothing was committed
                pass
            raise
        return size

    def _upload_part(self, where: str, target: str, upload: str, number: int, data: bytearray) -> dict[str, Any]:
        out = self._call("upload_part", where, Bucket=self.bucket, Key=target, UploadId=upload, PartNumber=number, Body=data)
        part = {"PartNumber": number, "ETag": out["ETag"]}
        for field in ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumSHA1", "ChecksumSHA256", "ChecksumCRC64NVME"):
            if field in out:
                part[field] = out[field]
        return part

    def delete(self, prefix: str) -> None:
        keys = [self._key(prefix)] + [self.prefix + k for k in self.list(prefix)]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            out = self._call("delete_objects", f"{self.root}/{prefix}", Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if out.get("Errors"):
                first = out["Errors"][0]
                raise StorageError(f"{self.root}/{prefix}: cannot delete {first.get('Key')}: {first.get('Message')}")

    def rename(self, src: str, dst: str) -> None:
        raise StorageError(f"{self.root}: S3 cannot rename ({src} -> {dst}); checkpoints are committed by their manifest")

    # --- errors -------------------------------------------------------------------------------

    def _call(self, operation: str, where: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, operation)(**kwargs)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code in ("PreconditionFailed", "412") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                raise _Precondition(where) from exc
            if code in ("NoSuchKey", "404", "NotFound"):
                raise StorageError(f"{where}: no such key") from None
            raise StorageError(f"{where}: {operation} failed: {code or 'error'}: {error.get('Message', exc)}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"{where}: {operation} failed: {exc}") from exc


class _Precondition(StorageError):
    """A conditional write found the key taken."""


def _client(max_attempts: int, concurrency: int) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        max_pool_connections=max(10, 2 * concurrency),
        connect_timeout=10,
        read_timeout=60,
        s3={"addressing_style": os.environ.get("CKPTKIT_S3_ADDRESSING", "path")},
    )
    return boto3.client("s3", config=config)


def _parts(chunks: Iterable[Buffer], size: int) -> Iterator[bytearray]:
    """Regroup chunks into parts of exactly `size` bytes (the last may be shorter), each copied
    once into a buffer of its own."""
    part = bytearray(size)
    filled = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while len(view):
            take = min(size - filled, len(view))
            part[filled : filled + take] = view[:take]
            filled += take
            view = view[take:]
            if filled == size:
                yield part  # botocore sends a bytearray body as it does bytes
                part = bytearray(size)
                filled = 0
    if filled:
        yield part[:filled]


def _chain(first: bytearray, second: bytearray, rest: Iterator[bytearray]) -> Iterator[bytearray]:
    yield first
    yield second
    yield from rest


def _total_size(response: dict[str, Any]) -> int | None:
    content_range = str(response.get("ContentRange", ""))
    total = content_range.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        value = int(text) if text else default
    except ValueError:
        raise StorageError(f"{name}={text!r} is not a whole number") from None
    if value < 1:
        raise StorageError(f"{name}={text!r} must be at least 1")
    return value


def _scatter(views: list[memoryview], at: int, chunk: memoryview) -> None:
    """Copy `chunk`, the bytes from position `at` of the concatenated `views`, into them."""
    for view in views:
        if at >= len(view):
            at -= len(view)
            continue
        n = min(len(view) - at, len(chunk))
        view[at : at + n] = chunk[:n]
        chunk = chunk[n:]
        at = 0
        if not len(chunk):
            return


def _backoff(attempt: int) -> None:
    time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
