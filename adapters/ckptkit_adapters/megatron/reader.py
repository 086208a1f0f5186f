"""Convert a Megatron-Core ``dist_checkpointing`` checkpoint (the ``torch_dist`` format) into a ckptkit checkpoint.

The source is a checkpoint directory (``metadata.json`` naming ``torch_dist``, ``common.pt``,
DCP's ``.metadata`` and ``__<rank>_<k>.distcp`` files), or a Megatron-LM save directory whose
``latest_checkpointed_iteration.txt`` names the ``iter_XXXXXXX`` directory to read. The DCP part
is read as the ``dcp`` converter reads it (byte ranges, tensor by tensor, no torch), through its
allowlist plus the stand-ins for the save plans Megatron-Core caches in ``.metadata``
(`METADATA_ALLOWED`); ``common.pt`` (the state that is not sharded: the optimizer's parameter
groups, and in Megatron-LM saves the iteration, arguments, scheduler) through `COMMON_ALLOWED`.

Names. Megatron-Core stores each transformer layer's tensors stacked: one key without a layer
number and a leading layer axis (``decoder.layers.self_attention.linear_qkv.weight`` of shape
``[num_layers, ...]``, global layer numbers on that axis whatever the pipeline stage). Each is
split per layer, the layer number put back into the key, and the key kept as one name part:

- ``decoder.layers.self_attention.linear_qkv.weight``, layer 1 -> ``model/decoder.layers.1.self_attention.linear_qkv.weight``
- ``embedding.word_embeddings.weight`` -> ``model/embedding.word_embeddings.weight``
- ``optimizer.state.exp_avg.<key>`` (the distributed optimizer, ``fully_reshardable``) ->
  ``optimizer/exp_avg/<key per layer>``; its fp32 master ``optimizer.state.param.<key>`` ->
  ``optimizer/fp32/<key per layer>``; any other state keeps its name.
- a mixture of experts' ``SequentialMLP`` experts, stacked on a (layer, global expert) axis pair
  (``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[L, E, ...]``), are split per layer
  and expert: layer 1, expert 3 -> ``model/decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight``
  (their optimizer state and ``..._extra_state/shard_<i>.<e>_<L>.<E>`` likewise), as the
  ``megatron-gpt`` layout with ``num_moe_experts`` counts them;
- a sharded object ``<module>._extra_state/shard_<i>_<L>`` of a stacked module (TransformerEngine's
  extra state; ``None`` without it) -> the object ``model/decoder.layers.<i>.<module>._extra_state``.
- ``common.pt``: ``iteration`` is the manifest's step; ``args`` goes to ``info.config.args``,
  ``opt_param_scheduler`` to ``info.scheduler``, the optimizer's parameter groups to
  ``info.optimizer`` and, like every other value, to ``megatron/<key>/...`` objects.

Fused tensors stay fused under Megatron's names (QKV interleaved per query group; ``linear_fc1``
of a gated MLP as ``[gate; up]``): that is how a Megatron job loads them. The built-in
``megatron-gpt`` layout describes them; it is recorded (with ``info.model``) when ``common.pt``
holds Megatron-LM's ``args`` (`model_config`) and the tensors fit it. Otherwise give it to
``reshard`` and ``export`` with ``--layout`` (``ckptkit layout builtin megatron-gpt CONFIG``).

The distributed optimizer's ``dp_reshardable`` form (Megatron-LM's default: flat bucket buffers
per data-parallel group) comes across under the same names as ``fully_reshardable``: each
parameter's place in the buckets is derived and checked (``buckets``,
``optimizer``), which needs the model's layout (from Megatron-LM's args, or given).

A legacy Megatron-LM checkpoint (``mp_rank_XX`` directories of ``model_optim_rng.pt``) is read by
``legacy``. Refused (one line, nothing written): another sharded backend, anything the
``dcp`` converter refuses.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from pydantic import JsonValue

from ckptkit.boxes import Box
from ckptkit.errors import IntegrityError, LayoutError, ManifestError, summarize
from ckptkit.layouts import Layout, builtin, fit_problems
from ckptkit.manifest import CheckpointInfo, SourceInfo, Topology
from ckptkit.manifest.model import ModelInfo, OptimizerInfo, ParamGroup
from ckptkit.ops.convert import ConvertReport, Progress, SkippedEntry, source_info
from ckptkit.state.tree import escape, json_problems
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.dcp_metadata import ALLOWED, METADATA_NAME, DcpMetadata, TensorMeta, read_metadata
from ckptkit_adapters.common.dcp_read import Named, Naming, Plan, entry_archive, plan_conversion, write_plan, writer_ranks
from ckptkit_adapters.common.files import read_small
from ckptkit_adapters.common.safepickle import Record, record_type
from ckptkit_adapters.common.torchsave import TORCH_DTYPES, TorchDtype, open_archive, plain, stored_object
from ckptkit_adapters.megatron.buckets import BUCKET
from ckptkit_adapters.megatron.names import MEGATRON_EXPERTS, MEGATRON_LOCAL_EXPERTS
from ckptkit_adapters.megatron.optimizer import bucket_values, plan_buckets
from ckptkit_adapters.megatron.view import ARGS  # Megatron-LM's names, one table with the export's

NAME = "megatron"
MCORE_METADATA = "metadata.json"
COMMON = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # where megatron-core 0.17+ keeps the common state (a sharded object)
LATEST = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
STACKED = "decoder.layers."
OPTIMIZER_STATE = re.compile(r"^optimizer\.state\.([A-Za-z0-9_]+)\.(.+)$")
SHARDED_OBJECT = re.compile(r"^(.+)/shard_([0-9.]+)_([0-9.]+)$")
# SequentialMLP experts, stacked by megatron-core on a (layer, global expert) axis pair
EXPERTS = f"{STACKED}{MEGATRON_EXPERTS}."
EXPERT_SHARD = re.compile(r"^[0-9]+\.[0-9]+$")
STATE_NAMES = {"param": "fp32"}  # the distributed optimizer's fp32 master is its state "param"
_PLANNER = "torch.distributed.checkpoint.planner"
# Megatron-Core's save planner caches the ranks' plans in .metadata: stand-ins, never read.
METADATA_ALLOWED: dict[tuple[str, str], Any] = {
    **ALLOWED, **{(_PLANNER, n): record_type(f"{_PLANNER}.{n}") for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")},
}


class _Namespace(Record):
    """``argparse.Namespace`` (Megatron-LM's arguments): its fields, nothing run."""

    qualname = "argparse.Namespace"


COMMON_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    ("argparse", "Namespace"): _Namespace,
    **{("torch", name): TorchDtype(name) for name in TORCH_DTYPES},
}


def checkpoint_directory(src: str) -> str:
    """The torch_dist directory of `src`: `src` itself, or the iteration directory its
    ``latest_checkpointed_iteration.txt`` names.

    Raises:
        IntegrityError: neither.
        ManifestError: a legacy Megatron-LM checkpoint, or another sharded backend.
    """
    path = iteration_directory(src)
    if legacy(path):
        raise ManifestError(f"{path}: a legacy Megatron-LM checkpoint (mp_rank_XX/{LEGACY_FILE}), not torch_dist")
    return path


def iteration_directory(src: str) -> str:
    """The checkpoint directory of `src`: `src` itself when it holds a checkpoint (torch_dist, or
    legacy ``mp_rank_XX`` directories), else the iteration directory its
    ``latest_checkpointed_iteration.txt`` names.

    Raises:
        IntegrityError: neither.
        ManifestError: another sharded backend.
    """
    if os.path.isfile(os.path.join(src, MCORE_METADATA)):
        _check_backend(src)
        return src
    if legacy(src):
        return src
    latest = os.path.join(src, LATEST)
    if not os.path.isfile(latest):
        raise IntegrityError(f"{src}: no {MCORE_METADATA} and no {LATEST}")
    text = read_small(latest, 4096, f"Megatron's {LATEST}").decode("utf-8", "replace").strip()
    if text == "release":
        path = os.path.join(src, "release")
    elif text.isdigit():
        path = os.path.join(src, f"iter_{int(text):07d}")
    else:
        raise IntegrityError(f"{latest}: names no iteration ({text!r})")
    if not os.path.isdir(path):
        raise IntegrityError(f"{latest}: names {os.path.basename(path)}, which is not there")
    return iteration_directory(path)


def legacy(path: str) -> bool:
    """Whether `path` holds a legacy Megatron-LM checkpoint (``mp_rank_XX[_YYY]/model_optim_rng.pt``)."""
    try:
        return any(n.startswith("mp_rank_") and os.path.isfile(os.path.join(path, n, LEGACY_FILE)) for n in os.listdir(path))
    except OSError:
        return False


def _check_backend(path: str) -> None:
    raw = read_small(os.path.join(path, MCORE_METADATA), 1 << 20, "Megatron's metadata.json")
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{path}/{MCORE_METADATA}: not JSON ({exc})") from None
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise ManifestError(f"{path}: sharded backend {backend!r}; this converter reads torch_dist")


class MegatronNaming(Naming):
    """Megatron-Core's keys: layer-stacked tensors split per layer, keys kept as one name part."""

    def start(self, md: DcpMetadata) -> None:
        self.entries = md.entries

    def tensors(self, key: str, meta: TensorMeta) -> list[Named]:
        if BUCKET.match(key):
            return []  # a dp_reshardable bucket: its parameters' states are planned by `plan_buckets`
        found = OPTIMIZER_STATE.match(key)
        prefix, kind, param = ("model", "param", key) if found is None else (
            f"optimizer/{escape(STATE_NAMES.get(found.group(1), found.group(1)))}", "optimizer", found.group(2))
        whole = Box((0,) * len(meta.shape), meta.shape)
        if param.startswith(EXPERTS) and len(meta.shape) >= 2:
            rest = meta.shape[2:]
            return [Named(f"{prefix}/{escape(expert_key(param, i, e))}", kind, rest, Box((i, e, *(0,) * len(rest)), (1, 1, *rest)))
                    for i in range(meta.shape[0]) for e in range(meta.shape[1])]
        if not _stacked(param) or not meta.shape:
            return [Named(f"{prefix}/{escape(param)}", kind, meta.shape, whole)]
        rest = meta.shape[1:]
        return [Named(f"{prefix}/{escape(layer_key(param, i))}", kind, rest, Box((i, *(0,) * len(rest)), (1, *rest)))
                for i in range(meta.shape[0])]

    def value(self, key: str) -> str:
        found = SHARDED_OBJECT.match(key)
        if found is not None and found.group(1).startswith(EXPERTS) and EXPERT_SHARD.match(found.group(2)):
            layer, expert = (int(n) for n in found.group(2).split("."))
            return f"model/{escape(expert_key(found.group(1), layer, expert))}"
        if found is not None and _stacked(found.group(1)) and "." not in found.group(2):
            return f"model/{escape(layer_key(found.group(1), int(found.group(2))))}"
        return f"megatron/{escape(key)}"


def _stacked(key: str) -> bool:
    """Whether `key` is a layer-stacked tensor (under ``decoder.layers.`` with no layer number)."""
    return key.startswith(STACKED) and not key[len(STACKED):].split(".", 1)[0].isdigit()


def layer_key(key: str, layer: int) -> str:
    """The key of one layer of stacked `key`: ``decoder.layers.<layer>.<rest>``."""
    return f"{STACKED}{layer}.{key[len(STACKED):]}"


def expert_key(key: str, layer: int, expert: int) -> str:
    """The key of one layer's expert of expert-stacked `key` (``decoder.layers.mlp.experts.experts.<rest>``):
    ``decoder.layers.<layer>.mlp.experts.local_experts.<expert>.<rest>``, the expert's global
    index (as megatron-core names it at EP 1)."""
    return f"{STACKED}{layer}.{MEGATRON_LOCAL_EXPERTS}.{expert}.{key[len(EXPERTS):]}"


class MegatronConverter:
    """The ``megatron`` converter (registered in the ``ckptkit.converters`` entry-point group)."""

    name = NAME
    description = "Megatron-Core dist_checkpointing directory (torch_dist), or a Megatron-LM save naming one"

    def detect(self, path: str) -> bool:
        """Whether `path` holds Megatron's ``metadata.json`` and ``common.pt`` beside DCP's
        ``.metadata``, or is a Megatron-LM save directory (its latest iteration file, or legacy
        ``mp_rank_XX`` directories, which `convert` refuses by name)."""
        try:
            names = set(os.listdir(path))
        except OSError:
            return False
        return ({MCORE_METADATA, METADATA_NAME} <= names or LATEST in names) or legacy(path)

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None, config: Mapping[str, JsonValue] | None = None) -> ConvertReport:
        """Convert the Megatron checkpoint `src` into the committed ckptkit checkpoint `dst`
        (recording `layout` if given, else ``megatron-gpt`` when Megatron-LM's args describe it,
        or, for a save without them, when its shapes and `config` (``--model-config``: the heads
        and query groups the shapes cannot say) do).

        Raises:
            ManifestError: a pickle needs a class outside the allowlists (named); a format this
                converter does not read (named); entries that cannot be converted, without
                `allow_skip`.
            IntegrityError: files missing or truncated, chunks that do not tile their tensor.
            LayoutError: the layout the shapes and `config` give does not fit the tensors.
            CheckpointExistsError, StorageError: as `ckptkit.ops.convert.write_converted`.
        """
        started = time.perf_counter()
        if not os.path.isdir(src):
            raise IntegrityError(f"{src}: no such directory")
        path = iteration_directory(src)
        if legacy(path):
            from ckptkit_adapters.megatron.legacy import convert_legacy  # noqa: PLC0415 (it imports this module)

            return convert_legacy(path, dst, allow_skip=allow_skip, progress=progress, layout=layout, started=started)
        md = read_metadata(path, METADATA_ALLOWED)
        plan = plan_conversion(path, md, MegatronNaming())
        common = _common(path, md, plan)
        optimizers = _optimizers(common)
        bucketed = any(o.get("param_state_sharding_type") == "dp_reshardable" for o in optimizers)
        if bucketed and len(optimizers) > 1:
            raise ManifestError(f"{path}: a chained optimizer's (a mixture of experts') dp_reshardable state is not read yet; "
                                "save it fully_reshardable (Megatron-LM --dist-ckpt-optim-fully-reshardable)")
        groups = bucket_values(path, md, plan) if bucketed else None
        info, step = _info(common, plan.objects, plan.object_sources, plan.skipped, groups)
        shapes = {t.spec.name: t.spec.shape for t in plan.tensors}
        found = None if layout is not None else model_config(plain(common.get("args")))
        if found is None and layout is None and config:
            found = said_config(shapes, config, path)
            problems = fit_problems(builtin("megatron-gpt", found), shapes)
            if problems:
                raise LayoutError(f"{path}: the megatron-gpt layout of the shapes and --model-config does not fit the "
                                  f"tensors: " + summarize(problems))
        if found is not None:
            described = builtin("megatron-gpt", found)
            if not fit_problems(described, shapes):
                layout = described
                info = info.model_copy(update={"model": ModelInfo(family="megatron-gpt", config=found)})
        if bucketed:
            if layout is None:
                raise ManifestError(f"{path}: the distributed optimizer's dp_reshardable state is read through the model's "
                                    f"layout, and common.pt has no Megatron-LM args to describe it; pass --model-config "
                                    f"num_attention_heads=N --model-config num_query_groups=G (or --layout FILE)")
            plan_buckets(path, md, plan, layout)
        report = write_plan(NAME, path, dst, md, plan, allow_skip=allow_skip, progress=progress, started=started, step=step,
                            info=info, layout=layout, source=megatron_source(path, plain(common.get("args")), writer_ranks(path)))
        if layout is None:
            return report.model_copy(update={"warnings": [no_layout_warning(path, shapes)]})
        return report


# Megatron-LM's arguments for the sizes it ran at, by the topology's names.
PARALLEL_ARGS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
                 "ep": "expert_model_parallel_size"}


def megatron_source(src: str, args: Any, ranks: int | None) -> SourceInfo:
    """What a converted Megatron save records of its source: the processes whose files it has
    (`ranks`), and, where Megatron-LM's arguments are saved, the sizes they ran at (the data
    parallel size their world size leaves; ZeRO 1 for the distributed optimizer)."""
    if not isinstance(args, dict):
        return source_info(NAME, src, ranks=ranks)
    sizes = {axis: n for axis, key in PARALLEL_ARGS.items() if isinstance(n := args.get(key), int) and n >= 1}
    model = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    world = args.get("world_size")
    world = world if isinstance(world, int) and world >= model else (ranks or model)
    return source_info(NAME, src, ranks=ranks, topology=Topology(
        world_size=world, tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), cp=sizes.get("cp", 1), ep=sizes.get("ep", 1),
        dp=max(1, world // model), zero_stage=1 if args.get("use_distributed_optimizer") else 0))


def shape_config(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, JsonValue]:
    """What a Megatron-Core GPT's tensor shapes determine of its ``megatron-gpt`` config: layers,
    hidden and vocabulary sizes, the MLP's (and experts') sizes, whether it is gated; never the
    attention heads or query groups (only their products with ``kv_channels`` are in the shapes:
    `attention_products`)."""
    said: dict[str, JsonValue] = {}
    layers = {int(m.group(1)) for name in shapes for m in [re.match(r"model/decoder\.layers\.(\d+)\.", name)] if m}
    if layers:
        said["num_layers"] = max(layers) + 1
    embedding = shapes.get("model/embedding.word_embeddings.weight")
    if embedding is not None and len(embedding) == 2:
        said["vocab_size"], said["hidden_size"] = embedding
    fc1, fc2 = shapes.get("model/decoder.layers.0.mlp.linear_fc1.weight"), shapes.get("model/decoder.layers.0.mlp.linear_fc2.weight")
    if fc2 is not None and len(fc2) == 2:
        said["ffn_hidden_size"] = fc2[1]
        if fc1 is not None:
            said["gated_linear_unit"] = fc1[0] == 2 * fc2[1]
    experts = {int(m.group(1)) for name in shapes
               for m in [re.match(rf"model/decoder\.layers\.0\.{re.escape(MEGATRON_LOCAL_EXPERTS)}\.(\d+)\.", name)] if m}
    if experts:
        said["num_moe_experts"] = max(experts) + 1
        fc1 = shapes.get(f"model/decoder.layers.0.{MEGATRON_LOCAL_EXPERTS}.0.linear_fc1.weight")
        fc2 = shapes.get(f"model/decoder.layers.0.{MEGATRON_LOCAL_EXPERTS}.0.linear_fc2.weight")
        if fc2 is not None and len(fc2) == 2:
            said["moe_ffn_hidden_size"] = fc2[1]  # (the layout's ffn_hidden_size sizes no tensor then)
            if fc1 is not None:
                said["gated_linear_unit"] = fc1[0] == 2 * fc2[1]
    return said


def attention_products(shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int] | None:
    """num_attention_heads x kv_channels and num_query_groups x kv_channels, from the first layer's
    attention shapes (None when they are not there)."""
    qkv = shapes.get("model/decoder.layers.0.self_attention.linear_qkv.weight")
    proj = shapes.get("model/decoder.layers.0.self_attention.linear_proj.weight")
    if qkv is None or proj is None or len(proj) != 2:
        return None
    return proj[1], (qkv[0] - proj[1]) // 2


def said_config(shapes: Mapping[str, tuple[int, ...]], given: Mapping[str, JsonValue], where: str) -> dict[str, JsonValue]:
    """The ``megatron-gpt`` config of a save without Megatron-LM's arguments: what its shapes
    determine (and whether the output layer is the embedding's), with what the user said
    (``convert --model-config``: the heads and query groups) over it; ``kv_channels`` follows
    from the heads when not given.

    Raises:
        LayoutError: the heads do not divide what the shapes say of them.
    """
    said = shape_config(shapes)
    if "moe_ffn_hidden_size" in said:
        said.setdefault("ffn_hidden_size", said["moe_ffn_hidden_size"])  # a dense MLP's size sizes no tensor then
    said["share_embeddings_and_output_weights"] = "model/output_layer.weight" not in shapes
    config = {**said, **given}
    products, heads = attention_products(shapes), config.get("num_attention_heads")
    if products is not None and isinstance(heads, int) and heads > 0 and "kv_channels" not in config:
        if products[0] % heads:
            raise LayoutError(f"{where}: --model-config num_attention_heads={heads} does not divide num_attention_heads x kv_channels = "
                              f"{products[0]} (the attention's shapes)")
        config["kv_channels"] = products[0] // heads
    return config


def no_layout_warning(path: str, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """What a save without Megatron-LM's arguments (so converted with no layout) leaves the user to
    say: what the tensors' shapes determine of the ``megatron-gpt`` config, and what they cannot
    (the attention heads and query groups), as the options that say it."""
    said = shape_config(shapes)
    products = attention_products(shapes)
    heads = "" if products is None else (f" (num_attention_heads x kv_channels = {products[0]}, "
                                         f"num_query_groups x kv_channels = {products[1]})")
    known = ", ".join(f"{k} {json.dumps(v)}" for k, v in said.items())
    return (f"{path}: common.pt holds no Megatron-LM arguments, so no layout is recorded and reshard and export will ask for "
            f"one; the shapes say {known or 'nothing of the model'}, and not num_attention_heads or num_query_groups{heads}: "
            "convert again with --model-config num_attention_heads=N --model-config num_query_groups=G")


def model_config(args: Any) -> dict[str, JsonValue] | None:
    """The ``megatron-gpt`` layout's config from Megatron-LM's arguments (as a dict), or None
    when they do not describe a GPT of that form (no arguments, biases, learned positions)."""
    if not isinstance(args, dict) or not all(isinstance(args.get(k), int) for k in ("num_layers", "hidden_size",
                                                                                    "num_attention_heads", "ffn_hidden_size",
                                                                                    "padded_vocab_size")):
        return None
    if args.get("add_bias_linear") or args.get("position_embedding_type", "rope") != "rope":
        return None
    config: dict[str, JsonValue] = {mine: args[theirs] for theirs, mine in ARGS.items() if args.get(theirs) is not None
                                    and theirs not in ("num_query_groups", "vocab_size", "num_experts")}
    if args.get("group_query_attention") and isinstance(args.get("num_query_groups"), int):
        config["num_query_groups"] = args["num_query_groups"]
    vocab = args.get("vocab_size")  # the tokenizer's, when given: the rows past it are padding
    if isinstance(vocab, int) and 0 < vocab < args["padded_vocab_size"]:
        config["unpadded_vocab_size"] = vocab
    config["gated_linear_unit"] = bool(args.get("swiglu"))
    experts = args.get("num_experts")
    if isinstance(experts, int) and experts > 0:
        if args.get("moe_grouped_gemm"):
            return None  # grouped experts (TEGroupedMLP) are saved in another form than SequentialMLP's
        config["num_moe_experts"] = experts
    config["share_embeddings_and_output_weights"] = not args.get("untie_embeddings_and_output_weights", False)
    return config


def _common(path: str, md: DcpMetadata, plan: Plan) -> dict[str, Any]:
    """The common (not sharded) state, unpickled through `COMMON_ALLOWED` (a dict; tensors are
    refused): ``common.pt``, or since megatron-core 0.17 the sharded object ``common_state``
    among the DCP entries (taken out of `plan`: its values become the ``megatron/`` objects)."""
    where = os.path.join(path, COMMON)
    if os.path.exists(where):
        fd, size = open_regular(where)
        try:
            tree = stored_object(open_archive(fd, 0, size, where), COMMON_ALLOWED)
        finally:
            os.close(fd)
    else:
        ref = md.storage.get((COMMON_STATE, None))
        if ref is None:
            raise IntegrityError(f"{path}: neither {COMMON} nor the common_state entry megatron-core keeps the common state in")
        with entry_archive(path, ref, COMMON_STATE) as archive:
            held = stored_object(archive, COMMON_ALLOWED)
        tree = held[0] if isinstance(held, list) and len(held) == 1 else held  # a sharded object: the list of its pieces
        where = f"{path} ({COMMON_STATE})"
        plan.skipped[:] = [s for s in plan.skipped if s.name != COMMON_STATE]
        for name in [n for n, source in plan.object_sources.items() if source == COMMON_STATE]:
            del plan.objects[name], plan.object_sources[name]
    if not isinstance(tree, dict):
        raise IntegrityError(f"{where}: not a dict of the common state")
    return tree


def _optimizers(common: dict[str, Any]) -> list[dict[str, Any]]:
    """The optimizer states of ``common.pt``: one, or a ``ChainedOptimizer``'s (a mixture of
    experts': dense and experts), saved as ``{0: ..., 1: ...}``, in order."""
    optimizer = common.get("optimizer")
    if not isinstance(optimizer, dict):
        return []
    if optimizer and all(isinstance(k, int) for k in optimizer):
        return [v for _, v in sorted(optimizer.items()) if isinstance(v, dict)]
    return [optimizer]


def _info(common: dict[str, Any], objects: dict[str, JsonValue], sources: dict[str, str],
          skipped: list[SkippedEntry], groups: Any = None) -> tuple[CheckpointInfo, int | None]:
    """Fold ``common.pt`` into objects (``megatron/...``) and the manifest's info and step (the
    optimizer's parameter groups from `groups`, else from ``common.pt``)."""
    for key, value in common.items():
        name, converted = f"megatron/{escape(str(key))}", plain(value)
        problems = json_problems({name: converted})
        if problems:
            skipped.append(SkippedEntry(name=f"{COMMON}:{key}", reason=f"not a JSON value ({problems[0]})"))
            continue
        objects[name], sources[name] = converted, f"{COMMON}:{key}"
    fields: dict[str, Any] = {}
    args = plain(common.get("args"))
    if isinstance(args, dict) and not json_problems({"args": args}):
        fields["config"] = {"args": args}
    scheduler = plain(common.get("opt_param_scheduler"))
    if isinstance(scheduler, dict) and not json_problems({"s": scheduler}):
        fields["scheduler"] = scheduler
    if groups is None:
        found = [(o.get("optimizer") or {}).get("param_groups") for o in _optimizers(common)]
        groups = [g for one in found if isinstance(one, list) for g in one] if found and all(isinstance(f, list) for f in found) \
            else None
    step: int | None = None
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        options = [{k: v for k, v in plain(g).items() if k != "params"} for g in groups]
        steps = {g.get("step") for g in options}
        common_step = next(iter(steps)) if len(steps) == 1 else None
        if isinstance(common_step, (int, float)) and float(common_step).is_integer() and common_step >= 0:
            step = int(common_step)
        if not json_problems({"g": options}):
            fields["optimizer"] = OptimizerInfo(type="megatron", param_groups=tuple(ParamGroup(params=(), options=o) for o in options),
                                                step=step)
    iteration = common.get("iteration")
    if isinstance(iteration, int) and iteration >= 0:
        step = iteration
    return CheckpointInfo(**fields), step


CONVERTER = MegatronConverter()

__all__ = ["COMMON_ALLOWED", "CONVERTER", "METADATA_ALLOWED", "NAME", "MegatronConverter", "MegatronNaming",
           "checkpoint_directory", "expert_key", "iteration_directory", "layer_key", "legacy", "model_config"]
