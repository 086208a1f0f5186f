"""Adapters: each tool's reader, writer and view in one package, found through entry points.

A tool (Hugging Face, Megatron-Core, DeepSpeed, torch DCP, peft, zarr) is one `Adapter`, registered
in the ``ckptkit.adapters`` entry-point group (the ``ckptkit_adapters`` package ships one folder
per tool; any distribution may add one). It declares:

- its reader (``converter``: a `ckptkit.ops.convert.Converter`, imported when a conversion or a
  detection runs), for ``ckptkit convert --from <name>``;
- the export formats it writes (``formats``: `ckptkit.exports.formats.ExportFormat` entries,
  each importing its writer when an export runs), for ``ckptkit export --format <name>``;
- the model families its checkpoints are laid out by (``families``: `Family`, a built-in layout
  of a model config, and the canonical model and view of a checkpoint of that layout).

The core never imports an adapter by name: `adapters` loads them (an adapter's package must
import cheaply: no torch, no numpy at its top), `converter_of`, `export_formats`,
`layout_family` and `model_family` read them. An adapter imports only ckptkit's modules, never another adapter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from .errors import LayoutError, ManifestError

if TYPE_CHECKING:  # the registry imports nothing of the core's layers: the command reads it at start
    from .exports.formats import ExportFormat
    from .layouts.model import Layout
    from .models.spec import ModelSpec
    from .models.view import View
    from .ops.convert import Converter

ENTRY_POINT_GROUP = "ckptkit.adapters"


@dataclass(frozen=True)
class Family:
    """A model family a tool's checkpoints are laid out by.

    ``name`` is a layout's name (``megatron-gpt``) or, ending in ``-``, the prefix of a set of
    them (``hf-``: ``hf-llama``, ``hf-mixtral``, ...). ``layout(config)`` is the family's
    built-in layout of a model config (``ckptkit layout builtin <name>``); ``model(layout,
    carried)`` the canonical model and the view a checkpoint of that layout is saved in (`carried`:
    the model config the checkpoint records, ``info.config``); ``modules(spec)`` the view of the
    names a job of the model holds in memory (the keys FSDP2's state dict gives), where they
    differ from the saved ones. Each raises `LayoutError` for a config it cannot read.
    """

    name: str
    layout: Callable[[Mapping[str, Any]], Layout] | None = None
    model: Callable[[Layout, Mapping[str, Any] | None], tuple[ModelSpec, View]] | None = None
    modules: Callable[[ModelSpec], View] | None = None

    def names(self, layout: str) -> bool:
        """Whether the layout named `layout` is one of this family's."""
        return layout.startswith(self.name) if self.name.endswith("-") else layout == self.name


@dataclass(frozen=True)
class Adapter:
    """One tool: its name, what it is, its reader, the formats it writes and its model families."""

    name: str
    description: str
    converter: Callable[[], Converter] | None = None  # imports the reader; None: the tool is written, never read
    formats: tuple[ExportFormat, ...] = ()
    families: tuple[Family, ...] = ()


def lazy(target: str) -> Callable[[], Any]:
    """A function returning the object `target` names (``package.module:NAME``), imported when
    it is first called: what an adapter gives as its converter, so that reading the registry
    imports no reader."""

    def load() -> Any:
        import importlib

        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)

    return load


@functools.cache
def _registry() -> tuple[dict[str, Adapter], dict[str, str]]:
    """The adapters that import, by name, and why each of the others does not."""
    out: dict[str, Adapter] = {}
    broken: dict[str, str] = {}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            found = ep.load()
        except ImportError as exc:
            broken[ep.name] = str(exc)
            continue
        if not isinstance(found, Adapter) or found.name != ep.name:
            raise ManifestError(f"entry point {ep.name!r} of {ENTRY_POINT_GROUP} is not the adapter {ep.name!r} ({ep.value})")
        if ep.name in out:
            raise ManifestError(f"two adapters are registered as {ep.name!r} in {ENTRY_POINT_GROUP}")
        out[ep.name] = found
    return out, broken


def adapters() -> dict[str, Adapter]:
    """Every adapter registered, by name (those whose package fails to import are left out;
    `converter_of` says why when one is asked for).

    Raises:
        ManifestError: an entry point that is not an `Adapter` of its name, or two of one name.
    """
    return _registry()[0]


def converter_of(name: str) -> Converter:
    """The reader of the tool `name`.

    Raises:
        ManifestError: no tool of that name reads checkpoints, or its reader cannot be imported
            (its framework dependency missing: the message says which extra to install).
    """
    found, broken = _registry()
    if name in broken:
        raise ManifestError(f"the {name} adapter cannot be loaded ({broken[name]}); install ckptkit[{name}]")
    readers = {n: a for n, a in found.items() if a.converter is not None}
    if name not in readers:
        raise ManifestError(f"no converter for {name!r}; available: {', '.join(readers) or 'none (install ckptkit)'}")
    load = readers[name].converter
    assert load is not None
    try:
        return load()
    except ImportError as exc:
        raise ManifestError(f"the {name} converter cannot be loaded ({exc}); install ckptkit[{name}]") from exc


def export_formats() -> dict[str, ExportFormat]:
    """Every export format the adapters write, by name, in the order they are registered.

    Raises:
        ManifestError: two adapters writing a format of one name.
    """
    out: dict[str, ExportFormat] = {}
    for adapter in adapters().values():
        for fmt in adapter.formats:
            if fmt.name in out:
                raise ManifestError(f"two adapters write the export format {fmt.name!r}")
            out[fmt.name] = fmt
    return out


def families() -> list[Family]:
    """Every model family the adapters declare."""
    return [f for a in adapters().values() for f in a.families]


def layout_family(name: str) -> Family | None:
    """The adapters' family whose built-in layout is named `name` (``ckptkit layout builtin
    <name>``), or None."""
    return next((f for f in families() if f.layout is not None and f.name == name), None)


def model_family(layout: str) -> Family | None:
    """The adapters' family that reads the canonical model of a checkpoint laid out by the
    layout named `layout`, or None (no adapter's).

    Raises:
        LayoutError: several adapters' families claiming it.
    """
    found = [f for f in families() if f.model is not None and f.names(layout)]
    if len(found) > 1:
        raise LayoutError(f"the layout {layout!r} is claimed by several adapters' families ({', '.join(f.name for f in found)})")
    return found[0] if found else None


__all__ = ["ENTRY_POINT_GROUP", "Adapter", "Family", "adapters", "converter_of", "export_formats", "families", "layout_family", "lazy",
           "model_family"]
