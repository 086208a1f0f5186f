"""``ckptkit export --format megatron``: a converted Megatron-Core checkpoint written back as a
``torch_dist`` directory that megatron-core itself loads (on CPU, gloo ranks): into a GPTModel at
TP 1 and TP 2 with logits equal to Megatron's own forward, and every model and optimizer tensor,
as megatron-core's ``load_plain_tensors`` reads them, bitwise equal to the source; the files cut
as megatron-core at the target TP cuts them; bad targets fail in one line, writing nothing."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.layouts import builtin

from .converters.checks import assert_nothing_written, megatron_common, one_line_error

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    # make test installs it; under CI (CI set) its absence fails the run instead of skipping it
    if os.environ.get("CI"):
        raise RuntimeError("megatron-core is not installed (make test installs it: pip install --no-deps -c constraints.txt megatron-core)")
    pytest.skip("megatron-core is not installed (make test installs it)", allow_module_level=True)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
LLAMA = FIXTURES.parent / "llama-v1.1"
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
pytestmark = pytest.mark.multiprocess


def _layout_file(tmp_path: Path) -> Path:
    config = json.loads((FIXTURES / "gpt-tp2-dp2.oracle" / "config.json").read_text())
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(builtin("megatron-gpt", {k: config[k] for k in MODEL_KEYS}).to_json()))
    return path


def _convert_and_export(name: str, tmp_path: Path, run_ckptkit: Any, *args: str) -> Path:
    layout = _layout_file(tmp_path)
    converted, out = tmp_path / "converted", tmp_path / "megatron"
    proc = run_ckptkit("convert", str(FIXTURES / name), str(converted), "--layout", str(layout))
    assert proc.returncode == 0, proc.stderr
    proc = run_ckptkit("export", str(converted), str(out), "--format", "megatron", "--include-optimizer", *args)
    assert proc.returncode == 0, proc.stderr
    return out


def _load_in_megatron(path: Path, tp: int, dtype: str, tmp_path: Path, ids: Path,
                      config: dict[str, int] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Load `path` with megatron-core at TP `tp` (that many gloo ranks); its logits and plain tensors."""
    from .megatron_job import job
    from .ranks import run_ranks

    out = tmp_path / f"loaded-tp{tp}"
    out.mkdir()
    port = 29400 + os.getpid() % 500 + tp
    run_ranks(job, (tp, str(path), str(ids), str(out), port, dtype, config), tp)
    return load_file(str(out / "logits.safetensors"))["logits"], load_file(str(out / "plain.safetensors"))


@pytest.mark.parametrize(("export_at", "load_at"), [(("--tp", "2"), 1), (("--tp", "1", "--pp", "2"), 2)])
def test_megatron_core_loads_the_export_with_equal_tensors_and_logits(export_at: tuple[str, ...], load_at: int, tmp_path: Path,
                                                                      run_ckptkit: Any) -> None:
    out = _convert_and_export("gpt-tp2-dp2", tmp_path, run_ckptkit, *export_at)
    oracle = FIXTURES / "gpt-tp2-dp2.oracle"
    logits, plain = _load_in_megatron(out, load_at, "float32", tmp_path, oracle / "logits.safetensors")
    assert (logits - load_file(str(oracle / "logits.safetensors"))["logits"]).abs().max().item() < 1e-4
    want = load_file(str(oracle / "plain.safetensors"))
    assert sorted(plain) == sorted(want) and any(k.startswith("optimizer.state.exp_avg.") for k in want)
    for key, value in want.items():
        assert plain[key].dtype == value.dtype and torch.equal(plain[key], value), key
    common = megatron_common(out / "common.pt")
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert [g["wd_mult"] for g in common["optimizer"]["optimizer"]["param_groups"]] == [1.0, 0.0]
    assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


def test_a_save_resharded_first_comes_back_with_every_tensor_megatron_core_saved(tmp_path: Path, run_ckptkit: Any) -> None:
    # in at tp 2 x dp 2, resharded to tp 1 x dp 4 (ZeRO 1: the moments cut over DP), out at tp 2:
    # megatron-core loads every parameter and optimizer state bitwise as it saved them
    layout = _layout_file(tmp_path)
    converted, resharded, out = tmp_path / "converted", tmp_path / "tp1-dp4", tmp_path / "megatron"
    assert run_ckptkit("convert", str(FIXTURES / "gpt-tp2-dp2"), str(converted), "--layout", str(layout)).returncode == 0
    proc = run_ckptkit("reshard", str(converted), str(resharded), "--tp", "1", "--dp", "4", "--zero", "1")
    assert proc.returncode == 0, proc.stderr
    assert ckptkit.read_manifest(resharded).topology.dp == 4
    proc = run_ckptkit("export", str(resharded), str(out), "--format", "megatron", "--include-optimizer", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    oracle = FIXTURES / "gpt-tp2-dp2.oracle"
    logits, plain = _load_in_megatron(out, 2, "float32", tmp_path, oracle / "logits.safetensors")
    assert (logits - load_file(str(oracle / "logits.safetensors"))["logits"]).abs().max().item() < 1e-4
    want = load_file(str(oracle / "plain.safetensors"))
    assert sorted(plain) == sorted(want)
    assert [k for k, v in want.items() if not (plain[k].dtype == v.dtype and torch.equal(plain[k], v))] == []


@pytest.mark.parametrize(("name", "dtype", "saved_as"), [
    ("gpt-tp2-dp2", "float32", ("fully_reshardable", None)),
    ("gpt-tp2-dp2-dpr-bf16", "bfloat16", ("dp_reshardable", 700)),  # Megatron-LM's default form, in buckets of 700
])
def test_megatron_core_resumes_a_resharded_export_with_the_originals_next_step(name: str, dtype: str, saved_as: tuple[str, int | None],
                                                                               tmp_path: Path, run_ckptkit: Any) -> None:
    # in at tp 2 x dp 2, resharded to tp 1 x dp 3 (ZeRO 1), out at tp 2: megatron-core's distributed
    # optimizer resumes from the export with the same step, learning rate and losses as from the original
    from .megatron_resume_job import job
    from .ranks import run_ranks

    layout = _layout_file(tmp_path)
    converted, resharded, out = tmp_path / "converted", tmp_path / "tp1-dp3", tmp_path / "megatron"
    assert run_ckptkit("convert", str(FIXTURES / name), str(converted), "--layout", str(layout)).returncode == 0
    assert run_ckptkit("reshard", str(converted), str(resharded), "--tp", "1", "--dp", "3", "--zero", "1").returncode == 0
    proc = run_ckptkit("export", str(resharded), str(out), "--format", "megatron", "--include-optimizer", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    config = {k: v for k, v in json.loads((FIXTURES / f"{name}.oracle" / "config.json").read_text()).items()
              if k in (*MODEL_KEYS, "max_sequence_length")}
    original = str(FIXTURES / name)
    runs = [(original, *saved_as), (str(out), "fully_reshardable", None)]
    run_ranks(job, (2, runs, str(tmp_path), 29900 + os.getpid() % 90, config, dtype), 2)
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed[original]["steps"] == [4.0] and set(resumed[original]["lrs"]) == {0.01}  # the saved step 3 and lr
    assert resumed[original]["loaded_eval_loss"] != resumed[original]["fresh_eval_loss"]  # the weights came from the file
    assert resumed[str(out)] == resumed[original]  # losses of the next step and after it, exactly


def test_a_dp_reshardable_save_comes_back_as_megatron_core_reads_it(tmp_path: Path, run_ckptkit: Any) -> None:
    # Megatron-LM's default optimizer form in, the reshardable form out: every state as megatron-core's own
    out = _convert_and_export("gpt-tp2-dp2-dpr-bf16", tmp_path, run_ckptkit, "--tp", "2")
    oracle = FIXTURES / "gpt-tp2-dp2-dpr-bf16.oracle"
    _, plain = _load_in_megatron(out, 2, "bfloat16", tmp_path, oracle / "logits.safetensors")
    want = load_file(str(oracle / "plain.safetensors"))
    assert sorted(plain) == sorted(want)
    for key, value in want.items():
        assert plain[key].dtype == value.dtype and torch.equal(plain[key], value), key


def test_the_files_are_cut_as_megatron_core_cuts_them_at_the_target_tp(tmp_path: Path, run_ckptkit: Any) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    out = _convert_and_export("gpt-tp2-dp2", tmp_path, run_ckptkit, "--tp", "2")
    ours = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    theirs = FileSystemReader(str(FIXTURES / "gpt-tp2-dp2")).read_metadata().state_dict_metadata
    assert sorted(ours) == sorted(theirs)
    for key, meta in theirs.items():
        if hasattr(meta, "chunks"):
            assert ours[key].size == meta.size, key
            assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in ours[key].chunks) == \
                sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks), key


def test_targets_and_sources_the_format_cannot_take_fail_in_one_line(tmp_path: Path, run_ckptkit: Any) -> None:
    layout = _layout_file(tmp_path)
    converted = tmp_path / "converted"
    assert run_ckptkit("convert", str(FIXTURES / "gpt-tp2-pp2"), str(converted), "--layout", str(layout)).returncode == 0
    deepspeed = tmp_path / "deepspeed"
    assert run_ckptkit("convert", str(FIXTURES.parent / "deepspeed" / "zero1-fp32"), str(deepspeed)).returncode == 0
    cases = [
        ((str(converted), "--tp", "4"), "query groups"),  # 2 groups cannot be cut 4 ways
        ((str(converted), "--include-optimizer"), "no optimizer/exp_avg tensors"),  # (a float32 model is its own master)
        ((str(deepspeed),), "layout 'deepspeed' is no tool's view of a canonical model"),  # no Megatron names for this model
    ]
    for args, says in cases:
        proc = run_ckptkit("export", args[0], str(tmp_path / "out"), "--format", "megatron", *args[1:])
        assert proc.returncode == 1 and says in one_line_error(proc.stderr), (args, proc.stderr)
        assert_nothing_written(tmp_path, tmp_path / "out")
    proc = run_ckptkit("export", str(converted), str(tmp_path / "out"), "--format", "hf", "--tp", "2")
    assert proc.returncode == 2 and "--tp/--pp" in proc.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the reference trainer's tiny Llama after 4 steps (logits of a trained scale)."""
    from .trainer.runs import train

    out = tmp_path_factory.mktemp("trained") / "run"
    train(out, (1, 1, 1, 0), 4)
    return out / "step_00000004"


@pytest.mark.parametrize(("export_at", "load_at"), [(("--tp", "2"), 1), (("--tp", "1", "--pp", "2"), 2)])
def test_the_reference_trainers_llama_loads_in_megatron_core_with_its_logits(export_at: tuple[str, ...], load_at: int,
                                                                             trained: Path, tmp_path: Path,
                                                                             run_ckptkit: Any) -> None:
    transformers = pytest.importorskip("transformers")
    out, hf = tmp_path / "megatron", tmp_path / "hf"
    proc = run_ckptkit("export", str(trained), str(out), "--format", "megatron", *export_at)
    assert proc.returncode == 0, proc.stderr
    assert run_ckptkit("export", str(trained), str(hf), "--format", "hf", "--dtype", "fp32").returncode == 0
    c = ckptkit.read_manifest(trained).info.model.config  # type: ignore[union-attr]
    config = {"num_layers": c["num_layers"], "hidden_size": c["hidden_size"], "num_attention_heads": c["num_heads"],
              "num_query_groups": c["num_kv_heads"], "ffn_hidden_size": c["intermediate_size"], "vocab_size": c["vocab_size"],
              "max_sequence_length": c["max_seq_len"]}
    ids = torch.tensor([[1, 5, 7, 2, 19, 3, 0, 44, 97], [4, 4, 8, 11, 6, 2, 13, 60, 31]])
    from safetensors.torch import save_file

    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    logits, plain = _load_in_megatron(out, load_at, "float32", tmp_path, tmp_path / "ids.safetensors", config)
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits
    assert logits.shape == want.shape and (logits - want).abs().max().item() < 1e-4
    # q, k, v interleaved per query group: group 1's q rows follow group 0's q, k and v
    state = ckptkit.load(trained)["model"]
    qkv = plain["decoder.layers.self_attention.linear_qkv.weight"][1]
    hd, per = c["hidden_size"] // c["num_heads"], c["num_heads"] // c["num_kv_heads"]
    assert torch.equal(qkv[(per + 2) * hd:(2 * per + 2) * hd], state["layers.1.attn.q.weight"][per * hd:2 * per * hd])
    assert torch.equal(plain["decoder.layers.mlp.linear_fc1.weight"][0][c["intermediate_size"]:], state["layers.0.mlp.up.weight"])


def test_the_llama_in_megatron_files_converts_back_to_every_original_tensor(tmp_path: Path, run_ckptkit: Any) -> None:
    # reference Llama -> Megatron files -> ckptkit convert -> Hugging Face, against the Llama's own
    # Hugging Face export: every tensor bitwise (q, k, v and gate, up fused and cut again); the
    # layout read back from the Megatron-LM arguments the export writes, none named.
    out = tmp_path / "megatron"
    assert run_ckptkit("export", str(LLAMA), str(out), "--format", "megatron", "--tp", "2").returncode == 0
    proc = run_ckptkit("convert", "--from", "megatron", str(out), str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    for src, dst in ((tmp_path / "back", tmp_path / "hf-back"), (LLAMA, tmp_path / "hf")):
        assert run_ckptkit("export", str(src), str(dst), "--format", "hf", "--dtype", "fp32").returncode == 0
    got = {k: v for f in (tmp_path / "hf-back").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    want = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(got) == sorted(want) and len(want) == 21
    assert all(torch.equal(got[k], want[k]) for k in want)


def megatron_qkv(state: dict[str, torch.Tensor], prefix: str, c: dict[str, Any]) -> torch.Tensor:
    """Layer `prefix`'s q, k and v of the reference Llama as Megatron fuses them, written out
    here: per query group, its queries, then its key, then its value."""
    hd, per = c["hidden_size"] // c["num_heads"], c["num_heads"] // c["num_kv_heads"]
    q, k, v = (state[prefix + f"attn.{n}.weight"] for n in "qkv")
    return torch.cat([t for g in range(c["num_kv_heads"]) for t in (q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd],
                                                                   v[g * hd:(g + 1) * hd])])


def _as_megatron(state: dict[str, torch.Tensor], c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The reference Llama's tensors of one state (parameters or a moment) under Megatron's keys,
    layers stacked, q, k, v interleaved per query group and gate, up stacked, written out here."""
    out = {"embedding.word_embeddings.weight": state["embed.weight"], "decoder.final_layernorm.weight": state["norm.weight"],
           "output_layer.weight": state["lm_head.weight"]}
    layers: dict[str, list[torch.Tensor]] = {}
    for i in range(c["num_layers"]):
        p = f"layers.{i}."
        qkv = megatron_qkv(state, p, c)
        for key, value in (("self_attention.linear_qkv.layer_norm_weight", state[p + "attn_norm.weight"]),
                           ("self_attention.linear_qkv.weight", qkv), ("self_attention.linear_proj.weight", state[p + "attn.o.weight"]),
                           ("mlp.linear_fc1.layer_norm_weight", state[p + "mlp_norm.weight"]),
                           ("mlp.linear_fc1.weight", torch.cat([state[p + "mlp.gate.weight"], state[p + "mlp.up.weight"]])),
                           ("mlp.linear_fc2.weight", state[p + "mlp.down.weight"])):
            layers.setdefault(f"decoder.layers.{key}", []).append(value)
    return out | {key: torch.stack(values) for key, values in layers.items()}


@pytest.mark.parametrize("export_at", [("--tp", "2"), ("--tp", "1", "--pp", "2")])
def test_the_reference_llamas_optimizer_state_comes_fused_as_its_parameters(export_at: tuple[str, ...], trained: Path,
                                                                           tmp_path: Path, run_ckptkit: Any) -> None:
    # fp32 masters (the trainer's fp32 parameters) and both Adam moments, as megatron-core's
    # load_plain_tensors reads them: every tensor equal to the source's, fused as the parameters
    out = tmp_path / "megatron"
    proc = run_ckptkit("export", str(trained), str(out), "--format", "megatron", "--include-optimizer", *export_at)
    assert proc.returncode == 0, proc.stderr
    c = ckptkit.read_manifest(trained).info.model.config  # type: ignore[union-attr]
    config = {"num_layers": c["num_layers"], "hidden_size": c["hidden_size"], "num_attention_heads": c["num_heads"],
              "num_query_groups": c["num_kv_heads"], "ffn_hidden_size": c["intermediate_size"], "vocab_size": c["vocab_size"],
              "max_sequence_length": c["max_seq_len"]}
    from safetensors.torch import save_file

    save_file({"ids": torch.tensor([[1, 5, 7, 2]])}, str(tmp_path / "ids.safetensors"))
    _, plain = _load_in_megatron(out, 1, "float32", tmp_path, tmp_path / "ids.safetensors", config)
    source = ckptkit.load(trained)
    assert {"exp_avg", "exp_avg_sq"} <= set(source["optimizer"])
    want = {f"optimizer.state.{name}.{key}": value
            for name, state in (("param", source["model"]), ("exp_avg", source["optimizer"]["exp_avg"]),
                                ("exp_avg_sq", source["optimizer"]["exp_avg_sq"]))
            for key, value in _as_megatron(state, c).items()} | _as_megatron(source["model"], c)
    assert sorted(plain) == sorted(want)
    for key, value in want.items():
        assert plain[key].dtype == torch.float32 and torch.equal(plain[key], value), key
    assert not torch.equal(plain["optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"],
                           plain["optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight"])
    groups = megatron_common(out / "common.pt")["optimizer"]["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and groups[0]["step"] == 4.0 and groups[0]["betas"] == (0.9, 0.95)


def test_megatrons_scheduler_resumes_the_reference_trainers_schedule_rate_for_rate(trained: Path, tmp_path: Path) -> None:
    # Megatron-LM loads opt_param_scheduler with the optimizer (and stops without it); its
    # scheduler counts samples, and each iteration takes the rate of the count before it
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ckptkit.trainer.engine import learning_rate

    report = ckptkit.export(trained, tmp_path / "megatron", format="megatron", include_optimizer=True)
    assert report.warnings == []
    common = megatron_common(tmp_path / "megatron" / "common.pt")
    saved = common["opt_param_scheduler"]
    manifest = ckptkit.read_manifest(trained)
    # where Megatron-LM's data resumes (its load_checkpoint reads it from the arguments)
    assert vars(common["args"])["consumed_train_samples"] == manifest.info.data_progress.consumed_samples > 0  # type: ignore[union-attr]
    config, samples = manifest.info.config or {}, manifest.info.data_progress.consumed_samples // manifest.step  # type: ignore[union-attr]
    assert samples > 1 and config["warmup_steps"] > manifest.step  # the resumed run warms up, then decays
    cfg = SimpleNamespace(**{k: config[k] for k in ("lr", "min_lr", "warmup_steps", "total_steps")})
    group = {"params": [], "wd_mult": 1.0}
    optimizer = SimpleNamespace(param_groups=[group])
    # the class values of a job given other arguments: the checkpoint's are used
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=1, lr_decay_steps=9,
                                        lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=9,
                                        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)
    scheduler.load_state_dict(saved)
    assert (saved["start_wd"], saved["end_wd"], saved["wd_incr_style"]) == (config["weight_decay"],) * 2 + ("constant",)
    for step in range(manifest.step + 1, cfg.total_steps + 3):
        assert group["lr"] == pytest.approx(learning_rate(cfg, step), rel=1e-12, abs=1e-15), step  # type: ignore[arg-type]
        scheduler.step(increment=samples)
        # (the load itself sets the decay of the job's arguments: Megatron's steps after it, the checkpoint's)
        assert group["weight_decay"] == config["weight_decay"]


def test_another_schedule_is_megatrons_constant_rate_the_next_steps_and_said(tmp_path: Path) -> None:
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "trainer" / "checkpoint-4"
    converted = ckptkit.convert(fixture, tmp_path / "in").destination
    rate = ckptkit.read_manifest(converted).info.scheduler["_last_lr"][0]  # type: ignore[index]
    report = ckptkit.export(converted, tmp_path / "megatron", format="megatron", include_optimizer=True)
    saved = megatron_common(tmp_path / "megatron" / "common.pt")["opt_param_scheduler"]
    assert (saved["lr_decay_style"], saved["max_lr"], saved["min_lr"], saved["lr_warmup_steps"]) == ("constant", rate, rate, 0)
    assert len(report.warnings) == 1 and f"constant rate {rate:g}, the next step's" in report.warnings[0]


@pytest.mark.parametrize(("name", "state"), [("megatron-lm/gpt-tp2-pp2", ()), ("megatron/gpt-tp2-dp2", ("--include-optimizer",))])
def test_a_megatron_gpt_exported_again_says_its_model_and_converts_back_bitwise(name: str, state: tuple[str, ...], tmp_path: Path,
                                                                              run_ckptkit: Any) -> None:
    # A Megatron-LM save (its arguments kept by the conversion) and a megatron-core save without
    # arguments (its layout named at conversion) -> Megatron files at another topology -> convert
    # with no layout named: the same model, every tensor bitwise.
    converted, out, back = tmp_path / "converted", tmp_path / "megatron", tmp_path / "back"
    given = () if name.startswith("megatron-lm") else ("--layout", str(_layout_file(tmp_path)))
    assert run_ckptkit("convert", str(FIXTURES.parent / name), str(converted), *given).returncode == 0
    proc = run_ckptkit("export", str(converted), str(out), "--format", "megatron", *state, "--tp", "1")
    assert proc.returncode == 0, proc.stderr
    args = vars(megatron_common(out / "common.pt")["args"])
    assert args["tensor_model_parallel_size"] == 1 and args["num_layers"] == ckptkit.read_manifest(converted).layout["num_layers"]
    proc = run_ckptkit("convert", "--from", "megatron", str(out), str(back))
    assert proc.returncode == 0, proc.stderr
    first, again = ckptkit.read_manifest(converted), ckptkit.read_manifest(back)
    assert again.layout is not None and again.layout["name"] == "megatron-gpt"
    kinds = ("model/", "optimizer/") if state else ("model/",)
    names = sorted(k for k in first.tensors if k.startswith(kinds))
    assert names and sorted(k for k in again.tensors if k.startswith(kinds)) == names
    want, got = _flat(ckptkit.load(converted)), _flat(ckptkit.load(back))
    assert [k for k in names if not torch.equal(got[k], want[k])] == []


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A loaded checkpoint's tensors under their manifest names (``model/...``, ``optimizer/exp_avg/...``)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _flat(value, name + "/")
        else:
            out[name] = value
    return out
