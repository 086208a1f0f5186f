"""A peft LoRA adapter folder (written at test time by peft itself on a tiny Llama) converts tensor
for tensor and exports back to a folder ``PeftModel.from_pretrained`` loads, with the logits of
the original adapter."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit

from .checks import assert_nothing_written, one_line_error

if importlib.util.find_spec("peft") is None:  # make test installs it
    if os.environ.get("CI"):
        raise RuntimeError("peft is not installed (make test installs it with the dev extras)")
    pytest.skip("peft is not installed", allow_module_level=True)


def _base() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=12)).eval()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter of q and v with non-zero factors, as peft saves it."""
    from peft import LoraConfig, get_peft_model

    out = tmp_path_factory.mktemp("peft") / "adapter"
    model = get_peft_model(_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(out)
    return out


def _logits(path: Path) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(_base(), str(path)).eval()
    with torch.no_grad():
        return model(torch.arange(12).reshape(2, 6)).logits  # type: ignore[no-any-return]


def test_the_adapter_converts_and_exports_back_as_peft_loads_it(adapter: Path, tmp_path: Path, run_ckptkit: Any) -> None:
    converted, out = tmp_path / "converted", tmp_path / "peft"
    proc = run_ckptkit("convert", str(adapter), str(converted))  # detected as peft
    assert proc.returncode == 0, proc.stderr
    assert "converting from peft" in proc.stderr
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    state = ckptkit.load(converted)["model"]
    assert sorted(state) == sorted(saved) and len(saved) == 2 * 2 * 2  # A and B of q and v in 2 layers
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert run_ckptkit("export", str(converted), str(out), "--format", "peft").returncode == 0
    back = load_file(str(out / "adapter_model.safetensors"))
    assert sorted(back) == sorted(saved) and all(torch.equal(back[k], v) for k, v in saved.items())
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads((adapter / "adapter_config.json").read_text())
    # peft itself loads it, and the model it makes computes what the original adapter's does
    base = _base()
    with torch.no_grad():
        plain = base(torch.arange(12).reshape(2, 6)).logits
    want, got = _logits(adapter), _logits(out)
    assert torch.equal(got, want) and not torch.equal(got, plain)  # the adapter changes the logits


def test_inspect_and_verify_read_the_folder_and_name_what_convert_would_skip(adapter: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptkit.cli import cli

    src = tmp_path / "adapter"
    shutil.copytree(adapter, src)
    (src / "notes.txt").write_text("not the adapter's")
    report = ckptkit.inspect(src)
    assert (report.read_through, [(e.name, e.reason) for e in report.skipped]) == ("peft", [("notes.txt", "not part of a peft adapter folder")])
    assert [t.name for t in report.tensor_list] == sorted(f"model/{k}" for k in load_file(src / "adapter_model.safetensors"))
    result = CliRunner().invoke(cli, ["verify", str(src)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == ("note: 1 entry `ckptkit convert` would refuse without --allow-skip "
                                              "(ckptkit inspect lists them)")
    with pytest.raises(ckptkit.ManifestError, match="notes.txt: not part of a peft adapter folder"):
        ckptkit.convert(src, tmp_path / "out")
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_checkpoint_not_converted_from_an_adapter_is_refused(tmp_path: Path, run_ckptkit: Any) -> None:
    src = Path(__file__).resolve().parents[2] / "fixtures" / "llama-v1.1" / "step_00000005"
    proc = run_ckptkit("export", str(src), str(tmp_path / "out"), "--format", "peft")
    assert proc.returncode == 1 and "a peft adapter folder is written from a checkpoint converted from one" in one_line_error(
        proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")
