"""Where the trainer keeps each logical tensor, for any topology, computed without torch (pure).

The parallel layers build their parameters from these functions, and the ZeRO units cut their
flat buffers with them, so that the boxes a rank saves or loads can also be computed for a
topology nobody is running (offline resharding plans from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..boxes import Box, flat_range_to_boxes
from .config import ModelConfig


@dataclass(frozen=True)
class Part:
    """Rows [row0, row1) of a local parameter hold the box (`offsets`, `lengths`) of logical tensor `name`.

    ``replicated``: every TP rank holds the same whole tensor.
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    row0: int
    row1: int
    replicated: bool = False


@dataclass(frozen=True)
class ParamSpec:
    """One local parameter of a module: its name in the module, local shape and logical parts."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]


def column_parts(names: list[str], outs: list[int], in_features: int, tp: int, tp_rank: int) -> list[Part]:
    """Parts of a column-parallel weight fusing logical weights [out_i, in] row-wise, each split over TP."""
    parts, row = [], 0
    for name, out in zip(names, outs):
        local = out // tp
        parts.append(Part(name, (out, in_features), (tp_rank * local, 0), (local, in_features), row, row + local))
        row += local
    return parts


def row_parts(name: str, in_features: int, out_features: int, tp: int, tp_rank: int) -> list[Part]:
    """Parts of a row-parallel weight [out, in] whose input columns are split over TP."""
    local = in_features // tp
    return [Part(name, (out_features, in_features), (0, tp_rank * local), (out_features, local), 0, out_features)]


def padded_vocab(vocab: int, tp: int) -> int:
    """Return the vocabulary padded to a multiple of tp (padding is not part of the logical shape)."""
    return math.ceil(vocab / tp) * tp


def vocab_rows(vocab: int, tp: int, tp_rank: int) -> tuple[int, int, int]:
    """Return (rows per rank, first vocab id, real rows) of a vocab-parallel weight on `tp_rank`."""
    per_rank = padded_vocab(vocab, tp) // tp
    start = tp_rank * per_rank
    return per_rank, start, max(0, min(start + per_rank, vocab) - start)


def vocab_parts(name: str, vocab: int, hidden: int, tp: int, tp_rank: int) -> list[Part]:
    _, start, real = vocab_rows(vocab, tp, tp_rank)
    return [Part(name, (vocab, hidden), (min(start, vocab), 0), (real, hidden), 0, real)]


def norm_parts(name: str, hidden: int) -> list[Part]:
    return [Part(name, (hidden,), (0,), (hidden,), 0, hidden, replicated=True)]


def layer_params(cfg: ModelConfig, layer: int, tp: int, tp_rank: int) -> list[ParamSpec]:
    """The parameters of decoder layer `layer` on `tp_rank`, in the module's parameter order."""
    p, h, f, hd = f"layers.{layer}.", cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = column_parts([p + "attn.q.weight", p + "attn.k.weight", p + "attn.v.weight"],
                       [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], h, tp, tp_rank)
    o = row_parts(p + "attn.o.weight", cfg.num_heads * hd, h, tp, tp_rank)
    gate_up = column_parts([p + "mlp.gate.weight", p + "mlp.up.weight"], [f, f], h, tp, tp_rank)
    down = row_parts(p + "mlp.down.weight", f, h, tp, tp_rank)
    return [
        ParamSpec("attn_norm.weight", (h,), tuple(norm_parts(p + "attn_norm.weight", h))),
        ParamSpec("attn.qkv.weight", (qkv[-1].row1, h), tuple(qkv)),
        ParamSpec("attn.o.weight", (h, o[0].lengths[1]), tuple(o)),
        ParamSpec("mlp_norm.weight", (h,), tuple(norm_parts(p + "mlp_norm.weight", h))),
        ParamSpec("mlp.gate_up.weight", (gate_up[-1].row1, h), tuple(gate_up)),
        ParamSpec("mlp.down.weight", (h, down[0].lengths[1]), tuple(down)),
    ]


def stage_units(cfg: ModelConfig, tp: int, tp_rank: int, pp: int, pp_rank: int) -> list[list[ParamSpec]]:
    """The parameters of each unit of a pipeline stage, in the order the stage runs them."""
    per = cfg.num_layers // pp
    h = cfg.hidden_size
    rows = vocab_rows(cfg.vocab_size, tp, tp_rank)[0]
    units: list[list[ParamSpec]] = []
    if pp_rank == 0:
        units.append([ParamSpec("weight", (rows, h), tuple(vocab_parts("embed.weight", cfg.vocab_size, h, tp, tp_rank)))])
    units += [layer_params(cfg, i, tp, tp_rank) for i in range(pp_rank * per, (pp_rank + 1) * per)]
    if pp_rank == pp - 1:
        units.append([ParamSpec("weight", (h,), tuple(norm_parts("norm.weight", h)))])
        if not cfg.tie_embeddings:
            units.append([ParamSpec("weight", (rows, h), tuple(vocab_parts("lm_head.weight", cfg.vocab_size, h, tp, tp_rank)))])
    return units


def unit_offsets(params: list[ParamSpec]) -> tuple[list[int], int]:
    """Return each parameter's offset in its unit's flat buffer, and the buffer's size."""
    offsets, total = [], 0
    for spec in params:
        offsets.append(total)
        total += math.prod(spec.shape)
    return offsets, total


def partition(numel: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """Return (range size, lo, hi): the DP ranges are equal, padded, cut without regard to tensors."""
    chunk = -(-numel // dp)
    return chunk, min(dp_rank * chunk, numel), min((dp_rank + 1) * chunk, numel)


def part_ranges(params: list[ParamSpec], lo: int, hi: int) -> list[tuple[Part, int, int, int]]:
    """For the flat range [lo, hi) of a unit: (part, part start, x, y) for every part it touches,
    where [x, y) is the overlap in flat coordinates and the part starts at flat `part start`."""
    offsets, _ = unit_offsets(params)
    out = []
    for spec, offset in zip(params, offsets):
        inner = math.prod(spec.shape[1:]) if spec.shape else 1
        for part in spec.parts:
            a, b = offset + part.row0 * inner, offset + part.row1 * inner
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out.append((part, a, x, y))
    return out


def rank_boxes(cfg: ModelConfig, tp: int, pp: int, dp: int, zero: int, rank: int) -> dict[str, dict[str, list[Box]]]:
    """Return the boxes of every logical tensor that rank `rank` of a topology holds.

    Keys: ``model`` (parameters), ``optimizer/exp_avg`` and ``optimizer/exp_avg_sq``. Ranks
    are ordered tp fastest, then dp, then pp.
    """
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    out: dict[str, dict[str, list[Box]]] = {"model": {}, "optimizer/exp_avg": {}, "optimizer/exp_avg_sq": {}}
    for params in stage_units(cfg, tp, tp_rank, pp, pp_rank):
        numel = unit_offsets(params)[1]
        _, lo, hi = partition(numel, dp, dp_rank)
        state = (0, numel) if zero == 0 else (lo, hi)
        for key, (a_lo, a_hi) in (("model", (lo, hi) if zero == 3 else (0, numel)), ("optimizer/exp_avg", state),
                                  ("optimizer/exp_avg_sq", state)):
            for part, start, x, y in part_ranges(params, a_lo, a_hi):
                boxes = flat_range_to_boxes(part.lengths, x - start, y - start)
                out[key].setdefault(part.name, []).extend(
                    Box(tuple(o + b for o, b in zip(box.offsets, part.offsets)), box.lengths) for box in boxes
                )
    return out


def logical_param_names(model: ModelConfig) -> list[str]:
    """Return the logical parameter names of the whole model (every stage)."""
    names = ["embed.weight", "norm.weight"] + ([] if model.tie_embeddings else ["lm_head.weight"])
    for i in range(model.num_layers):
        p = f"layers.{i}."
        names += [p + n for n in ("attn_norm.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight",
                                  "attn.o.weight", "mlp_norm.weight", "mlp.gate.weight", "mlp.up.weight",
                                  "mlp.down.weight")]
    return names


STATE_KEYS = ("model", "optimizer/exp_avg", "optimizer/exp_avg_sq")


def topology_holders(cfg: ModelConfig, tp: int, pp: int, dp: int, zero: int) -> dict[str, dict[Box, list[int]]]:
    """Return, for every tensor (``<key>/<name>`` for the keys of `rank_boxes`), each distinct
    non-empty box any rank of the topology holds, with the ranks holding it.

    The same boxes as `rank_boxes` over every rank, computed once per (tp, pp) group: a
    replica held by a whole DP group (or all TP ranks) is one entry, not one per rank.
    """
    out: dict[str, dict[Box, list[int]]] = {}

    def add(keys: tuple[str, ...], part: Part, boxes: list[Box], ranks: list[int]) -> None:
        tables = [out.setdefault(f"{key}/{part.name}", {}) for key in keys]
        for box in boxes:
            global_box = Box(tuple(o + b for o, b in zip(box.offsets, part.offsets)), box.lengths)
            for table in tables:
                table.setdefault(global_box, []).extend(ranks)

    # Held whole by the DP group: the parameters below ZeRO 3, the moments at ZeRO 0.
    whole: tuple[str, ...] = () if zero == 3 else ("model",) if zero else STATE_KEYS
    split = tuple(k for k in STATE_KEYS if k not in whole)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            group = [tp_rank + tp * (d + dp * pp_rank) for d in range(dp)]
            for params in stage_units(cfg, tp, tp_rank, pp, pp_rank):
                numel = unit_offsets(params)[1]  # padding rows included: ZeRO cuts the padded buffer
                spans = part_ranges(params, 0, numel)  # (part, start, start, end), in flat order
                for part, start, x, y in spans if whole else ():
                    add(whole, part, flat_range_to_boxes(part.lengths, x - start, y - start), group)
                first = 0
                for d in range(dp) if split else ():  # one sweep: the DP ranges and the parts are both in order
                    _, lo, hi = partition(numel, dp, d)
                    while first < len(spans) and spans[first][3] <= lo:
                        first += 1
                    i = first
                    while i < len(spans) and spans[i][2] < hi:
                        part, start, a, b = spans[i]
                        x, y = max(a, lo), min(b, hi)
                        if x < y:
                            add(split, part, flat_range_to_boxes(part.lengths, x - start, y - start), [group[d]])
                        i += 1
    return out
