"""Render the results document as a plain-text table for the terminal."""

from __future__ import annotations

from typing import Any

from .report import GIB

_PHASE_TITLES = {
    "save": "SAVE, durable (fsync included)",
    "load": "LOAD, cold page cache, every byte in tensors",
    "load_warm": "LOAD, warm (files in the page cache)",
    "verify": "VERIFY, cold page cache, every checksum",
}
_SUBJECT = {"save": "ckptkit", "load": "ckptkit", "load_warm": "ckptkit", "verify": "ckptkit verify"}


def render(results: dict[str, Any]) -> str:
    """Return the whole report: header, one table per phase, scale, and targets."""
    state, config = results["state"], results["config"]
    lines = [
        f"ckptkit benchmarks: {state['bytes'] / (1 << 20):.0f} MiB fp32 state, {state['tensors']} tensors, "
        f"{config['repeats']} repeat(s), medians; GB = 1e9 bytes",
        f"machine: {results['machine']['summary']}",
    ]
    for phase in ("save", "load", "load_warm", "verify"):
        if phase in results:
            lines += ["", *_phase_table(phase, results[phase])]
    if "scale" in results:
        lines += ["", *_scale_table(results["scale"])]
    if "reshard" in results:
        lines += ["", *_reshard_table(results["reshard"])]
    if "export" in results:
        lines += ["", *_export_table(results["export"])]
    if "convert" in results:
        lines += ["", *_convert_table(results["convert"])]
    if "async" in results:
        lines += ["", *_async_table(results["async"])]
    if "s3" in results:
        lines += ["", *_s3_table(results["s3"])]
    if "reshard_plan" in results:
        lines += ["", *_plan_table(results["reshard_plan"])]
    if "scale_131k" in results:
        lines += ["", *_scale_131k_table(results["scale_131k"])]
    if "scale_ranks" in results:
        from .rank_plans import render as ranks_table

        lines += ["", *ranks_table(results["scale_ranks"])]
    if "checksums" in results:
        lines += ["", *_checksums_table(results["checksums"], results["state"]["bytes"])]
    if "incremental" in results:
        lines += ["", *_incremental_table(results["incremental"])]
    if "tier" in results:
        from .tiers import render as tier_table

        lines += ["", *tier_table(results["tier"])]
    lines += ["", *_targets_table(results["targets"])]
    return "\n".join(lines)


def _phase_table(phase: str, block: dict[str, Any]) -> list[str]:
    subject = _SUBJECT[phase]
    columns = f"{'median s':>9}{'min-max s':>12}{'GB/s':>7}{subject + ' x':>18}   added peak RSS"
    lines = [f"{_PHASE_TITLES[phase]:<46}{columns}"]
    for tool, s in block["tools"].items():
        if "median_s" not in s:
            lines.append(f"  {tool:<44}FAILED: {'; '.join(s['errors'])[:100]}")
            continue
        ratio = block["ratios"].get(tool)
        ratio_text = "-" if tool == subject or ratio is None else f"{ratio:.2f}"
        note = " (best DCP)" if tool == block.get("best_dcp") else ""
        mismatch = "  DATA MISMATCH: " + "; ".join(s["mismatches"][:2]) if s.get("mismatches") else ""
        lines.append(
            f"  {tool + note:<44}{s['median_s']:>9.2f}{_spread(s):>12}{s['gb_per_s']:>7.2f}{ratio_text:>18}"
            f"   {_peak(s)}{mismatch}"
        )
    lines.append(f"  ({subject} x: {subject}'s throughput over the row's, the median of per-repeat ratios)")
    return lines


def _spread(summary: dict[str, Any]) -> str:
    return f"{summary['min_s']:.2f}-{summary['max_s']:.2f}"


def _peak(summary: dict[str, Any]) -> str:
    if "added_peak_bytes" not in summary:
        return "-"
    return f"{summary['added_peak_bytes'] / GIB:6.2f} GiB ({summary['added_peak_ratio']:.2f}x state)"


def _scale_table(scale: dict[str, Any]) -> list[str]:
    if "error" in scale:
        return [f"SCALE: FAILED: {scale['error']}"]
    m = scale["median"]
    lines = [
        f"SCALE: manifest of {m['tensors']} tensors x {m['ranks']} ranks ({m['grid_tensors']} grids, "
        f"{m['box_tensors']} box lists of {m['boxes']} boxes in all), median of {scale['runs']} run(s)",
        f"  {'making the Shard lists (input, no target)':<44}{m['inputs_s']:>9.2f} s",
    ]
    for stage, what in (
        ("build_s", "build (compact_shards + Manifest)"),
        ("validate_s", "validate (manifest_findings)"),
        ("serialize_s", "serialize (manifest_to_json)"),
        ("parse_s", "parse (parse_manifest)"),
    ):
        lines.append(f"  {what:<44}{m[stage]:>9.2f} s")
    lines.append(f"  {'JSON size (block digests in sidecars)':<44}{m['json_bytes'] / 1e6:>9.2f} MB")
    if "inline_digest_bytes" in m:
        lines.append(f"  {'  the digests in the manifest would add':<44}{m['inline_digest_bytes'] / 1e6:>9.2f} MB")
    return lines


def _reshard_table(block: dict[str, Any]) -> list[str]:
    if "error" in block:
        return [f"RESHARD: FAILED: {block['error']}"]
    src = block["source"]
    title = f"RESHARD (4,2,2,z1) -> (2,1,4,z2), {src['state_bytes'] / 1e9:.2f} GB, {src['tensors']} tensors, cold source"
    return _tool_table(title, block, (("ckptkit time / disk limit time", "time_vs_limit"), ("ckptkit time / DCP time", "time_vs_dcp")))


def _export_table(block: dict[str, Any]) -> list[str]:
    if "error" in block:
        return [f"EXPORT: FAILED: {block['error']}"]
    src = block["source"]
    title = (f"EXPORT to bf16 HF from (4,2,2,z1): {src['param_bytes'] / 1e9:.2f} GB of fp32 parameters read, "
             f"{src['output_bytes'] / 1e9:.2f} GB written, cold source")
    return _tool_table(title, block, (("ckptkit time / disk limit time", "time_vs_limit"),
                                      ("ckptkit time inside the command (no start-up) / disk limit time", "in_process_vs_limit"),
                                      ("ckptkit time / naive time", "time_vs_naive")))


# What each tool of the convert phase reads and writes, as its row says.
_CONVERT_ROWS = {
    "dcp": {
        "disk limit": "disk limit: cold read of the source's bytes + durable write of the tensors'",
        "ckptkit": "ckptkit convert --from dcp: every tensor (fp32), durable",
        "dcp_to_torch_save": "dcp_to_torch_save + fsync: every tensor, one torch.save file",
    },
    "deepspeed": {
        "disk limit, ckptkit's bytes": "disk limit for ckptkit's bytes: read every rank file, write 16 B/param",
        "disk limit, zero_to_fp32's bytes": "disk limit for zero_to_fp32's bytes: read the masters, write 4 B/param",
        "ckptkit": "ckptkit convert --from deepspeed: params, fp32 masters, exp_avg, exp_avg_sq",
        "zero_to_fp32": "zero_to_fp32 (safetensors) + fsync: the fp32 weights only",
    },
}


def _convert_table(block: dict[str, Any]) -> list[str]:
    lines = [f"{'CONVERT into a ckptkit checkpoint, cold source':<82}{'median s':>10}{'peak RSS':>11}{'read GB':>9}{'written GB':>11}"]
    for source in ("dcp", "deepspeed"):
        lines += _convert_source(source, block.get(source, {"error": "not run"}))
    lines.append("  (read GB: what the tool read from the disk, as the kernel counts it; a disk limit's: the bytes it reads."
                 " written GB: the files it left)")
    return lines


def _convert_source(source: str, block: dict[str, Any]) -> list[str]:
    name = {"dcp": "torch DCP", "deepspeed": "DeepSpeed ZeRO-3"}[source]
    if "skipped" in block:
        return [f" from {name}: SKIPPED: {block['skipped']}"]
    if "error" in block:
        return [f" from {name}: FAILED: {block['error']}"]
    src = block["source"]
    largest = f"the largest {src['largest_tensor_bytes'] / 1e6:.0f} MB"
    if source == "dcp":
        title = f" from torch DCP (the reshard source): {src['source_bytes'] / 1e9:.2f} GB, {src['tensors']} tensors, {largest}"
    else:
        title = (f" from DeepSpeed ZeRO-3 ({src['ranks']} ranks, fp32, AdamW): {src['source_bytes'] / 1e9:.2f} GB, "
                 f"{src['layers']} Linear {src['hidden']}x{src['hidden']}, {src['parameters'] / 1e6:.1f} M params, {largest}")
    lines = [title]
    for tool, s in block["tools"].items():
        label = _CONVERT_ROWS[source].get(tool, tool)
        if "median_s" not in s:
            lines.append(f"  {label:<80}FAILED: {'; '.join(s['errors'])[:100]}")
            continue
        peak = f"{s['peak_rss_bytes'] / (1 << 20):.0f} MiB" if "peak_rss_bytes" in s else "-"
        read, written = (f"{s[key] / 1e9:.3f}" if key in s else "-" for key in ("bytes_read", "bytes_written"))
        lines.append(f"  {label:<80}{s['median_s']:>10.2f}{peak:>11}{read:>9}{written:>11}")
    peer = block["peer"]
    own = " for its own bytes" if source == "deepspeed" else ""
    ours, theirs = (block["tools"].get(t, {}).get("bytes_written") for t in ("ckptkit", peer))
    plain = ""
    if ours and theirs and abs(ours / theirs - 1) > 0.05:
        plain = f" (plain: ckptkit writes {ours / theirs:.1f}x the bytes)"
    for label, key in ((f"ckptkit time / disk limit time{own}", "time_vs_limit"),
                       ("ckptkit time inside the command (no start-up) / the same limit", "in_process_vs_limit"),
                       (f"{peer} time / disk limit time{own}", "peer_vs_limit"),
                       (f"ckptkit time / {peer} time{plain}", "time_vs_peer")):
        value = block.get(key)
        lines.append(f"  {label:<80}{'-' if value is None else f'{value:.2f}':>10}")
    lines.append(f"  {'RSS bound: 512 MiB + 2x largest tensor':<80}{'':>10}{block['rss_bound_bytes'] / (1 << 20):>7.0f} MiB")
    return lines


def _async_table(block: dict[str, Any]) -> list[str]:
    size = (block.get("state_bytes") or 0) / 1e9
    lines = [f"{f'ASYNC SAVE: time save() blocks, {size:.2f} GB CPU state':<70}{'median s':>12}{'first s':>12}"]
    for tool, s in block["tools"].items():
        if "median_s" not in s:
            lines.append(f"  {tool:<68}FAILED: {'; '.join(s['errors'])[:100]}")
            continue
        lines.append(f"  {tool:<68}{s['median_s']:>12.3f}{s['first_s']:>12.3f}")
    for name, key in (("ckptkit / copy into preallocated buffer", "vs_copy"), ("ckptkit / DCP async_save", "vs_dcp"),
                      ("Python loop speed while a save is written / idle", "loop_rate_during_background")):
        value = block.get(key)
        lines.append(f"  {name:<68}{'-' if value is None else f'{value:.2f}':>12}")
    growth = block.get("rss_growth_bytes")
    lines.append(f"  {'RSS growth over 10 saves after the first':<68}{'-' if growth is None else f'{growth / (1 << 20):.0f} MiB':>12}")
    return lines


def _s3_table(block: dict[str, Any]) -> list[str]:
    if "error" in block:
        return [f"S3: FAILED: {block['error']}"]
    size = block["size_mib"] * (1 << 20) / 1e9
    lines = [f"{f'S3 (SeaweedFS on loopback): {size:.2f} GB state':<70}{'median s':>12}{'MB/s':>12}"]
    for tool, s in block["tools"].items():
        if "median_s" not in s:
            lines.append(f"  {tool:<68}FAILED: {'; '.join(s['errors'])[:100]}")
            continue
        lines.append(f"  {tool:<68}{s['median_s']:>12.2f}{size * 1e3 / s['median_s']:>12.0f}")
    for name, key in (("ckptkit save / boto3 upload_file (throughput)", "save_vs_upload_file"),
                      ("ckptkit load / boto3 download_file (throughput)", "load_vs_download_file")):
        value = block.get(key)
        lines.append(f"  {name:<68}{'-' if value is None else f'{value:.2f}':>12}")
    r = block["resharding"]
    lines.append(f"  {'load-time reshard: payload bytes read / bytes of the boxes filled':<68}"
                 f"{r['payload_bytes_read'] / r['box_bytes']:>12.3f}   ({r['payload_bytes_read']} / {r['box_bytes']}; "
                 f"headers {r['header_bytes_read']}; {r['requests']} requests)")
    return lines


def _tool_table(title: str, block: dict[str, Any], ratios: tuple[tuple[str, str], ...]) -> list[str]:
    lines = [f"{title:<82}{'median s':>12}{'peak RSS':>12}"]
    for tool, s in block["tools"].items():
        if "median_s" not in s:
            lines.append(f"  {tool:<44}FAILED: {'; '.join(s['errors'])[:100]}")
            continue
        peak = f"{s['peak_rss_bytes'] / (1 << 20):.0f} MiB" if "peak_rss_bytes" in s else "-"
        lines.append(f"  {tool:<82}{s['median_s']:>12.2f}{peak:>12}")
    for name, key in ratios:
        value = block.get(key)
        lines.append(f"  {name:<82}{'-' if value is None else f'{value:.2f}':>12}")
    lines.append(f"  {'RSS bound: 256 MiB + 2x largest tensor':<82}{'':>12}{block['rss_bound_bytes'] / (1 << 20):>8.0f} MiB")
    return lines


def _plan_table(plan: dict[str, Any]) -> list[str]:
    if "error" in plan:
        return [f"RESHARD PLAN: FAILED: {plan['error']}"]
    return [
        f"RESHARD PLAN: {plan['source_ranks']} -> {plan['target_ranks']} ranks, {plan['logical_tensors']} logical tensors "
        f"({plan['tensors']} with both Adam moments), {plan['target_files']} target files, {plan['reads']} reads",
        f"  {'source manifest (input, untimed)':<44}{plan['inputs_s']:>9.2f} s",
        f"  {'target layout, files, manifest entries':<44}{plan['plan_s']:>9.2f} s",
        f"  {'reads of every target file (one process)':<44}{plan['reads_s']:>9.2f} s",
        f"  {'total (median run; all runs: ' + ', '.join(f'{x:.1f}' for x in plan.get('all_seconds', [])) + ')':<44}"
        f"{plan['seconds']:>9.2f} s",
    ]


def _scale_131k_table(block: dict[str, Any]) -> list[str]:
    if "error" in block:
        return [f"SCALE 131K: FAILED: {block['error']}"]
    m = block["median"]
    return [
        f"SCALE 131K: DeepSeek-V3-like, {m['layers']} layers, {m['logical']} logical tensors ({m['tensors']} with masters and "
        f"both Adam moments), {m['ranks']} ranks ({m['topology']}), one core, median of {block['runs']} run(s)",
        f"  {'file entries as the ranks report them (input)':<52}{m['inputs_s']:>9.3f} s",
        f"  {'build (Manifest: file table, tensors derived)':<52}{m['build_s']:>9.3f} s",
        f"  {'validate (manifest_findings of the built one)':<52}{m['validate_s']:>9.3f} s",
        f"  {'serialize (manifest_to_json)':<52}{m['serialize_s']:>9.3f} s",
        f"  {'parse (parse_manifest)':<52}{m['parse_s']:>9.3f} s",
        f"  {'manifest JSON':<52}{m['json_bytes'] / 1e6:>9.2f} MB",
        f"  {'one rank: load plan, median / max of ' + str(m['sampled_ranks']) + ' ranks':<52}"
        f"{m['load_plan_ms']:>9.1f} / {m['load_plan_max_ms']:.1f} ms ({m['load_reads']:.0f} reads)",
        f"  {'one rank: reshard plan to ' + str(m['target_ranks']) + ' ranks, median / max':<52}"
        f"{m['reshard_plan_ms']:>9.1f} / {m['reshard_plan_max_ms']:.1f} ms",
        f"  {'DCP: the same load, create_read_items_for_chunk_list':<52}{m['dcp_plan_ms']:>9.1f} / {m['dcp_plan_max_ms']:.1f} ms "
        f"({m['dcp_reads']:.0f} reads)",
        f"  {'DCP: its metadata listing ' + format(round(m['chunks']), ',') + ' chunks (est.)':<52}{m['dcp_metadata_bytes'] / 1e6:>9.0f} MB, "
        f"unpickled in {m['dcp_unpickle_s']:.0f} s",
        *([f"  {'inspect (every tensor and its cut, ' + format(round(m['inspect_boxes']), ',') + ' boxes)':<52}{m['inspect_s']:>9.1f} s"]
          if "inspect_s" in m else []),
    ]


def _checksums_table(block: dict[str, Any], nbytes: int) -> list[str]:
    if "error" in block:
        return [f"CHECKSUMS: FAILED: {block['error']}"]
    title = f"CHECKSUMS: block checksums (xxh3-64 per block) or none, {nbytes / 1e9:.2f} GB state"
    lines = [f"{title:<70}{'median s':>10}{'min-max s':>12}{'GB/s':>7}"]
    for tool, s in block["tools"].items():
        if "median_s" not in s:
            lines.append(f"  {tool:<68}FAILED: {'; '.join(s['errors'])[:100]}")
            continue
        mismatch = "  DATA MISMATCH: " + "; ".join(s["mismatches"][:2]) if s.get("mismatches") else ""
        lines.append(f"  {tool:<68}{s['median_s']:>10.2f}{_spread(s):>12}{s['gb_per_s']:>7.2f}{mismatch}")
    lines.append("  throughput with block checksums / without (median of per-repeat ratios; every repeat)")
    for key, what in (("save", "save"), ("load", "cold load, whole tensors"), ("load_sharded", "cold load, 3 ranks' row blocks")):
        value = block["ratios"].get(key)
        every = ", ".join(f"{x:.3f}" for x in block["per_repeat"].get(key, []))
        lines.append(f"    {what:<66}{'-' if value is None else f'{value:.3f}':>10}   ({every})")
    hashing = block.get("block_hashing", {})
    if "seconds" in hashing:
        share = hashing.get("share_of_save")
        lines.append(f"  {'block hashing alone, one thread, in memory':<68}{hashing['seconds']:>10.2f}"
                     f"{'':>12}{hashing['gb_per_s']:>7.2f}"
                     + ("" if share is None else f"   ({100 * share:.1f} % of the median save)"))
    partial = block.get("partial", {})
    if "error" in partial:
        lines.append(f"  partial loads: FAILED: {partial['error']}")
        return lines
    lines.append(f"  {'partial loads, each rank alone: payload bytes read / bytes needed':<68}{'checked':>10}"
                 f"{'worst rank':>12}{'no checks':>11}{'blocks touched':>16}")
    for name, variants in partial.items():
        checked, unchecked = variants.get("checked", {}), variants.get("unchecked", {})
        what = f"rank r of {checked.get('ranks', '?')}, {name.split(' of ')[0]} ({checked.get('needed_bytes', 0) / 1e9:.2f} GB needed in all)"
        lines.append(f"    {what:<66}{checked.get('amplification', 0):>10.3f}{checked.get('worst_rank', 0):>12.3f}"
                     f"{unchecked.get('amplification', 0):>11.3f}{checked.get('block_bound', 0):>16.3f}")
    return lines


def _incremental_table(block: dict[str, Any]) -> list[str]:
    title = f"INCREMENTAL: {block['saves']} saves of a {block['size_mib']} MiB state, full vs incremental, interleaved, durable"
    lines = [title, f"  {'scenario':<10}{'changed MB':>11}{'full MB':>9}{'incr MB':>9}{'index MB':>9}{'value/changed':>14}"
                    f"{'full s':>8}{'incr s':>8}{'thru x':>8}{'restore x':>10}"]
    for name, s in block["scenarios"].items():
        if "error" in s:
            lines.append(f"  {name:<10}FAILED: {s['error'][:100]}")
            continue
        ratio = "-" if s["bytes_vs_changed"] is None else f"{s['bytes_vs_changed']:.3f}"
        lines.append(f"  {name:<10}{s['changed_bytes'] / 1e6:>11.2f}{s['full_written'] / 1e6:>9.1f}{s['incremental_written'] / 1e6:>9.2f}"
                     f"{s['index_bytes'] / 1e6:>9.2f}{ratio:>14}{s['full_s']:>8.3f}{s['incremental_s']:>8.3f}"
                     f"{s['throughput_vs_full']:>8.2f}{s['restore_vs_full']:>10.2f}")
    lines.append("  (medians over the saves after the first; thru x: full save time / incremental; restore x: cold load of the")
    lines.append("   newest incremental step / of the newest full save)")
    for name, s in block["scenarios"].items():
        if s.get("compacted_per_save"):
            lines.append(f"  {name}: compactions (a save rewritten whole once a box lies under {block.get('compact_after', '?')} patches) "
                         f"wrote {s['compacted_per_save'] / 1e6:.1f} MB per save besides the saves' own"
                         + (f"; mean save {s['incremental_mean_s']:.3f} s, compactions included" if s.get("incremental_mean_s") else ""))
    encode, codec = block.get("encode"), block.get("codec")
    if encode:
        lines.append(f"  finding the changed elements of {encode['bytes'] / (1 << 20):.0f} MiB of bf16 ({100 * encode['changed']:.0f} % changed): "
                     f"{encode['bytes'] / encode['diff_s'] / 1e9:.2f} GB/s, memcpy {encode['bytes'] / encode['memcpy_s'] / 1e9:.2f} GB/s "
                     f"(x{encode['vs_memcpy']:.2f})")
    if codec:
        lines.append(f"  zlib-1 over byte planes of fp32 Adam moments: ratio {codec['ratio']:.3f}, compress "
                     f"{codec['bytes'] / codec['compress_s'] / 1e9:.2f} GB/s, durable write {codec['bytes'] / codec['write_s'] / 1e9:.2f} GB/s: "
                     f"compress+write / write x{codec['time_vs_plain']:.1f} ({'pays' if codec['time_vs_plain'] < 1 else 'does not pay: off'})")
    return lines


def _targets_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'TARGETS':<46}{'measured':>10}{'target':>12}   verdict"]
    for row in rows:
        value = row["value"]
        if row["target"].endswith("JSON bytes") and value is not None:
            shown, bound = f"{value / 1e6:.2f} MB", f"< {row['bound'] / 1e6:.0f} MB"
        else:
            shown = "-" if value is None else f"{value:.2f}"
            bound = f"{'>=' if row['at_least'] else '<'} {row['bound']:.2f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[row["met"]]
        lines.append(f"  {row['target']:<44}{shown:>10}{bound:>12}   {verdict}")
    return lines

