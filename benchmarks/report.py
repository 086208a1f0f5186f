"""Summaries of the measured runs: medians, GB/s, paired ratios, memory, targets, and the table.

A ratio between two tools is the median over repeats of the ratio within each repeat (both
tools ran minutes apart in the same repeat), which cancels most of a noisy machine's drift.
"""

from __future__ import annotations

import statistics
from typing import Any

from .phases import PARALLEL_READ_LIMIT, READ_LIMIT, WRITE_LIMIT, Runs

GB = 1e9
GIB = float(1 << 30)
SAVE_VS_LIMIT = 0.9
LOAD_VS_LIMIT = 0.8
LOAD_VS_PARALLEL_LIMIT = 0.9  # a cold load / the cold read of the same bytes by 4 threads: at least
LOAD_WARM_VS_LIMIT = 0.6  # a load of a checkpoint still in the page cache / the page-cache read rate: at least
VERIFY_VS_LIMIT = 0.8
MAX_ADDED_PEAK = 1.0
SCALE_MAX_S = 5.0
SCALE_MAX_JSON_BYTES = 50_000_000
# The 131,072-rank DeepSeek-V3-like save (issue targets): manifest size, parse, build, one rank's plans.
SCALE_131K_JSON_BYTES = 16_000_000
SCALE_131K_PARSE_S = 1.0
SCALE_131K_BUILD_S = 2.0
SCALE_131K_LOAD_PLAN_MS = 50.0
SCALE_131K_RESHARD_PLAN_MS = 200.0
# Each rank's planning as the ranks grow from 8 to 64 (same model): time and memory at most this
# much more at 64 than at 8 ("flat"); bytes read at most the blocks its boxes touch.
SCALE_RANKS_GROWTH = 1.5


def added_peak(run: dict[str, Any], phase: str) -> int | None:
    """Return the bytes an operation added to peak RSS beyond the state itself (None if unmeasured).

    A save starts with the state resident, so everything above the starting RSS is added; a
    load ends holding the state, so the state's own bytes are not counted as added.
    """
    if "rss_peak" not in run:
        return None
    added = int(run["rss_peak"]) - int(run["rss_before"])
    return added - int(run["state_bytes"]) if phase == "load" else added


def summarize(runs: Runs, phase: str) -> dict[str, dict[str, Any]]:
    """Return per tool: median seconds, GB/s, spread, added peak memory, and errors."""
    summary = {}
    for tool, results in runs.items():
        ok = [r for r in results if "error" not in r]
        errors = [r["error"] for r in results if "error" in r]
        entry: dict[str, Any] = {"runs": len(results), "ok": len(ok), "errors": errors}
        if ok:
            seconds = [r["seconds"] for r in ok]
            nbytes = ok[0]["state_bytes"]
            entry.update(median_s=statistics.median(seconds), min_s=min(seconds), max_s=max(seconds))
            entry["gb_per_s"] = nbytes / entry["median_s"] / GB
            peaks = [p for p in (added_peak(r, phase) for r in ok) if p is not None]
            if peaks:
                entry["added_peak_bytes"] = max(peaks)
                entry["added_peak_ratio"] = max(peaks) / nbytes
            entry["mismatches"] = sorted({m for r in ok for m in r.get("mismatches", [])})
        summary[tool] = entry
    return summary


def paired_ratio(runs: Runs, subject: str, other: str) -> float | None:
    """Return the median over repeats of subject's throughput divided by other's."""
    pairs = [
        b["seconds"] / a["seconds"]
        for a, b in zip(runs.get(subject, []), runs.get(other, []))
        if "error" not in a and "error" not in b
    ]
    return statistics.median(pairs) if pairs else None


def ratios(runs: Runs, subject: str) -> dict[str, float | None]:
    """Return subject's paired throughput ratio against every other tool of the phase."""
    return {tool: paired_ratio(runs, subject, tool) for tool in runs if tool != subject}


def best_dcp(summary: dict[str, dict[str, Any]]) -> str | None:
    """Return the fastest DCP save variant of a save summary."""
    timed = [(s["median_s"], t) for t, s in summary.items() if t.startswith("dcp-") and "median_s" in s]
    return min(timed)[1] if timed else None


RESHARD_VS_LIMIT = 1.3
RESHARD_RSS_FIXED = 256 << 20
RESHARD_PLAN_S = 10.0
EXPORT_VS_LIMIT = 1.15
CONVERT_VS_LIMIT = 1.15
CONVERT_RSS_FIXED = 512 << 20
ASYNC_VS_COPY = 1.2
ASYNC_VS_DCP = 0.5
S3_VS_BOTO3 = 0.9
CHECKSUM_COST = 0.97  # throughput with block checksums / without: at most 3 % lost
PARTIAL_READ_AMPLIFICATION = 1.1  # bytes a partial load reads / bytes its targets need: at most
TIER_RESTART_VS_FLOOR = 1.2  # restart to a restored state from memory or a peer / (imports + bytes at memcpy or loopback speed): at most
TIER_STALL_VS_MEMCPY = 1.1  # training stall of a memory snapshot / memcpy of the rank's state: at most
INCREMENTAL_BYTES = 1.1  # value bytes an incremental save writes / bytes that changed: at most
INCREMENTAL_THROUGHPUT = 0.95  # incremental save throughput / full, where nothing repeats: at least
INCREMENTAL_ENCODE = 0.5  # finding changed elements / memcpy of the box: at least
INCREMENTAL_RESTORE = 1.2  # cold restore of a chain's newest step / of a full save: at most


def time_ratio(runs: Runs, subject: str, other: str, key: str = "seconds") -> float | None:
    """Return the median over repeats of subject's time (its `key`) over other's seconds, paired per repeat."""
    pairs = [a[key] / b["seconds"] for a, b in zip(runs.get(subject, []), runs.get(other, []))
             if "error" not in a and "error" not in b and key in a]
    return statistics.median(pairs) if pairs else None


def tool_summary(runs: Runs, peers: dict[str, str], rss_fixed: int = RESHARD_RSS_FIXED) -> dict[str, Any]:
    """Medians per tool, ckptkit's time over each peer's (paired per repeat; `peers` maps the key
    to the tool), peak RSS, and the RSS bound `rss_fixed` + 2x the largest tensor."""
    tools: dict[str, Any] = {}
    for tool, results in runs.items():
        ok = [r for r in results if "error" not in r]
        entry: dict[str, Any] = {"runs": len(results), "errors": [r["error"] for r in results if "error" in r]}
        if ok:
            entry["median_s"] = statistics.median(r["seconds"] for r in ok)
            peaks = [r["rss_peak_abs"] for r in ok if "rss_peak_abs" in r]
            if peaks:
                entry["peak_rss_bytes"] = max(peaks)
        tools[tool] = entry

    ok = [r for r in runs.get("ckptkit", []) if "error" not in r]
    largest = ok[0].get("largest_tensor_bytes", 0) if ok else 0
    ratios = {key: time_ratio(runs, "ckptkit", tool) for key, tool in peers.items()}
    return {"tools": tools, **ratios, "rss_bound_bytes": rss_fixed + 2 * largest}


def reshard_summary(runs: Runs) -> dict[str, Any]:
    """Medians per tool, ckptkit's time over the disk limit and over DCP (paired per repeat), peak RSS."""
    return tool_summary(runs, {"time_vs_limit": "disk limit", "time_vs_dcp": "dcp load+save"})


def export_summary(runs: Runs) -> dict[str, Any]:
    """Medians per tool, ckptkit's time over the disk limit and over the naive path, peak RSS,
    and the time inside the command (its start-up left out) over the disk limit."""
    summary = tool_summary(runs, {"time_vs_limit": "disk limit", "time_vs_naive": "dcp consolidate+save_file"})
    pairs = [a["in_process_s"] / b["seconds"] for a, b in zip(runs.get("ckptkit", []), runs.get("disk limit", []))
             if "in_process_s" in a and "error" not in b]
    summary["in_process_vs_limit"] = statistics.median(pairs) if pairs else None
    return summary


def convert_summary(runs: Runs, source: str) -> dict[str, Any]:
    """Medians per tool with the bytes each read and wrote; ckptkit's time over the disk limit of
    its own bytes (whole, and inside the command), the peer's over the limit of the peer's own
    bytes, ckptkit's over the peer's (plain: where they write different bytes, not a like-for-like
    figure), all paired per repeat; peak RSS and the bound 512 MiB + 2x the largest tensor."""
    from .converts import LIMITS, PEERS

    peer, limit = PEERS[source], LIMITS[(source, "ckptkit")]
    summary = tool_summary(runs, {"time_vs_limit": limit, "time_vs_peer": peer}, CONVERT_RSS_FIXED)
    summary["peer"] = peer
    summary["in_process_vs_limit"] = time_ratio(runs, "ckptkit", limit, key="in_process_s")
    summary["peer_vs_limit"] = time_ratio(runs, peer, LIMITS[(source, peer)])
    for tool, entry in summary["tools"].items():
        ok = [r for r in runs[tool] if "error" not in r]
        for key in ("bytes_read", "bytes_written"):
            if ok and all(key in r for r in ok):
                entry[key] = int(statistics.median(r[key] for r in ok))
    return summary


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Return every target with its measured value and whether it is met (None if not measured)."""
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, bound: float, at_least: bool) -> None:
        met = None if value is None else (value >= bound if at_least else value < bound)
        rows.append({"target": name, "value": value, "bound": bound, "at_least": at_least, "met": met})

    for phase, limit, bound, name in (
        ("save", WRITE_LIMIT, SAVE_VS_LIMIT, "ckptkit save"),
        ("load", READ_LIMIT, LOAD_VS_LIMIT, "ckptkit load"),
        ("load", PARALLEL_READ_LIMIT, LOAD_VS_PARALLEL_LIMIT, "ckptkit load"),
        ("load_warm", READ_LIMIT, LOAD_WARM_VS_LIMIT, "ckptkit warm load"),
        ("verify", READ_LIMIT, VERIFY_VS_LIMIT, "ckptkit verify"),
    ):
        if phase in results:
            add(f"{name} / {limit}", results[phase]["ratios"].get(limit), bound, True)
    for phase, limit, bound, name in (  # ckptkit.load(..., mapped=True), beside the plain load
        ("load", PARALLEL_READ_LIMIT, LOAD_VS_PARALLEL_LIMIT, "ckptkit mapped load"),
        ("load_warm", READ_LIMIT, LOAD_WARM_VS_LIMIT, "ckptkit mapped warm load"),
    ):
        if phase in results and "ratios_mapped" in results[phase]:
            add(f"{name} / {limit}", results[phase]["ratios_mapped"].get(limit), bound, True)
    for phase in ("save", "load"):
        if phase in results:
            ratio = results[phase]["tools"]["ckptkit"].get("added_peak_ratio")
            add(f"ckptkit {phase} added peak RSS / state", ratio, MAX_ADDED_PEAK, False)
    reshard = results.get("reshard")
    if reshard and "error" not in reshard:
        add("ckptkit reshard time / disk limit time", reshard["time_vs_limit"], RESHARD_VS_LIMIT, False)
        peak = reshard["tools"].get("ckptkit", {}).get("peak_rss_bytes")
        add("ckptkit reshard peak RSS / (256 MiB + 2x largest)", None if peak is None else peak / reshard["rss_bound_bytes"], 1.0, False)
    export = results.get("export")
    if export and "error" not in export:
        add("ckptkit export time / disk limit time", export["time_vs_limit"], EXPORT_VS_LIMIT, False)
        peak = export["tools"].get("ckptkit", {}).get("peak_rss_bytes")
        add("ckptkit export peak RSS / (256 MiB + 2x largest)", None if peak is None else peak / export["rss_bound_bytes"], 1.0, False)
    for source in ("dcp", "deepspeed"):
        if "convert" in results:  # a source skipped or failed: its targets are listed, not measured
            block = results["convert"].get(source, {})
            add(f"ckptkit convert --from {source} time / disk limit time", block.get("time_vs_limit"), CONVERT_VS_LIMIT, False)
            peak = block.get("tools", {}).get("ckptkit", {}).get("peak_rss_bytes")
            add(f"ckptkit convert --from {source} peak RSS / (512 MiB + 2x largest)",
                None if peak is None else peak / block["rss_bound_bytes"], 1.0, False)
    block = results.get("async")
    if block and "error" not in block:
        add("ckptkit save blocking time / copy into preallocated buffer", block["vs_copy"], ASYNC_VS_COPY, False)
        add("ckptkit save blocking time / DCP async_save blocking", block["vs_dcp"], ASYNC_VS_DCP, False)
        growth = block["rss_growth_bytes"]
        add("RSS growth over 10 saves after the first, MiB", None if growth is None else growth / (1 << 20), 64.0, False)
    s3 = results.get("s3")
    if s3 and "error" not in s3:
        add("ckptkit save to S3 throughput / boto3 upload_file", s3["save_vs_upload_file"], S3_VS_BOTO3, True)
        add("ckptkit load from S3 throughput / boto3 download_file", s3["load_vs_download_file"], S3_VS_BOTO3, True)
        r = s3["resharding"]
        add("S3 load-time reshard payload bytes read / box bytes", r["payload_bytes_read"] / r["box_bytes"], 1.0 + 1e-9, False)
    block = results.get("checksums")
    if block and "error" not in block:
        for key, what in (("save", "save"), ("load", "cold load"), ("load_sharded", "cold sharded load")):
            add(f"{what} throughput, block checksums / none", block["ratios"][key], CHECKSUM_COST, True)
        for name, variants in block["partial"].items():
            if name != "error" and "checked" in variants and name.endswith("of 4"):
                add(f"partial load ({name}) bytes read / needed", variants["checked"]["amplification"],
                    PARTIAL_READ_AMPLIFICATION + 1e-9, False)
    block = results.get("incremental")
    if block:
        for name, s in block["scenarios"].items():
            if "error" in s:
                continue
            if name in ("frozen", "rl-bf16", "rl-compact"):
                add(f"incremental {name}: value bytes written / changed", s["bytes_vs_changed"], INCREMENTAL_BYTES + 1e-9, False)
                add(f"incremental {name}: restore of newest / full", s["restore_vs_full"], INCREMENTAL_RESTORE + 1e-9, False)
            if name == "dense":
                add("incremental dense: save throughput / full", s["throughput_vs_full"], INCREMENTAL_THROUGHPUT, True)
        if block.get("encode"):
            add("incremental: finding changed bf16 / memcpy", block["encode"]["vs_memcpy"], INCREMENTAL_ENCODE, True)
    block = results.get("tier")
    if block:
        for source in ("memory", "peer"):
            add(f"tier: restart from {source} / floor", block["sources"][source]["vs_floor"], TIER_RESTART_VS_FLOOR + 1e-9, False)
        add("tier: memory snapshot stall / memcpy", block["stall_vs_memcpy"], TIER_STALL_VS_MEMCPY + 1e-9, False)
    plan = results.get("reshard_plan")
    if plan and "error" not in plan:
        add("reshard plan 4096 -> 2048 ranks seconds", plan["seconds"], RESHARD_PLAN_S, False)
    scale = results.get("scale")
    if scale and "error" not in scale:
        for stage in ("build_s", "validate_s", "serialize_s", "parse_s"):
            add(f"scale {stage.removesuffix('_s')} seconds", scale["median"][stage], SCALE_MAX_S, False)
        add("scale manifest JSON bytes", scale["median"]["json_bytes"], SCALE_MAX_JSON_BYTES, False)
    block = results.get("scale_131k")
    if block and "error" not in block:
        m = block["median"]
        add("scale 131k: manifest JSON bytes", m["json_bytes"], SCALE_131K_JSON_BYTES, False)
        add("scale 131k: parse seconds", m["parse_s"], SCALE_131K_PARSE_S, False)
        add("scale 131k: build seconds", m["build_s"], SCALE_131K_BUILD_S, False)
        add("scale 131k: one rank's load plan ms (max)", m["load_plan_max_ms"], SCALE_131K_LOAD_PLAN_MS, False)
        add("scale 131k: one rank's reshard plan ms (max)", m["reshard_plan_max_ms"], SCALE_131K_RESHARD_PLAN_MS, False)
    block = results.get("scale_ranks")
    if block and "error" not in block:
        add("scale ranks: load plan time, 64 / 8 ranks (max)", block["load_plan_growth"], SCALE_RANKS_GROWTH, False)
        add("scale ranks: save plan time, 64 / 8 ranks (max)", block["save_plan_growth"], SCALE_RANKS_GROWTH, False)
        add("scale ranks: plan memory, 64 / 8 ranks (max)", block["plan_memory_growth"], SCALE_RANKS_GROWTH, False)
        add("scale ranks: bytes read / blocks touched (max)", max(s["read_vs_blocks_max"] for s in block["sizes"].values()),
            1.0 + 1e-9, False)
    return rows
