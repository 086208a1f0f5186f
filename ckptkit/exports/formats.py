"""The export formats (pure): each one's name, the options it takes and how its writer is built.

``EXPORT_FORMATS`` is the one table that ``export`` and the ``ckptkit export`` command both read:
the names and help the command offers, and `ExportFormat.options_problem`, which says which asked
option a format does not take (``export`` raises it as a LayoutError, the command prints it as bad
usage). Its entries come from the tools' adapters (``ckptkit.adapters``: each adapter declares
the formats it writes, each format's writer imported from the adapter only when an export runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal


if TYPE_CHECKING:  # the command reads this table: importing it loads neither layouts nor numpy
    from ..layouts import Layout
    from .source import Source, Writer

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> the dtype written
CHUNK_BYTES = 64 << 20  # the zarr form's chunk size by default


@dataclass(frozen=True)
class ExportOptions:
    """The checked options one export's writer is built from."""

    dtype: str | None  # the dtype written ("bfloat16"); None: each tensor's saved dtype
    include_optimizer: bool
    layout: Layout | None  # the model's layout, when given instead of the one the checkpoint records
    tp: int
    pp: int
    ep: int
    form: str | None  # the form asked for; None: the format's default for the checkpoint
    max_shard_bytes: int
    chunk_bytes: int
    dp: int | None = None  # the data-parallel size of per-rank files (deepspeed's ZeRO-3 form); None: not asked


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its name, the command's one-line help, the options it takes, its writer."""

    name: str
    help: str
    # The writer (planned: every refusal comes before anything is written) and the form it writes.
    build: Callable[[Source, ExportOptions], tuple[Writer, str | None]]
    dtypes: tuple[str, ...] = tuple(DTYPES)  # the --dtype values it converts to; (): none (saved_dtype says why)
    default_dtype: str | None = None  # the --dtype written when none is asked; None: the saved dtypes
    saved_dtype: str = ""
    optimizer: Literal["optional", "always", "never"] = "optional"  # its optimizer state: with --include-optimizer, always, never
    layout: bool = False  # takes --layout (the model's names)
    pieces: bool = False  # takes --tp, --pp, --ep (the parallel pieces its files hold)
    forms: tuple[str, ...] = ()  # its forms (--dcp-form); (): one form
    dp: bool = False  # takes --dp (writes per-rank files at that data-parallel size)
    # The tensor kinds it holds besides the optimizer state (``optimizer``; ``*``: every kind): an
    # export that leaves out a tensor of a kind it holds fails unless allowed; the others are
    # listed as kinds the format does not hold.
    holds: tuple[str, ...] = ("param", "buffer")
    form_holds: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (form, kinds) where a form holds other kinds

    def held(self, form: str | None, include_optimizer: bool) -> frozenset[str]:
        """The tensor kinds an export in `form` holds (the optimizer's when it is written)."""
        from ..manifest.model import KINDS

        kinds = dict(self.form_holds).get(form or "", self.holds)
        written = self.optimizer == "always" or (self.optimizer == "optional" and include_optimizer)
        out = frozenset(KINDS if "*" in kinds else kinds) - {"optimizer"}
        return out | ({"optimizer"} if written else frozenset())

    def options_problem(
        self, *, dtype: str | None = None, include_optimizer: bool = False, layout: bool = False, tp: int = 1, pp: int = 1,
        ep: int = 1, dcp_form: str | None = None, dp: int | None = None,
    ) -> str | None:
        """Say which of the asked options this format does not take, each named by its flag, in one line.

        Args:
            dtype: the --dtype asked (``bf16``), or None.
            include_optimizer: whether the optimizer state is asked for.
            layout: whether a layout is given.
            tp, pp, ep: the parallel sizes asked (1: none).
            dcp_form: the form asked, or None.
            dp: the data-parallel size asked for per-rank files, or None.

        Returns:
            The problems joined in one message, or None when the format takes every option asked.
        """
        problems = []
        if dtype is not None and not self.dtypes:
            problems.append(f"--dtype: {self.saved_dtype}")
        elif dtype is not None and dtype not in self.dtypes:
            problems.append(f"--dtype: {dtype!r} is not one of {', '.join(self.dtypes)}")
        if include_optimizer and self.optimizer == "never":
            problems.append(f"--include-optimizer: the {self.name} format holds model weights only "
                            f"(use --format {_listed(lambda f: f.optimizer != 'never', 'or')})")
        if layout and not self.layout:
            problems.append(f"--layout: names the model for --format {_listed(lambda f: f.layout)} "
                            f"({_listed(lambda f: not f.layout)} keep the checkpoint's names)")
        if (tp, pp, ep) != (1, 1, 1) and not self.pieces:
            problems.append(f"--tp/--pp/--ep: set the pieces of --format {_listed(lambda f: f.pieces)} "
                            "(the other formats hold whole tensors)")
        if dcp_form is not None and not self.forms:
            problems.append(f"--dcp-form: chooses the form of --format {_listed(lambda f: bool(f.forms))} "
                            "(the other formats have one form)")
        elif dcp_form is not None and dcp_form not in self.forms:
            problems.append(f"--dcp-form: {dcp_form!r} is not a form of --format {self.name} (its forms are {', '.join(self.forms)})")
        if dp is not None and not self.dp:
            problems.append(f"--dp: sets the data-parallel size of --format {_listed(lambda f: f.dp)}'s per-rank files "
                            "(the other formats are loaded at any size)")
        elif dp is not None and dp < 1:
            problems.append(f"--dp: {dp} is not a data-parallel size (1 or more)")
        return "; ".join(problems) or None  # each problem names its flag first, and holds no "; " itself

    def out_dtype(self, dtype: str | None) -> str | None:
        """The dtype this format writes for the --dtype asked (checked); None: each tensor's saved one."""
        wanted = dtype or self.default_dtype
        return DTYPES[wanted] if wanted else None


def _listed(takes: Callable[[ExportFormat], bool], last: str = "and") -> str:
    """The names of the formats that `takes`, as a sentence lists them ("hf and megatron")."""
    names = [f.name for f in EXPORT_FORMATS.values() if takes(f)]
    return f" {last} ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


class _Formats(Mapping[str, ExportFormat]):
    """The adapters' export formats by name, read from them on first use."""

    def _table(self) -> dict[str, ExportFormat]:
        from ..adapters import export_formats

        return export_formats()

    def __getitem__(self, name: str) -> ExportFormat:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


EXPORT_FORMATS: Mapping[str, ExportFormat] = _Formats()
