"""Convert a Hugging Face transformers model directory into a ckptkit checkpoint.

Reads ``config.json`` and the weights: ``model.safetensors``, or the shards that
``model.safetensors.index.json`` names; else the pickled ``pytorch_model.bin`` or the shards
``pytorch_model.bin.index.json`` names (``torch.save`` archives of a state dict, as transformers
4 and ``huggingface_hub.save_torch_state_dict(..., safe_serialization=False)`` write them). Each
safetensors header is parsed with ckptkit's own codec; each pickle through `STATE_DICT_ALLOWED`
(tensors, parameters, ``OrderedDict``: anything else is refused, naming the class, and nothing of
the file runs). A truncated or inconsistent file is refused before anything is written, and each
tensor's bytes are then read straight from its byte range, one tensor at a time; torch is not used.

Names: Hugging Face key ``k`` becomes ckptkit name ``model/<k>`` (`fqn_of`; the key is one
name part, escaped as ckptkit escapes a part), e.g. ``model.layers.0.self_attn.q_proj.weight``
-> ``model/model.layers.0.self_attn.q_proj.weight``: the names of the model's Hugging Face
view, so for every model type with a canonical model (``ckptkit.models``: the Llama family and
its mixtures of experts, GPT-NeoX, GPT-2) the layout is derived from ``config.json`` and
recorded (``hf-<model_type>``), and the checkpoint reshards and exports without ``--layout``.
`hf_key` is the exact inverse. Every tensor
is of kind ``param``; the step is 0.

Tied weights are stored once by transformers (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``): no tensor is invented; the object ``hf/tied_weights`` maps each
missing tied name to the stored one. ``config.json`` and ``generation_config.json`` are kept
as JSON in the manifest's ``info.config`` (under their file names) and, for a family with a
layout, as ``info.model``; the tokenizer files (`TOKENIZER_FILES`) become the checkpoint's
tokenizer files.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from pydantic import JsonValue

from ckptkit.errors import CkptkitError, IntegrityError, LayoutError, ManifestError
from ckptkit.io.safetensors import Header
from ckptkit.layouts import Layout
from ckptkit.manifest import CheckpointInfo, ModelInfo, Topology, strictjson
from ckptkit.models import READERS
from ckptkit.ops.convert import ConvertReport, Progress, TensorSpec, refuse_skips, report_of, source_info, write_converted
from ckptkit.state.tree import escape, unescape
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.files import read_small, safetensors_header
from ckptkit_adapters.common.torchsave import STATE_DICT_ALLOWED, StoredTensor, contiguous_range, open_archive, stored_object
from ckptkit_adapters.hf.trainer import TrainerState, is_trainer_folder, read_trainer
from ckptkit_adapters.hf.view import TIED_WEIGHTS, hf_layout, tied_heads

NAME = "hf"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLED_SINGLE = "pytorch_model.bin"
PICKLED_INDEX = "pytorch_model.bin.index.json"
PICKLED = (PICKLED_SINGLE, PICKLED_INDEX)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja")
DEFAULT_EMBEDDING = "model.embed_tokens.weight"  # the embedding a tied head shares, for a model type with no canonical model
JSON_LIMIT = 64 << 20  # no config or index file is read past this size
TOKENIZER_LIMIT = 256 << 20  # nor a tokenizer file past this one
_CHUNK = 1 << 30  # one pread at most (Linux reads at most ~2 GiB per call)


def fqn_of(key: str) -> str:
    """The ckptkit name of Hugging Face key `key`: ``model/`` and the key as one escaped part."""
    return f"model/{escape(key)}"


def hf_key(fqn: str) -> str:
    """The Hugging Face key of ckptkit name `fqn` (the inverse of `fqn_of`)."""
    return unescape(fqn.removeprefix("model/"))


@dataclass(frozen=True, slots=True)
class Stored:
    """Where one tensor's bytes are: its file (relative to the model directory) and header entry."""

    file: str
    begin: int
    end: int


@dataclass
class _Source:
    config: dict[str, JsonValue]
    generation: dict[str, JsonValue] | None
    tensors: list[tuple[TensorSpec, Stored]] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    tokenizer: dict[str, bytes] = field(default_factory=dict)


class HfConverter:
    """The ``hf`` converter (registered in the ``ckptkit.converters`` entry-point group)."""

    name = NAME
    description = "Hugging Face transformers model directory (config.json and safetensors weights, single or sharded)"

    def detect(self, path: str) -> bool:
        """Whether `path` holds ``config.json`` and weights (safetensors or pickled)."""
        try:
            names = set(os.listdir(path))
        except OSError:
            return False
        return CONFIG in names and bool(names & {SINGLE, INDEX, *PICKLED})

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None) -> ConvertReport:
        """Convert the Hugging Face model directory `src` into the committed ckptkit checkpoint `dst`
        (recording `layout` if given, else the family's built-in one).

        A ``Trainer`` checkpoint folder's optimizer, scheduler and state come along (see
        `ckptkit_adapters.hf.trainer`); what of it is not read yet is listed, and fails the
        conversion unless `allow_skip`.

        Raises:
            ManifestError: no weights, a malformed ``config.json`` or index, a pickle naming a
                class outside the allowlist (named).
            IntegrityError: a weights file missing, truncated or unlike its header or the index.
            LayoutError: the tensors do not fit the family's built-in layout.
            CheckpointExistsError, StorageError: as `ckptkit.ops.convert.write_converted`.
        """
        started = time.perf_counter()
        if not os.path.isdir(src):
            raise IntegrityError(f"{src}: no such directory")
        source = read_source(src)
        stored = {spec.name: where for spec, where in source.tensors}
        fds: dict[str, int] = {}
        names = set(os.listdir(src))
        trainer = (read_trainer(src, source.config, {spec.source: spec.shape for spec, _ in source.tensors})
                   if is_trainer_folder(names) else TrainerState())
        try:
            refuse_skips(trainer.skipped, allow_skip=allow_skip, where=src)
        except ManifestError:
            for fd in trainer.fds:
                os.close(fd)
            raise
        readers = {spec.name: read_one for spec, read_one in trainer.tensors}

        def read(spec: TensorSpec) -> memoryview:
            if spec.name in readers:
                return readers[spec.name]()
            where = stored[spec.name]
            if where.file not in fds:
                fds[where.file], _ = open_regular(os.path.join(src, where.file))
            return read_range(fds[where.file], where.begin, where.end, os.path.join(src, where.file))

        found = None if layout is not None else layout_of(source.config)
        objects: dict[str, JsonValue] = {TIED_WEIGHTS: dict(source.tied)} if source.tied else {}
        objects |= trainer.objects
        info = info_of(source, layout or found).model_copy(update={"optimizer": trainer.optimizer, "scheduler": trainer.scheduler})
        specs = [spec for spec, _ in source.tensors] + [spec for spec, _ in trainer.tensors]
        try:
            committed = write_converted(dst, specs, read, objects=objects, step=lambda: trainer.step, info=info,
                                        layout=layout or found, tokenizer=source.tokenizer, progress=progress,
                                        source=source_info(NAME, src, version=source.config.get("transformers_version"),
                                                           topology=_trainer_topology(names)))
        finally:
            for fd in [*fds.values(), *trainer.fds]:
                os.close(fd)
        sources = {TIED_WEIGHTS: f"{CONFIG}:tie_word_embeddings"} if source.tied else {}
        return report_of(NAME, src, committed, [(spec, 1) for spec in specs], sources | trainer.sources, trainer.skipped, started)


def _trainer_topology(names: set[str]) -> Topology | None:
    """A ``Trainer`` folder's data-parallel size (one ``rng_state_<rank>.pth`` per process, or
    one ``rng_state.pth``); None for a model directory, which has no topology."""
    if not is_trainer_folder(names):
        return None
    ranks = sum(1 for n in names if re.fullmatch(r"rng_state_\d+\.pth", n)) or 1
    return Topology(world_size=ranks, dp=ranks)


def read_source(src: str) -> _Source:
    """Read the config, the weights' headers (and index) and the tokenizer files of `src`;
    collect every problem with the weights, then raise once.

    Raises:
        ManifestError: no weights, a malformed ``config.json`` or index, a refused pickle.
        IntegrityError: weights files missing, truncated, or unlike their headers or the index.
    """
    config = _read_json(src, CONFIG)
    if not isinstance(config, dict):
        raise ManifestError(f"{os.path.join(src, CONFIG)}: not a JSON object")
    generation = _read_json(src, GENERATION_CONFIG) if os.path.exists(os.path.join(src, GENERATION_CONFIG)) else None
    source = _Source(config, generation if isinstance(generation, dict) else None)
    weight_map = _weight_map(src)
    problems: list[str] = []
    headers = {file: _entries(src, file, problems) for file in sorted(set(weight_map.values()))}
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        by_file.setdefault(file, []).append(key)
    for file, header in headers.items():
        if header is None:
            continue
        listed = set(by_file[file])
        problems += [f"{file}: holds {k!r}, which the index does not list under it" for k in sorted(set(header) - listed)]
        problems += [f"{file}: lacks {k!r}, which the index lists under it" for k in sorted(listed - set(header))]
        for key, entry in sorted(header.items(), key=lambda kv: kv[1].begin):
            spec = TensorSpec(name=fqn_of(key), source=key, dtype=entry.dtype, shape=entry.shape, kind="param")
            source.tensors.append((spec, Stored(file, entry.begin, entry.end)))
    if problems:
        raise IntegrityError(f"{src}: {len(problems)} problem(s): " + "; ".join(problems[:10]))
    source.tied = tied_weights(config, {spec.source for spec, _ in source.tensors})
    source.tokenizer = _tokenizer_files(src)
    return source


def _weight_map(src: str) -> dict[str, str]:
    """Every tensor key and the file holding it (one file: its own keys). Safetensors first."""
    for index_name, single in ((INDEX, SINGLE), (PICKLED_INDEX, PICKLED_SINGLE)):
        if os.path.exists(os.path.join(src, index_name)):
            return _index(src, index_name)
        if os.path.exists(os.path.join(src, single)):
            return {key: single for key in _single_keys(src, single)}
    raise ManifestError(f"{src}: no weights ({SINGLE}, {INDEX}, {PICKLED_SINGLE} or {PICKLED_INDEX})")


def _index(src: str, name: str) -> dict[str, str]:
    index = _read_json(src, name)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ManifestError(f"{os.path.join(src, name)}: no weight_map object of key -> file name")
    files = {key: file for key, file in weight_map.items() if isinstance(file, str)}
    bad = sorted({f for f in files.values() if os.path.basename(f) != f or f in ("", ".", "..")})
    if bad:
        raise ManifestError(f"{os.path.join(src, name)}: file names outside the model directory: {', '.join(bad[:5])}")
    return files


def _single_keys(src: str, file: str) -> list[str]:
    problems: list[str] = []
    entries = _entries(src, file, problems)
    if entries is None:
        raise IntegrityError(f"{src}: " + "; ".join(problems))
    return list(entries)


@dataclass(frozen=True, slots=True)
class _Entry:
    """A tensor of a weights file: dtype, shape and its bytes [begin, end) in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _entries(src: str, file: str, problems: list[str]) -> dict[str, _Entry] | None:
    """The tensors of weights file `file` (safetensors, or pickled when it ends in ``.bin``),
    or None with the problem recorded."""
    if not file.endswith(".bin"):
        header = _header(src, file, problems)
        return None if header is None else {k: _Entry(e.dtype, e.shape, e.begin, e.end) for k, e in header.entries.items()}
    path = os.path.join(src, file)
    try:
        fd, size = open_regular(path)
    except OSError as exc:
        problems.append(f"{file}: missing or unreadable ({exc})")
        return None
    try:
        archive = open_archive(fd, 0, size, path)
        state = stored_object(archive, STATE_DICT_ALLOWED)
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, StoredTensor) for k, v in state.items()):
            raise IntegrityError(f"{path}: not a state dict of tensors")
        out = {}
        for key, stored in state.items():
            where = contiguous_range(archive, stored)
            if where is None:
                raise IntegrityError(f"{path}: {key} is stored as a strided view; re-save the state dict with contiguous tensors")
            out[key] = _Entry(stored.dtype, stored.shape, *where)
        return out
    except ManifestError:
        raise  # a refused class: named, and never skipped
    except CkptkitError as exc:
        problems.append(str(exc))
        return None
    finally:
        os.close(fd)


def _header(src: str, file: str, problems: list[str]) -> Header | None:
    """The parsed header of weights file `file`, or None with the problem recorded."""
    try:
        return safetensors_header(os.path.join(src, file))
    except (CkptkitError, OSError) as exc:
        problems.append(f"{file}: missing or unreadable ({exc})" if isinstance(exc, OSError) else str(exc))
        return None


def read_range(fd: int, begin: int, end: int, where: str) -> memoryview:
    """The bytes [begin, end) of the open file `fd`.

    Raises:
        IntegrityError: the file ends before `end` (it shrank after its header was checked).
    """
    buf = bytearray(end - begin)
    view = memoryview(buf)
    pos = 0
    while pos < len(buf):
        got = os.preadv(fd, [view[pos:pos + _CHUNK]], begin + pos)
        if got == 0:
            raise IntegrityError(f"{where}: ends at byte {begin + pos}, before the tensor bytes end at {end} (truncated?)")
        pos += got
    return view


def tied_weights(config: dict[str, JsonValue], keys: set[str]) -> dict[str, str]:
    """The tied names that are not stored, each with the stored tensor it shares: the head of a
    model whose config ties it (`ckptkit_adapters.hf.view.tied_heads`; for a model type with no canonical
    model, ``lm_head.weight`` when the config ties word embeddings, transformers' default)."""
    try:
        known = str(config.get("model_type")) in READERS
        tied = tied_heads(config) if known else {}
    except LayoutError:  # the layout's reading of the config names the problem (or --layout was given)
        known, tied = False, {}
    if not known:
        tied = {"lm_head.weight": DEFAULT_EMBEDDING} if config.get("tie_word_embeddings", True) is True else {}
    return {head: embedding for head, embedding in tied.items() if head not in keys and embedding in keys}


def layout_of(config: dict[str, JsonValue]) -> Layout | None:
    """The layout of the model under its Hugging Face names (`ckptkit_adapters.hf.view.hf_layout`), or
    None for a model type with no canonical model (its weights convert; reshard and export
    then need --layout).

    Raises:
        LayoutError: the config lacks a value the model needs, or has a wrong one.
    """
    if str(config.get("model_type")) not in READERS:
        return None
    return hf_layout(config)


def info_of(source: _Source, layout: Layout | None) -> CheckpointInfo:
    """The manifest's info: the config files as JSON, and the model's family (its layout's
    name) and config when it has a layout."""
    files: dict[str, JsonValue] = {CONFIG: source.config}
    if source.generation is not None:
        files[GENERATION_CONFIG] = source.generation
    model = None if layout is None else ModelInfo(family=layout.name, config=source.config)
    return CheckpointInfo(config=files, model=model)


def _read_json(src: str, name: str) -> JsonValue:
    path = os.path.join(src, name)
    data = read_small(path, JSON_LIMIT, "a JSON file")
    try:
        return strictjson.loads(data)  # type: ignore[no-any-return]
    except (strictjson.StrictJsonError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc})") from None


def _tokenizer_files(src: str) -> dict[str, bytes]:
    out = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if not os.path.lexists(path):
            continue
        out[name] = read_small(path, TOKENIZER_LIMIT, "a tokenizer file")
    return out


CONVERTER = HfConverter()

__all__ = ["CONVERTER", "NAME", "HfConverter", "fqn_of", "hf_key", "info_of", "layout_of", "read_range", "read_source",
           "tied_weights"]
