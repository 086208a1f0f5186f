"""Manifest 1.6: files in a packed table and tensors derived from the layout, against the same
checkpoint listed."""

from __future__ import annotations

import base64
import json

import pytest

from ckptkit.boxes import full_box
from ckptkit.errors import ManifestError
from ckptkit.layouts import rank_boxes, reference_llama
from ckptkit.layouts.saved import Saved
from ckptkit.manifest import BlockChecksums, FileEntry, GridShards, Manifest, Producer, TensorEntry, Topology, manifest_to_json, parse_manifest
from ckptkit.manifest.consistency import manifest_findings
from ckptkit.manifest.derived import TABLE_MIN, FileList, table_path
from ckptkit.manifest.model import Derived, DerivedGroup, FileRange
from ckptkit.manifest.shards import KeyIndex, file_keys, iter_shards
from ckptkit.plan.load import plan_load

LLAMA = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
TOPOLOGY = Topology(world_size=64, tp=2, pp=2, dp=16, zero_stage=1)
GROUPS = {"model": DerivedGroup(dtype="bfloat16", kind="param"), "optimizer/exp_avg": DerivedGroup(dtype="float32", kind="optimizer"),
          "optimizer/exp_avg_sq": DerivedGroup(dtype="float32", kind="optimizer")}


def files(n: int, extra: tuple[FileEntry, ...] = ()) -> tuple[FileEntry, ...]:
    return tuple(FileEntry(path=table_path(i), size=1000 + i, checksum=f"xxh3-128-blocks:{i:032x}",
                           blocks=BlockChecksums(size=1 << 20)) for i in range(n)) + extra


def derived_manifest(**update: object) -> Manifest:
    rng = TensorEntry(shape=(64, 8), dtype="uint8", kind="rng", shards=GridShards(cuts=(64, 1), files=FileRange(start=0, step=1), key="rng/cpu"))
    fields: dict[str, object] = dict(
        checkpoint_id="abc", step=3, created_at="2026-01-01T00:00:00+00:00", producer=Producer(ckptkit="0.1.0"),
        topology=TOPOLOGY, files=files(64, (FileEntry(path="tokenizer/vocab.json", size=5, checksum="xxh3-128:00", role="tokenizer"),)),
        tensors={"rng/cpu": rng}, layout=reference_llama(LLAMA).to_json(), derived=Derived(rule="ranges", groups=GROUPS),
    )
    fields.update(update)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_a_derived_manifest_writes_neither_its_derived_tensors_nor_its_table_files_and_reads_back_equal() -> None:
    m = derived_manifest()
    data = manifest_to_json(m)
    doc = json.loads(data)
    assert list(doc["tensors"]) == ["rng/cpu"]
    assert [f["path"] for f in doc["files"]] == ["tokenizer/vocab.json"]
    assert doc["file_table"]["count"] == 64
    assert len(base64.b64decode(doc["file_table"]["checksums"])) == 64 * 16
    parsed = parse_manifest(data)
    assert parsed == m
    assert isinstance(parsed.files, FileList)
    assert parsed.files[5] == m.files[5] and parsed.files[64].path == "tokenizer/vocab.json" and len(parsed.files) == 65
    logical = reference_llama(LLAMA).tensors()
    assert len(parsed.tensors) == 1 + 3 * len(logical)
    entry = parsed.tensors["optimizer/exp_avg/layers.3.attn.q.weight"]
    assert (entry.dtype, entry.kind, entry.shape) == ("float32", "optimizer", logical["layers.3.attn.q.weight"])
    assert "model/layers.4.attn.q.weight" not in parsed.tensors
    assert manifest_findings(parsed) == []
    assert manifest_to_json(parsed) == data  # written again, the same document, its table as read


def test_a_rank_s_load_plan_reads_exactly_the_boxes_it_holds_from_the_files_that_hold_them() -> None:
    m = parse_manifest(manifest_to_json(derived_manifest()))
    layout = reference_llama(LLAMA)
    saved = Saved(layout, TOPOLOGY)
    written = {(r, w.key): w for r in range(64) for w in saved.writes(r)}
    rank = 37
    requests = [(g.fqn(n), b) for g in layout.states for n, boxes in rank_boxes(layout, TOPOLOGY, rank)[g.label].items() for b in boxes]
    plan = plan_load(m, requests)
    for target in plan.targets:
        assert sum(r.overlap.volume for r in target.reads) == target.box.volume
        for read in target.reads:
            w = written[(read.file, read.key)]
            assert (w.fqn, w.box) == (target.fqn, read.src_box) and w.box.contains(read.overlap)
    index = KeyIndex(m.tensors)
    for (r, key), w in list(written.items())[::97]:
        assert index.shard(r, key) == (w.fqn, w.box)
    assert index.shard(3, "model/nothing") is None
    keys = file_keys(m.tensors)
    assert keys[rank]["rng/cpu"] == ("uint8", (1, 8), "rng/cpu")
    assert {k for k in keys[rank] if k != "rng/cpu"} == {w.key for w in saved.writes(rank)}
    q = m.tensors["model/layers.0.attn.o.weight"]
    assert {s.box for s in iter_shards(q)} == {s.box for s in saved.overlapping("model/layers.0.attn.o.weight", full_box(q.shape))}


def test_fewer_rank_files_than_a_table_needs_stay_listed() -> None:
    m = derived_manifest(topology=Topology(world_size=4, tp=2, pp=2, zero_stage=1), files=files(TABLE_MIN - 1),
                         tensors={})
    doc = json.loads(manifest_to_json(m))
    assert "file_table" not in doc and len(doc["files"]) == TABLE_MIN - 1


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["file_table"].update(sizes="AAAA"), "file_table"),
    (lambda d: d["derived"].update(rule="boxes"), "derived"),
    (lambda d: d["derived"]["groups"].update({"optimizer/momentum": {"dtype": "float32", "kind": "optimizer"}}), "not state groups"),
    (lambda d: d.pop("layout"), "has none"),
    (lambda d: d["topology"].update(tp=4, world_size=128), "does not fit"),
])
def test_a_damaged_description_is_refused_with_what_is_wrong(change, message: str) -> None:
    doc = json.loads(manifest_to_json(derived_manifest()))
    doc.pop("manifest_checksum")
    change(doc)
    from ckptkit.manifest import seal

    with pytest.raises(ManifestError, match=message):
        parse_manifest(seal(doc))


def test_the_checks_find_a_listed_tensor_under_a_derived_name_and_too_few_files() -> None:
    clash = TensorEntry(shape=(16,), dtype="bfloat16", kind="param",
                        shards=GridShards(cuts=(1,), files=FileRange(start=0, step=1), key="model/norm.weight"))
    m = derived_manifest(tensors={"model/norm.weight": clash})
    assert [f.code for f in manifest_findings(m)] == ["mapping"]
    short = derived_manifest(files=files(TABLE_MIN - 2), tensors={})
    assert any("the rule writes 64 files" in f.message for f in manifest_findings(short))


def test_inspect_of_a_derived_manifest_reports_every_tensor_s_cut_as_the_listed_form_does() -> None:
    from ckptkit.manifest.shards import listed_form
    from ckptkit.ops.inspect import summarize

    m = parse_manifest(manifest_to_json(derived_manifest()))
    derived, listed = summarize("c", m), summarize("c", listed_form(m))
    assert derived.tensor_list == listed.tensor_list and derived.shards == listed.shards
    cuts = {t.name: t.cut for t in derived.tensor_list}
    # ZeRO-1: the parameters whole per TP rank, the two moments (one cut, computed once) in ranges
    assert cuts["model/layers.0.attn.o.weight"] == "1 x 2"
    assert cuts["optimizer/exp_avg/layers.0.attn.o.weight"] == cuts["optimizer/exp_avg_sq/layers.0.attn.o.weight"] != "1 x 2"
    some = summarize("c", m, "optimizer/exp_avg/*")
    assert some.shards == listed.shards and all(t.name.startswith("optimizer/exp_avg/") for t in some.tensor_list)
