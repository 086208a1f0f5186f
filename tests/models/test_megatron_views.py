"""Hugging Face models into Megatron-Core and back, through the canonical model: every architecture
megatron-core's GPTModel holds (Llama, tied or not, Mistral, Qwen2's q, k, v biases, Qwen3's q/k
norms, Phi-3's fused tensors, Mixtral, Qwen3-MoE), made by transformers (tiny, non-square, an
odd vocabulary), each converted, resharded to tp 2 x pp 2 (a tied head pp 1; experts x ep 2),
exported to Megatron-Core at that
topology, loaded by megatron-core at tp 2 with logits equal to transformers' (<= 1e-4), then
converted back with no layout named (the Megatron-LM arguments the export writes say it) and
exported to Hugging Face: every tensor the original saved, bitwise. Architectures megatron-core
has no module for, or whose Megatron names are not written yet, are refused, naming what they
need. And a Megatron-Core GPT goes out to Hugging Face or DCP and comes back bitwise."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.errors import LayoutError
from ckptkit.layouts import parse_layout
from ckptkit.manifest import Topology
from ckptkit.models import spec_from_config
from ckptkit_adapters.megatron.view import megatron_config

from ..converters.checks import assert_nothing_written, megatron_common, one_line_error
from .test_hf_architectures import _saved

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


HELD = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"]
IDS = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Path, torch.Tensor]]:
    """Each held architecture saved by transformers (fp32), converted, resharded to tp 2 x pp 2 (a
    tied head pp 1; experts x ep 2), exported to Megatron-Core at that topology and loaded by one
    megatron-core job at tp 2: (source, model, export, megatron-core's logits)."""
    from ..ranks import run_ranks
    from .megatron_gpt_job import job

    root = tmp_path_factory.mktemp("megatron-views")
    save_file({"ids": IDS}, str(root / "ids.safetensors"))
    out: dict[str, tuple[Path, Any, Path]] = {}
    loads = []
    for name in HELD:
        src, model = _saved(name, torch.float32, root)
        converted, resharded, megatron = (root / f"{name}-{n}" for n in ("converted", "resharded", "megatron"))
        ep, pp = 2 if "moe" in name or name == "mixtral" else 1, 1 if "tied" in name else 2
        ckptkit.convert(src, converted)
        ckptkit.reshard(converted, resharded, Topology(world_size=2 * pp * ep, tp=2, pp=pp, dp=ep, ep=ep, zero_stage=0),
                        update_latest=False)
        ckptkit.export(resharded, megatron, format="megatron", tp=2, pp=pp, ep=ep)
        config = megatron_config(spec_from_config(json.loads((src / "config.json").read_text())), 2)
        loads.append((str(megatron), config, str(root / f"{name}-logits.safetensors")))
        out[name] = (src, model, megatron)
    run_ranks(job, (2, loads, str(root / "ids.safetensors"), 29300 + os.getpid() % 500), 2)
    return {name: (*v, load_file(str(root / f"{name}-logits.safetensors"))["logits"]) for name, v in out.items()}


def test_megatron_core_runs_each_hugging_face_model_with_transformers_logits(exported: dict[str, Any]) -> None:
    for name, (_, model, out, logits) in exported.items():
        args = vars(megatron_common(out / "common.pt")["args"])  # what a Megatron-LM job resumes with
        assert args["padded_vocab_size"] == 102 and args["vocab_size"] == 101, name
        assert args.get("add_qkv_bias", False) == (name == "qwen2") and args.get("qk_layernorm", False) == name.startswith("qwen3")
        assert args.get("num_experts") == (4 if name in ("mixtral", "qwen3_moe") else None), name
        with torch.no_grad():
            want = model(IDS).logits
        assert logits.shape == (2, 9, 102), name  # the padded vocabulary: its row of zeros gives logits of 0
        assert (logits[..., :101] - want).abs().max().item() <= 1e-4 and torch.all(logits[..., 101:] == 0), name


def test_a_hugging_face_model_runs_in_megatron_core_and_comes_back_bitwise(exported: dict[str, Any], tmp_path: Path,
                                                                           run_ckptkit: Any) -> None:
    for i, (name, (src, model, out, _)) in enumerate(exported.items()):
        back, hf = tmp_path / f"{name}-back", tmp_path / f"{name}-hf"
        if i == 0:  # the command, as a user runs it: no layout named (the Megatron-LM arguments say it)
            proc = run_ckptkit("convert", "--from", "megatron", str(out), str(back))
            assert proc.returncode == 0, proc.stderr
        else:
            ckptkit.convert(out, back, source_format="megatron")
        ckptkit.export(back, hf, format="hf", dtype="fp32")
        got, original = _tensors(hf), _tensors(src)
        if name == "phi3":  # it comes back a Llama (Megatron's arguments say no more): Phi-3's fused tensors cut apart
            assert json.loads((hf / "config.json").read_text())["model_type"] == "llama"
            original = _unfused_phi3(original, model.config)
        assert sorted(got) == sorted(original), name
        assert [k for k, v in original.items() if got[k].dtype != v.dtype or not torch.equal(got[k], v)] == [], name


def _unfused_phi3(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Phi-3's ``qkv_proj`` and ``gate_up_proj`` as a Llama's q, k, v and gate, up."""
    hd = config.hidden_size // config.num_attention_heads
    q, kv, f = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    out = {}
    for key, value in tensors.items():
        if key.endswith("self_attn.qkv_proj.weight"):
            p = key.removesuffix("qkv_proj.weight")
            out |= {f"{p}q_proj.weight": value[:q], f"{p}k_proj.weight": value[q:q + kv], f"{p}v_proj.weight": value[q + kv:]}
        elif key.endswith("mlp.gate_up_proj.weight"):
            p = key.removesuffix("gate_up_proj.weight")
            out |= {f"{p}gate_proj.weight": value[:f], f"{p}up_proj.weight": value[f:]}
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(("name", "says"), [
    ("gemma", "megatron-core's GPTModel has no module for a model of type gemma: it needs embeddings scaled by sqrt(hidden)"),
    ("gpt_neox", "megatron-core's GPTModel has no module for a model of type gpt_neox: it needs attention and MLP in parallel"),
    ("qwen2_moe", "the Megatron-Core view of a model of type qwen2_moe is not written yet: its gated shared expert"),
    ("deepseek_v3", "the Megatron-Core view of a model of type deepseek_v3 is not written yet: multi-head latent attention"),
])
def test_an_architecture_megatron_core_has_no_module_for_is_refused_in_one_line(name: str, says: str, tmp_path: Path,
                                                                                  run_ckptkit: Any) -> None:
    src, _ = _saved(name, torch.float32, tmp_path)
    ckptkit.convert(src, tmp_path / "converted")
    if name == "gemma":  # the command: one line, exit 1, nothing written
        proc = run_ckptkit("export", str(tmp_path / "converted"), str(tmp_path / "out"), "--format", "megatron")
        assert proc.returncode == 1 and says in one_line_error(proc.stderr), proc.stderr
    else:
        with pytest.raises(LayoutError, match=re.escape(says)):
            ckptkit.export(tmp_path / "converted", tmp_path / "out", format="megatron")
    assert_nothing_written(tmp_path, tmp_path / "out")


MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"


@pytest.mark.parametrize("via", ["hf", "dcp"])
def test_a_megatron_core_gpt_goes_out_and_comes_back_bitwise(via: str, tmp_path: Path, run_ckptkit: Any) -> None:
    # megatron-core's own save -> convert -> export to Hugging Face (or DCP) -> convert -> export
    # to Megatron-Core: megatron-core's load_plain_tensors reads every model tensor of its save
    from ckptkit.layouts import builtin

    from ..megatron_moe_job import plain_job
    from ..ranks import run_ranks

    oracle = MEGATRON / "gpt-tp2-dp2.oracle"
    config = json.loads((oracle / "config.json").read_text())
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
    layout = tmp_path / "layout.json"  # megatron-core's save (no Megatron-LM arguments) does not say its model
    layout.write_text(json.dumps(builtin("megatron-gpt", {k: config[k] for k in keys}).to_json()))
    converted, out, back, megatron = (tmp_path / n for n in ("converted", "out", "back", "megatron"))
    ckptkit.convert(MEGATRON / "gpt-tp2-dp2", converted, layout=parse_layout(json.loads(layout.read_text())))
    if via == "hf":
        ckptkit.export(converted, out, format="hf", dtype="fp32")
        ckptkit.convert(out, back)  # a Hugging Face directory says its model
    else:
        ckptkit.export(converted, out, format="dcp", dcp_form="plain")
        proc = run_ckptkit("convert", "--from", "dcp", str(out), str(back), "--layout", str(layout))  # DCP's files do not
        assert proc.returncode == 0, proc.stderr
    ckptkit.export(back, megatron, format="megatron", tp=2)
    read = tmp_path / "read"
    read.mkdir()
    run_ranks(plain_job, (1, str(megatron), str(read), 29900 + os.getpid() % 90), 1)
    got = load_file(str(read / "plain.safetensors"))
    want = {k: v for k, v in load_file(str(oracle / "plain.safetensors")).items() if not k.startswith("optimizer.")}
    assert sorted(got) == sorted(want)
    assert [k for k, v in want.items() if got[k].dtype != v.dtype or not torch.equal(got[k], v)] == []


def test_a_megatron_core_mixture_of_experts_exports_to_hugging_face_with_megatron_cores_logits(tmp_path: Path) -> None:
    # megatron-core's own MoE save (bf16, EP 2, SequentialMLP experts) -> convert -> export hf: the
    # Mixtral transformers builds from it gives megatron-core's logits on that save (both in fp32)
    from ckptkit.layouts import builtin
    from ckptkit.models import model_of

    from ..ranks import run_ranks
    from .megatron_gpt_job import job

    fixtures = MEGATRON.parent / "megatron-moe"
    config = json.loads((fixtures / "gpt-moe-tp1-ep2.oracle" / "config.json").read_text())
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
            "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk")
    layout = builtin("megatron-gpt", {k: config[k] for k in keys})
    ckptkit.convert(fixtures / "gpt-moe-tp1-ep2", tmp_path / "converted", layout=layout)
    ckptkit.export(tmp_path / "converted", tmp_path / "hf", format="hf", dtype="fp32")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 4 and model.config.intermediate_size == 8
    ids = IDS % 40
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    full = megatron_config(model_of(layout)[0], 1)
    run_ranks(job, (1, [(str(fixtures / "gpt-moe-tp1-ep2"), full, str(tmp_path / "logits.safetensors"))],
                    str(tmp_path / "ids.safetensors"), 29800 + os.getpid() % 90), 1)
    theirs = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    with torch.no_grad():
        ours = model(ids).logits
    assert theirs.shape == ours.shape and ours.std().item() > 0.01 and (theirs - ours).abs().max().item() <= 1e-4
