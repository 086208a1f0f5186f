"""Each tool is one adapter (reader, writer, view) found through the ``ckptkit.adapters`` entry points;
the core imports none, an adapter imports no other, and a new tool is one package."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import ckptkit
from ckptkit import adapters as registry
from ckptkit.adapters import Adapter, Family, adapters, model_family
from ckptkit.errors import LayoutError, ManifestError
from ckptkit.exports.formats import ExportFormat, ExportOptions
from ckptkit.layouts import Layout, builtin, families, reference_llama
from ckptkit.models import REFERENCE, model_of, modules_of, spec_from_config
from ckptkit.models.reference import reference_hf_config
from ckptkit.ops.convert import Converter, load_converter

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "adapters" / "ckptkit_adapters"
TOOLS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and p.name != "common")
LLAMA = {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def _imports(path: Path, absolute: bool = False) -> list[str]:
    """The modules `path` imports (`absolute`: refusing relative imports, which the walk cannot follow)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not (absolute and node.level), f"{path}: a relative import"
            out.append(node.module or "")
    return out


def test_the_core_never_imports_an_adapter() -> None:
    offenders = [f"{p.relative_to(REPO)}: {n}" for p in sorted((REPO / "ckptkit").rglob("*.py"))
                 for n in _imports(p) if n.split(".")[0] == "ckptkit_adapters"]
    assert offenders == []


def test_an_adapter_imports_ckptkit_common_and_itself_never_another_adapter() -> None:
    assert TOOLS == ["dcp", "deepspeed", "hf", "megatron", "peft", "torchtitan", "zarr"]
    offenders = []
    for tool in TOOLS:
        for path in sorted((PACKAGE / tool).rglob("*.py")):
            for name in _imports(path, absolute=True):
                parts = name.split(".")
                if parts[0] == "ckptkit_adapters" and (len(parts) < 2 or parts[1] not in (tool, "common")):
                    offenders.append(f"{path.relative_to(REPO)}: {name}")
    assert offenders == []
    common = [f"{p.name}: {n}" for p in (PACKAGE / "common").glob("*.py") for n in _imports(p, absolute=True)
              if n.split(".")[0] == "ckptkit_adapters" and n.split(".")[1] != "common"]
    assert common == []


def test_the_declared_adapters_are_the_installed_ones_each_with_its_pieces() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["ckptkit.adapters"]
    assert declared == {tool: f"ckptkit_adapters.{tool}:ADAPTER" for tool in TOOLS}
    found = adapters()
    assert sorted(found) == TOOLS
    assert {n for n, a in found.items() if a.converter is not None} == {"dcp", "deepspeed", "hf", "megatron", "peft", "torchtitan"}
    assert {n: [f.name for f in a.formats] for n, a in found.items()} == ({t: [t] for t in TOOLS}
                                                                         | {"hf": ["hf", "hf-trainer"]})
    assert sorted(ckptkit.EXPORT_FORMATS) == sorted([*TOOLS, "hf-trainer"])
    for name in ("dcp", "deepspeed", "hf", "megatron", "peft", "torchtitan"):
        converter = load_converter(name)
        assert isinstance(converter, Converter) and converter.name == name
    assert families() == ["gpt2", "hf", "hf-llama", "llama", "llama-moe", "megatron-gpt", "torchtitan-llama", "torchtitan-qwen3"]


def test_an_adapters_package_imports_neither_torch_nor_numpy() -> None:
    code = ("import sys, ckptkit.adapters as r; r.adapters(); import ckptkit; list(ckptkit.EXPORT_FORMATS); "
            "print(sorted(m for m in ('torch', 'numpy', 'safetensors', 'tensorstore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_layout_is_matched_to_the_family_of_its_tool() -> None:
    hf_family, megatron = model_family("hf-mixtral"), model_family("megatron-gpt")
    assert hf_family is not None and hf_family.name == "hf-" and megatron is not None and megatron.name == "megatron-gpt"
    assert model_family("gpt2") is not None and model_family("llama") is None and model_family("hfx") is None
    with pytest.raises(LayoutError, match=r"^the layout 'nobody' is no tool's view of a canonical model"):
        model_of(reference_llama(LLAMA).model_copy(update={"name": "nobody"}))


# A tool of its own, as a third party would add one: one package's ADAPTER, one entry point.
def _toy_layout(config: Mapping[str, Any]) -> Layout:
    return reference_llama(config).model_copy(update={"name": "toy"})


def _toy_model(layout: Layout, carried: Mapping[str, Any] | None) -> tuple[Any, Any]:
    return spec_from_config(reference_hf_config("llama", layout.config)), REFERENCE


def _toy_writer(source: Any, options: ExportOptions) -> tuple[Any, str | None]:
    raise LayoutError("the toy format writes nothing")


TOY = Adapter(name="toy", description="a tool of its own",
              formats=(ExportFormat("toy", "the toy format", _toy_writer, dtypes=()),),
              families=(Family("toy", layout=_toy_layout, model=_toy_model),))
NOT_AN_ADAPTER = object()


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[metadata.EntryPoint]]:
    """The installed adapters' entry points, and room to add some (the registry read afresh)."""
    installed = list(metadata.entry_points(group=registry.ENTRY_POINT_GROUP))
    extra: list[metadata.EntryPoint] = []
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [*installed, *extra])
    registry._registry.cache_clear()
    yield extra
    registry._registry.cache_clear()


def test_a_new_tool_is_one_adapter(registered: list[metadata.EntryPoint], tmp_path: Path) -> None:
    registered.append(metadata.EntryPoint("toy", "tests.test_adapters:TOY", registry.ENTRY_POINT_GROUP))
    assert "toy" in ckptkit.EXPORT_FORMATS and "toy" in families()
    layout = builtin("toy", LLAMA)
    assert layout.name == "toy" and layout.tensors() == reference_llama(LLAMA).tensors()
    spec, view = model_of(layout)
    assert view is REFERENCE and spec.config["hidden_size"] == 16
    assert modules_of(layout) is None  # it declares no module names: the fsdp2 form refuses it
    with pytest.raises(ManifestError, match=r"^no converter for 'toy'; available: dcp, deepspeed, hf, megatron, peft, torchtitan$"):
        load_converter("toy")


def test_an_entry_point_that_is_not_its_adapter_is_refused(registered: list[metadata.EntryPoint]) -> None:
    registered.append(metadata.EntryPoint("odd", "tests.test_adapters:NOT_AN_ADAPTER", registry.ENTRY_POINT_GROUP))
    with pytest.raises(ManifestError, match=r"^entry point 'odd' of ckptkit.adapters is not the adapter 'odd' "):
        adapters()


def test_two_adapters_claiming_one_layout_are_refused(registered: list[metadata.EntryPoint]) -> None:
    registered.append(metadata.EntryPoint("toy", "tests.test_adapters:CLAIMS_HF", registry.ENTRY_POINT_GROUP))
    with pytest.raises(LayoutError, match=r"^the layout 'hf-llama' is claimed by several adapters' families \(hf-, hf-llama\)$"):
        model_family("hf-llama")


CLAIMS_HF = Adapter(name="toy", description="claims a Hugging Face layout",
                    families=(Family("hf-llama", model=_toy_model),))


BROKEN_IMPORT = "ckptkit_adapters_that_is_not_installed.reader"


def test_an_adapter_that_does_not_import_is_named_with_its_error(registered: list[metadata.EntryPoint]) -> None:
    registered.append(metadata.EntryPoint("gone", f"{BROKEN_IMPORT}:ADAPTER", registry.ENTRY_POINT_GROUP))
    assert "gone" not in adapters()
    with pytest.raises(ManifestError, match=r"^the gone adapter cannot be loaded \(No module named 'ckptkit_adapters_that_is_not"):
        load_converter("gone")


# A writer that cannot write the model's tensors: an export through it must not pass for complete,
# and is refused from its plan, before it writes (WRITES counts its writes).
WRITES: list[str] = []


def _model_less_writer(source: Any, options: ExportOptions) -> tuple[Any, str | None]:
    from ckptkit.exports.source import Writer, Written

    def write(source: Any, storage: Any, tmp: str) -> Any:
        WRITES.append(tmp)
        storage.write(f"{tmp}/nothing.txt", [b"no tensors\n"])
        return Written([], [])

    return Writer(sorted(source.manifest.tensors), write), None


MODEL_LESS = Adapter(name="model-less", description="a writer that leaves the model out",
                     formats=(ExportFormat("model-less", "writes no tensor", _model_less_writer, dtypes=()),))


def test_an_export_leaving_out_a_kind_its_format_holds_fails_unless_allowed(registered: list[metadata.EntryPoint],
                                                                            tmp_path: Path) -> None:
    import torch

    registered.append(metadata.EntryPoint("model-less", "tests.test_adapters:MODEL_LESS", registry.ENTRY_POINT_GROUP))
    src = tmp_path / "ckpt"
    ckptkit.save({"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}, "optimizer": {"exp_avg": {"w": torch.ones(2, 3)}},
                  "rng": {"torch": torch.zeros(4, dtype=torch.uint8)}}, str(src), step=1)
    with pytest.raises(LayoutError) as refused:
        ckptkit.export(str(src), str(tmp_path / "out"), format="model-less")
    assert str(refused.value) == (f"{src}: the model-less export would leave out 2 tensor(s) of kinds it holds (param): "
                                  "model/b; model/w; pass --allow-skip to export without them")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "latest"]  # nothing beside
    assert WRITES == []  # refused before its writer ran
    report = ckptkit.export(str(src), str(tmp_path / "out"), format="model-less", allow_skip=True)
    assert len(WRITES) == 1
    assert report.left_out == ["model/b", "model/w"] and report.not_held == {"optimizer": 1, "rng": 1}
    assert sorted(e.name for e in report.skipped) == ["model/b", "model/w", "optimizer/exp_avg/w", "rng/torch"]
    # with the optimizer asked for, its state is held too
    with pytest.raises(LayoutError, match=r"leave out 3 tensor\(s\) of kinds it holds \(optimizer, param\)"):
        ckptkit.export(str(src), str(tmp_path / "out2"), format="model-less", include_optimizer=True)
