"""Convert a legacy Megatron-LM checkpoint (``--ckpt-format torch``: ``mp_rank_XX[_YYY]/model_optim_rng.pt``)."""

from __future__ import annotations

import time

from ckptkit.errors import ManifestError
from ckptkit.layouts import Layout
from ckptkit.ops.convert import ConvertReport, Progress


def convert_legacy(path: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                   layout: Layout | None = None, started: float | None = None) -> ConvertReport:
    """Convert the legacy Megatron-LM iteration directory `path` into the ckptkit checkpoint `dst`.

    Raises:
        ManifestError: always, for now: this form is not read yet.
    """
    del dst, allow_skip, progress, layout, started
    raise ManifestError(f"{path}: a legacy Megatron-LM checkpoint (mp_rank_XX/model_optim_rng.pt), which this converter "
                        f"does not read yet; save with --ckpt-format torch_dist")


__all__ = ["convert_legacy"]
