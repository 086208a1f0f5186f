"""``ckptkit export --format megatron`` of the reference trainer's mixture of experts (layout
``llama-moe``): megatron-core loads the files into a GPTModel with its MoE layer (local spec,
``SequentialMLP`` experts) at the target TP and EP (on CPU, gloo ranks), every loaded tensor
equal to the trainer's, its logits those of the trainer's own forward; megatron-core saving
the loaded model again writes the same keys, chunks and values; with the optimizer, every fp32
master and Adam moment (each expert's of each layer) as megatron-core reads them equal to the
trainer's; bad targets fail in one line, writing nothing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptkit

from .converters.checks import assert_nothing_written, megatron_common, one_line_error
from .test_export_megatron import megatron_qkv
from .trainer.runs import trainer_logits

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    if os.environ.get("CI"):
        raise RuntimeError("megatron-core is not installed (make test installs it: pip install --no-deps -c constraints.txt megatron-core)")
    pytest.skip("megatron-core is not installed (make test installs it)", allow_module_level=True)

pytestmark = pytest.mark.multiprocess
IDS = torch.tensor([[1, 5, 7, 2, 19, 3, 0, 44, 97], [4, 4, 8, 11, 6, 2, 13, 60, 31]])
EXPERTS = "mlp.experts.local_experts"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-moe checkpoint of the reference trainer after 2 steps at DP 2 x EP 2."""
    from ckptkit.trainer.train import config_from, launch, prepare

    out = tmp_path_factory.mktemp("moe") / "run"
    cfg = config_from(model="tiny-moe", steps=2, save_every=2, out=str(out), dp=2, ep=2)
    launch(cfg, prepare(cfg))
    return out / "step_00000002"


def _expected(name: str, whole: dict[str, torch.Tensor], c: dict[str, Any], ranks: dict[str, int], ep: int) -> tuple[torch.Tensor, set[str]]:
    """What a megatron-core rank (TP rank, EP rank, expert-TP rank in `ranks`) holds as `name`,
    cut from the trainer's tensors by Megatron's rules written out here; and the trainer's
    tensors it comes from."""
    tp, r, etp = ranks["tp_size"], ranks["tp"], ranks["etp"]
    h, f, heads, groups = c["hidden_size"], c["intermediate_size"], c["num_heads"], c["num_kv_heads"]
    hd, per = h // heads, heads // groups

    def rows(t: torch.Tensor, rank: int) -> torch.Tensor:
        n = t.shape[0] // tp
        return t[rank * n : (rank + 1) * n]

    def cols(t: torch.Tensor, rank: int) -> torch.Tensor:
        n = t.shape[1] // tp
        return t[:, rank * n : (rank + 1) * n]

    top = {"embedding.word_embeddings.weight": ("embed.weight", rows), "output_layer.weight": ("lm_head.weight", rows),
           "decoder.final_layernorm.weight": ("norm.weight", None)}
    if name in top:
        src, cut = top[name]
        return (cut(whole[src], r) if cut else whole[src]), {src}
    _, _, i, rest = name.split(".", 3)
    p = f"layers.{i}."
    if rest.startswith(EXPERTS):
        local, linear = rest[len(EXPERTS) + 1 :].split(".", 1)
        e = ranks["ep"] * (c["num_experts"] // ep) + int(local)
        x = f"{p}mlp.experts.{e}."
        if linear == "linear_fc1.weight":
            return torch.cat([rows(whole[x + "gate.weight"], etp), rows(whole[x + "up.weight"], etp)]), {x + "gate.weight", x + "up.weight"}
        assert linear == "linear_fc2.weight", name
        return cols(whole[x + "down.weight"], etp), {x + "down.weight"}
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = (whole[p + f"attn.{n}.weight"] for n in "qkv")
        mine = range(r * groups // tp, (r + 1) * groups // tp)
        return torch.cat([t for g in mine for t in (q[g * per * hd : (g + 1) * per * hd], k[g * hd : (g + 1) * hd],
                                                      v[g * hd : (g + 1) * hd])]), {p + f"attn.{n}.weight" for n in "qkv"}
    if rest == "self_attention.linear_proj.weight":
        return cols(whole[p + "attn.o.weight"], r), {p + "attn.o.weight"}
    src = {"input_layernorm.weight": "attn_norm.weight", "pre_mlp_layernorm.weight": "mlp_norm.weight",
           "mlp.router.weight": "mlp.router.weight"}[rest]
    return whole[p + src], {p + src}


@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 2), (1, 2, 4)])
def test_megatron_core_loads_the_moe_export_with_the_trainers_tensors_and_logits(tp: int, pp: int, ep: int, trained: Path,
                                                                                 tmp_path: Path, run_ckptkit: Any) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from .megatron_moe_job import job
    from .ranks import run_ranks

    out, loaded = tmp_path / "megatron", tmp_path / "loaded"
    proc = run_ckptkit("export", str(trained), str(out), "--format", "megatron", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep))
    assert proc.returncode == 0, proc.stderr
    loaded.mkdir()
    save_file({"ids": IDS}, str(tmp_path / "ids.safetensors"))
    c = dict(ckptkit.read_manifest(str(trained)).info.model.config)  # type: ignore[union-attr]
    world = tp * ep  # megatron-core's data-parallel size is ep: the experts' EP ranks are carved out of it
    run_ranks(job, (world, tp, ep, str(out), str(tmp_path / "ids.safetensors"), str(loaded), 29900 + os.getpid() % 400 + tp * ep, c),
              world, seconds=400)

    logits = load_file(str(loaded / "logits.safetensors"))["logits"]
    want = trainer_logits(trained, IDS)
    assert logits.shape == want.shape and (logits - want).abs().max().item() < 1e-4
    whole = ckptkit.load(str(trained))["model"]
    covered: set[str] = set()
    for rank in range(world):
        with safe_open(str(loaded / f"rank{rank}.safetensors"), "pt") as f:
            ranks = {k: int(v) for k, v in f.metadata().items()} | {"tp_size": tp}
            assert f.keys() and any(EXPERTS in k for k in f.keys())
            for name in f.keys():
                value, sources = _expected(name, whole, c, ranks, ep)
                assert torch.equal(f.get_tensor(name), value), (rank, name)
                covered |= sources
    assert covered == set(whole)  # every parameter of the trainer's, at least once
    # megatron-core saving what it loaded writes the export's keys, chunks and values
    ours = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    theirs = FileSystemReader(str(loaded / "resaved")).read_metadata().state_dict_metadata
    assert sorted(ours) == sorted(theirs) and "decoder.layers.mlp.experts.experts.linear_fc1.weight" in ours
    for key, meta in theirs.items():
        if hasattr(meta, "chunks"):
            assert ours[key].size == meta.size, key
            assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in ours[key].chunks) == \
                sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks), key
    plain, resaved = load_file(str(loaded / "plain.safetensors")), load_file(str(loaded / "resaved-plain.safetensors"))
    assert sorted(plain) == sorted(resaved) and all(torch.equal(plain[k], resaved[k]) for k in plain)
    fc1 = plain["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.shape == (2, 8, 128, 64)
    assert torch.equal(fc1[1, 6], torch.cat([whole["layers.1.mlp.experts.6.gate.weight"], whole["layers.1.mlp.experts.6.up.weight"]]))
    assert torch.equal(plain["decoder.layers.mlp.router.weight"][0], whole["layers.0.mlp.router.weight"])


def test_targets_the_moe_export_cannot_take_fail_in_one_line(trained: Path, tmp_path: Path, run_ckptkit: Any) -> None:
    llama = Path(__file__).resolve().parents[1] / "fixtures" / "llama-v1.1"
    cases = [
        ((str(trained), "--ep", "3"), "8 experts are not divisible by ep 3"),
        ((str(trained), "--tp", "8"), "4 query groups"),  # 4 key/value heads cannot be cut 8 ways
        ((str(llama), "--ep", "2"), "the megatron-gpt layout has no experts (ep must be 1)"),
    ]
    for args, says in cases:
        proc = run_ckptkit("export", args[0], str(tmp_path / "out"), "--format", "megatron", *args[1:])
        assert proc.returncode == 1 and says in one_line_error(proc.stderr), (args, proc.stderr)
        assert_nothing_written(tmp_path, tmp_path / "out")
    proc = run_ckptkit("export", str(trained), str(tmp_path / "out"), "--format", "hf", "--ep", "2")
    assert proc.returncode == 2 and "--tp/--pp/--ep" in proc.stderr


def _as_megatron_moe(state: dict[str, torch.Tensor], c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The mixture of experts' tensors of one state (parameters or a moment) under Megatron's keys,
    written out here: layers stacked, q, k, v interleaved per query group, the router stacked by
    layer, each expert's [gate; up] and down stacked on the (layer, expert) axes."""
    n = c["num_experts"]
    out = {"embedding.word_embeddings.weight": state["embed.weight"], "decoder.final_layernorm.weight": state["norm.weight"]}
    if not c["tie_embeddings"]:
        out["output_layer.weight"] = state["lm_head.weight"]
    layers: dict[str, list[torch.Tensor]] = {}
    for i in range(c["num_layers"]):
        p = f"layers.{i}."
        qkv = megatron_qkv(state, p, c)
        x = [f"{p}mlp.experts.{e}." for e in range(n)]
        for key, value in (("self_attention.linear_qkv.layer_norm_weight", state[p + "attn_norm.weight"]),
                           ("self_attention.linear_qkv.weight", qkv), ("self_attention.linear_proj.weight", state[p + "attn.o.weight"]),
                           ("mlp.linear_fc1.layer_norm_weight", state[p + "mlp_norm.weight"]),
                           ("mlp.router.weight", state[p + "mlp.router.weight"]),
                           ("mlp.experts.experts.linear_fc1.weight",
                            torch.stack([torch.cat([state[e + "gate.weight"], state[e + "up.weight"]]) for e in x])),
                           ("mlp.experts.experts.linear_fc2.weight", torch.stack([state[e + "down.weight"] for e in x]))):
            layers.setdefault(f"decoder.layers.{key}", []).append(value)
    return out | {key: torch.stack(values) for key, values in layers.items()}


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (1, 4)])
def test_the_moes_optimizer_state_comes_stacked_as_its_parameters_for_every_expert(tp: int, ep: int, trained: Path, tmp_path: Path,
                                                                                  run_ckptkit: Any) -> None:
    # fp32 masters and both Adam moments as megatron-core's load_plain_tensors reads them (on
    # every rank): each expert's of each layer equal to the trainer's (where DeepSpeed is known
    # to keep stale expert moments), the router's too
    from .megatron_moe_job import plain_job
    from .ranks import run_ranks

    out, loaded = tmp_path / "megatron", tmp_path / "loaded"
    proc = run_ckptkit("export", str(trained), str(out), "--format", "megatron", "--include-optimizer", "--tp", str(tp), "--ep", str(ep))
    assert proc.returncode == 0, proc.stderr
    loaded.mkdir()
    run_ranks(plain_job, (2, str(out), str(loaded), 29500 + os.getpid() % 400 + tp * ep), 2, seconds=400)
    plain = load_file(str(loaded / "plain.safetensors"))
    c = dict(ckptkit.read_manifest(str(trained)).info.model.config)  # type: ignore[union-attr]
    source = ckptkit.load(str(trained))
    states = {"param": source["model"], "exp_avg": source["optimizer"]["exp_avg"], "exp_avg_sq": source["optimizer"]["exp_avg_sq"]}
    want = {f"optimizer.state.{name}.{key}": value for name, state in states.items()
            for key, value in _as_megatron_moe(state, c).items()} | _as_megatron_moe(source["model"], c)
    assert sorted(plain) == sorted(want)
    for key, value in want.items():
        assert plain[key].dtype == torch.float32 and torch.equal(plain[key], value), key
    moving = 0
    for name, state in states.items():
        fc1, fc2 = (plain[f"optimizer.state.{name}.decoder.layers.mlp.experts.experts.linear_fc{j}.weight"] for j in (1, 2))
        router = plain[f"optimizer.state.{name}.decoder.layers.mlp.router.weight"]
        for i in range(c["num_layers"]):
            assert torch.equal(router[i], state[f"layers.{i}.mlp.router.weight"]), (name, i)
            for e in range(c["num_experts"]):
                x = f"layers.{i}.mlp.experts.{e}."
                assert torch.equal(fc1[i, e], torch.cat([state[x + "gate.weight"], state[x + "up.weight"]])), (name, i, e)
                assert torch.equal(fc2[i, e], state[x + "down.weight"]), (name, i, e)
                moving += name != "param" and bool(fc2[i, e].abs().sum() > 0)
    assert moving == 2 * c["num_layers"] * c["num_experts"]  # every expert was trained: no moment is trivially zero
    common = megatron_common(out / "common.pt")["optimizer"]
    assert sorted(common) == [0, 1] and all(o["param_state_sharding_type"] == "fully_reshardable" for o in common.values())
    assert [(g["wd_mult"], g["is_expert_parallel"]) for o in common.values() for g in o["optimizer"]["param_groups"]] == \
        [(1.0, False), (0.0, False), (1.0, True)]


def test_the_moe_in_megatron_files_converts_back_to_every_trainer_tensor(trained: Path, tmp_path: Path, run_ckptkit: Any) -> None:
    # tiny-moe -> export --format megatron (with the optimizer) -> convert --from megatron: every
    # parameter, master and moment, each expert's, equal to the trainer's under Megatron's names;
    # the layout read back from the Megatron-LM arguments the export writes, none named
    from ckptkit.layouts import layout_for
    from ckptkit_adapters.megatron.reader import expert_key, layer_key

    out, back = tmp_path / "megatron", tmp_path / "back"
    proc = run_ckptkit("export", str(trained), str(out), "--format", "megatron", "--include-optimizer", "--tp", "2", "--ep", "2")
    assert proc.returncode == 0, proc.stderr
    proc = run_ckptkit("convert", "--from", "megatron", str(out), str(back))
    assert proc.returncode == 0, proc.stderr
    c = dict(ckptkit.read_manifest(str(trained)).info.model.config)  # type: ignore[union-attr]
    source, got = ckptkit.load(str(trained)), ckptkit.load(str(back))
    states = {"model": (source["model"], got["model"]), "fp32": (source["model"], got["optimizer"]["fp32"]),
              "exp_avg": (source["optimizer"]["exp_avg"], got["optimizer"]["exp_avg"]),
              "exp_avg_sq": (source["optimizer"]["exp_avg_sq"], got["optimizer"]["exp_avg_sq"])}
    experts = 0
    for name, (state, converted) in states.items():
        want: dict[str, torch.Tensor] = {}
        for key, value in _as_megatron_moe(state, c).items():
            if key.startswith("decoder.layers.mlp.experts.experts."):
                want |= {expert_key(key, i, e): value[i, e] for i in range(value.shape[0]) for e in range(value.shape[1])}
            elif key.startswith("decoder.layers."):
                want |= {layer_key(key, i): value[i] for i in range(value.shape[0])}
            else:
                want[key] = value
        tensors = {k: v for k, v in converted.items() if isinstance(v, torch.Tensor)}
        assert sorted(tensors) == sorted(want), name
        for key, value in want.items():
            assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], value), (name, key)
            experts += ".local_experts." in key
    assert experts == 4 * 2 * 8 * 2  # states x layers x experts x (linear_fc1, linear_fc2)
    manifest = ckptkit.read_manifest(str(back))
    assert manifest.step == 2 and layout_for(manifest).experts == 8
    assert [g.options["is_expert_parallel"] for g in manifest.info.optimizer.param_groups] == [False, False, True]  # type: ignore[union-attr]
