"""Payload files as the manifest describes them: read and check their headers (no torch); open a checkpoint with its checked manifest.

A tensors file is a safetensors file, or (``encoding: raw``) the bytes of one shard from
offset 0: its "header" is empty and the shard's place follows from the manifest alone.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from .catalog import Location, read_manifest, resolve
from .chain import check_bases
from ..manifest.consistency import manifest_findings
from ..errors import CkptkitError, IntegrityError, ManifestError
from ..storage import Storage
from .checksum import BlockHasher, hasher_for
from ..manifest.dtypes import itemsize
from ..manifest import SIDECAR_SUFFIX, FileEntry, Manifest
from ..manifest.model import file_checksum_of_blocks
from ..manifest.shards import KeyIndex
from ..plan.load import Read
from .safetensors import Header, HeaderEntry, header_length, parse_header


# Checked headers of payload files by file index (a cache callers pass along), with their raw bytes.
Headers = dict[int, tuple[Header, bytes]]


def open_checkpoint(path: str | os.PathLike[str], storage: Storage | None = None) -> tuple[Location, Manifest]:
    """Return the location and the checked manifest of the committed checkpoint at `path`.

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest is malformed, newer, or inconsistent with itself.
        IntegrityError: it refers to files of earlier checkpoints that do not hold them
            (``ckptkit.io.chain``).
    """
    loc = resolve(path, storage)
    manifest = read_manifest(loc)
    findings = manifest_findings(manifest)
    if findings:
        raise ManifestError(f"{loc}: manifest is inconsistent: " + "; ".join(str(f) for f in findings[:10]))
    if manifest.bases():
        check_bases(loc, manifest)
    return loc, manifest


def read_header(loc: Location, manifest: Manifest, index: int) -> tuple[Header, bytes]:
    """Read and check the safetensors header of payload file `index`; return it and its raw bytes
    (length prefix included). A raw file has an empty header: data from byte 0, no entries.

    Raises:
        IntegrityError: the file is missing, of another size than the manifest says, or its
            header is malformed.
    """
    entry = manifest.files[index]
    key = loc.file_key(entry)
    where = loc.file_str(entry)
    if not loc.storage.exists(key):
        raise IntegrityError(f"{where}: listed in the manifest but missing")
    size = loc.storage.size(key)
    if size != entry.size:
        raise IntegrityError(f"{where}: {size} bytes, manifest says {entry.size} (truncated or replaced?)")
    if entry.encoding == "raw":
        return Header(0, {}, {}), b""
    first = loc.storage.read(key, 0, 8)
    n = header_length(first, where=where)
    if 8 + n > size:
        raise IntegrityError(f"{where}: header of {n} bytes runs past the end of the file")
    text = loc.storage.read(key, 8, n)
    return parse_header(text, where=where, file_size=size), first + text


def header_problems(
    header: Header, file: int, index: KeyIndex, unchecked: Collection[str] = (), *, borrowed: bool = False
) -> list[str]:
    """What a payload file's header holds that the manifest does not put there: a key of no
    non-empty shard of that file (but for `unchecked`, and for any key of an earlier checkpoint's
    file, `borrowed`, whose other keys are that checkpoint's), or one of another dtype or shape."""
    problems = []
    for key, got in header.entries.items():
        found = index.shard(file, key)
        if found is None:
            patch = index.patch_key(file, key)
            if patch is not None:
                if (got.dtype, got.shape) != patch:
                    problems.append(f"patch array {key!r} is {got.dtype}{list(got.shape)}, manifest says {patch[0]}{list(patch[1])}")
            elif key not in unchecked and not borrowed:
                problems.append(f"tensor {key[:200]!r} is not in the manifest")
            continue
        fqn, box = found
        dtype = index.tensors[fqn].dtype
        if (got.dtype, got.shape) != (dtype, box.lengths):
            problems.append(f"tensor {key!r} is {got.dtype}{list(got.shape)}, manifest says {dtype}{list(box.lengths)}")
    return problems


def header_entry(loc: Location, manifest: Manifest, header: Header, read: Read, dtype: str) -> HeaderEntry:
    """Return the header entry of the shard `read` reads, checked against the manifest's dtype and box.

    Raises:
        IntegrityError: the key is missing from the file, or holds another dtype or shape (for a
            raw file: the file is shorter than the shard).
    """
    file = manifest.files[read.file]
    if file.encoding == "raw":
        nbytes = read.src_box.volume * itemsize(dtype)
        if nbytes > file.size:
            raise IntegrityError(f"{loc.file_str(file)}: {file.size} bytes, too short for {dtype}{list(read.src_box.lengths)}")
        return HeaderEntry(dtype, read.src_box.lengths, 0, nbytes)
    entry = header.entries.get(read.key)
    if entry is None or entry.shape != read.src_box.lengths or entry.dtype != dtype:
        found = "missing" if entry is None else f"{entry.dtype}{list(entry.shape)}"
        raise IntegrityError(
            f"{loc.file_str(manifest.files[read.file])}: tensor {read.key!r} is {found}, "
            f"manifest says {dtype}{list(read.src_box.lengths)}"
        )
    return entry


def block_digests(storage: Storage, key: str, entry: FileEntry, where: str) -> bytes:
    """The block digests of the file `entry` lists (stored under `key`, named `where` in messages):
    the manifest's own (up to schema 1.4), or its sidecar's (``key + SIDECAR_SUFFIX``, schema
    1.5), checked against the file's checksum before any is used.

    Raises:
        IntegrityError: the sidecar cannot be read, or is not the digests the file checksum covers.
    """
    assert entry.blocks is not None
    inline = entry.blocks.inline()
    if inline is not None:
        return inline
    expected = 8 * entry.blocks.count(entry.size)
    try:
        data = storage.read(key + SIDECAR_SUFFIX)
    except (CkptkitError, OSError) as exc:
        raise IntegrityError(f"{where}{SIDECAR_SUFFIX}: cannot be read ({exc}); the file's blocks cannot be checked") from None
    if len(data) != expected or file_checksum_of_blocks(data) != entry.checksum:
        size = f" ({len(data)} bytes, {expected} expected)" if len(data) != expected else ""
        raise IntegrityError(f"{where}{SIDECAR_SUFFIX}: does not hash to the file's checksum in the manifest{size}; "
                             f"the file's blocks cannot be checked")
    return data


def content_problem(entry: FileEntry, data: memoryview) -> str:
    """What is wrong with `data` as the whole content of the file `entry` lists ('' if nothing):
    its size, then its block checksums (the manifest's own: a memory tier snapshot's, which keeps
    them there) or, without blocks, its file checksum."""
    if len(data) != entry.size:
        return f"{len(data)} bytes, the manifest lists {entry.size}"
    if entry.blocks is not None:
        expected = entry.blocks.inline()
        if expected is None:
            return "its block digests are in a sidecar, which a whole-content check does not read"
        hasher = BlockHasher(entry.blocks.size)
        hasher.update(data)
        digests = hasher.finish()
        bad = sum(digests[i : i + 8] != expected[i : i + 8] for i in range(0, max(len(digests), len(expected)), 8))
        return f"{bad} block(s) of {entry.blocks.size} bytes do not match their checksums" if bad else ""
    whole = hasher_for(entry.checksum)
    whole.update(data)
    return "" if whole.digest() == entry.checksum else f"content hashes to {whole.digest()}, the manifest says {entry.checksum}"


def read_checked(loc: Location, entry: FileEntry) -> bytes:
    """Return the whole content of a (small) file of the checkpoint, checked against its size and checksum.

    Raises:
        IntegrityError: the content does not match the manifest entry.
    """
    data = loc.storage.read(loc.file_key(entry))
    hasher = hasher_for(entry.checksum)
    hasher.update(data)
    if len(data) != entry.size or hasher.digest() != entry.checksum:
        raise IntegrityError(f"{loc.file_str(entry)}: does not match its manifest entry (size or checksum)")
    return data
