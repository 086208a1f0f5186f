"""Values of a legacy Megatron-LM rank file as JSON, and the forms of save the legacy converter
refuses by name (pure: parsed objects in)."""

from __future__ import annotations

import math
from typing import Any

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit_adapters.common.safepickle import Record
from ckptkit_adapters.common.torchsave import TorchDtype
from ckptkit_adapters.common.numpy_pickle import NumpyArray
from ckptkit_adapters.megatron.legacy_files import EnumValue


def as_json(value: Any) -> Any:
    """An unpickled value as JSON-like Python: an argparse.Namespace as its fields, an enum as
    ``Class(value)``, a NumPy uint32 array as its numbers, a torch dtype by name, tuples as
    lists, non-string keys as strings, non-finite floats as ``"inf"``, ``"-inf"``, ``"nan"``.
    Tensors and other objects stay as they are (and are then not JSON)."""
    if isinstance(value, NumpyArray):
        found = value.values()
        return value if found is None else found
    if isinstance(value, EnumValue):
        return f"{value.qualname}({', '.join(map(repr, value.args))})"
    if isinstance(value, Record):
        return as_json(value.state if value.state is not None else list(value.args))
    if isinstance(value, TorchDtype):
        return f"torch.{value.name}"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): as_json(v) for k, v in value.items()}
    return value


def refuse_unsupported(args: dict[str, Any], tree: Any, path: str, *, tp: int, pp: int) -> None:
    """Refuse, by name, the forms of save whose pieces this converter cannot place.

    Raises:
        ManifestError: virtual pipeline stages, experts, multi-token prediction, tied embeddings
            over pipeline stages, the layer-wise distributed optimizer.
        IntegrityError: rank directories that disagree with the arguments' TP and PP sizes.
    """
    if (isinstance(tree, dict) and "model0" in tree) or args.get("virtual_pipeline_model_parallel_size"):
        raise ManifestError(f"{path}: virtual pipeline stages (--num-layers-per-virtual-pipeline-stage: model0, model1, ... "
                            f"per rank file), which this converter does not read")
    refused = {"num_experts": "experts (--num-experts)", "mtp_num_layers": "multi-token prediction layers (--mtp-num-layers)",
               "use_layer_wise_distributed_optimizer": "the layer-wise distributed optimizer"}
    for key, what in refused.items():
        if args.get(key):
            raise ManifestError(f"{path}: {what}, which this converter does not read")
    if pp > 1 and not args.get("untie_embeddings_and_output_weights"):
        raise ManifestError(f"{path}: embeddings tied to the output layer over {pp} pipeline stages (the last stage's copy "
                            f"of the word embeddings), which this converter does not read")
    sizes = (args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size"))
    if sizes != (tp, pp):
        raise IntegrityError(f"{path}: rank directories for TP {tp} x PP {pp}, the arguments say TP {sizes[0]} x PP {sizes[1]}")


__all__ = ["as_json", "refuse_unsupported"]
