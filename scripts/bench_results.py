"""What `bench_peers.py` concludes from its systems' rank reports: table rows, each system's
step time (its slowest rank's), the median round, the pairing of rounds and the census.

A rank's report is the dict its worker wrote (`step_s`, `cpu_s`, `losses`, `rss_mib`,
`gpu_mib`, `bubble`, `census`); a system's run is the list of its ranks' reports.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["census_lines", "cpu_time", "fastest", "median_round", "paired", "slowest",
           "table_row", "verdict"]  # fmt: skip


def table_row(
    name: str, results: list[dict[str, Any]], tokens: int, best: float, reference: list[float]
) -> str:
    """One system's row: its step time, tokens/s, meshpipe's best ÷ it, each rank's CPU time
    and peak memory (CUDA allocated where it ran on GPUs, else RSS), its minor page faults a
    step in thousands (where reported), its bubble, and whether
    its losses match the reference's (`reference`: the single process's; none: not run)."""
    step = slowest(results)
    losses = next(r["losses"] for r in reversed(results) if r["losses"][0] == r["losses"][0])
    if not reference:
        match = "– (no single-1t in this run)"
    elif all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, reference, strict=True)):
        match = "yes"
    else:
        match = "NO"
    bubble = results[0]["bubble"]
    peaks = ", ".join(f"{r.get('gpu_mib') or r['rss_mib']:.0f}" for r in results)
    cpu = ", ".join(f"{r['cpu_s']:.3f}" for r in results)
    faults = ", ".join(
        "–" if r.get("faults") is None else f"{r['faults'] / 1e3:.1f}" for r in results
    )
    return (
        f"| {name} | {step:.3f} | {tokens / step:,.0f} | {best / (tokens / step):.2f} | {cpu} "
        f"| {peaks} | {faults} | {'–' if bubble is None else f'{bubble:.1%}'} | {match} |"
    )


def slowest(ranks: list[dict[str, Any]]) -> float:
    """A system's step time: its slowest rank's (the pipeline runs at that pace)."""
    return max(r["step_s"] for r in ranks)


def fastest(ok: dict[str, list[dict[str, Any]]], prefix: str) -> str | None:
    """The fastest system whose name starts with `prefix` (None if there is none)."""
    names = [n for n in ok if n.startswith(prefix)]
    return min(names, key=lambda n: slowest(ok[n])) if names else None


def cpu_time(ranks: list[dict[str, Any]]) -> float:
    """A system's CPU time per step, every rank's together: the work it did."""
    return sum(r["cpu_s"] for r in ranks)


def median_round(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The round whose slowest rank has the median step time (rounds sorted by it)."""
    ordered = sorted(rounds, key=slowest)
    return ordered[(len(ordered) - 1) // 2]


SAME_SCHEDULE = {
    "meshpipe-gpipe": "torch-ScheduleGPipe",
    "meshpipe-1f1b": "torch-Schedule1F1B",
    "meshpipe-interleaved_1f1b": "torch-ScheduleInterleaved1F1B",
    "meshpipe-zb_v": "torch-ScheduleZBVZeroBubble",
    "meshpipe-dualpipe_v": "torch-ScheduleDualPipeV",
}
"""meshpipe's schedules and torch's implementations of the same ones."""


def paired(
    rounds: dict[str, list[list[dict[str, Any]]]], ok: dict[str, list[dict[str, Any]]]
) -> list[str]:
    """meshpipe's best against DeepSpeed and torch's best, then each meshpipe schedule against
    torch's same schedule, round by round: rounds run round-robin, so a round's systems ran
    minutes apart and share the machine's drift."""
    best = fastest(ok, "meshpipe")
    matches = [(best, peer) for peer in ("deepspeed-PipelineEngine", fastest(ok, "torch"))]
    lines: list[str] = []
    for ours, peer in dict.fromkeys([*matches, *SAME_SCHEDULE.items()]):
        if ours is None or ours not in ok or peer not in ok:
            continue
        pairs = list(zip(rounds[ours], rounds[peer], strict=False))
        for what, measure in (("s/step", slowest), ("CPU s/step of all ranks", cpu_time)):
            ratios = [measure(theirs) / measure(mine) for mine, theirs in pairs]
            listed = ", ".join(f"{r:.3f}" for r in ratios)
            lines.append(f"- {peer} ÷ {ours}, {what}, paired by round: {listed} "
                         f"(median {statistics.median(ratios):.3f}×)")  # fmt: skip
    return lines


def verdict(ok: dict[str, list[dict[str, Any]]], pipeline_ranks: int = 2) -> list[str]:
    """The issue's targets, measured in this run: ratios of step times, memory per rank."""
    step = {n: slowest(ranks) for n, ranks in ok.items()}
    best, top = fastest(ok, "meshpipe"), fastest(ok, "torch")
    if best is None:
        return []
    lines = [f"- meshpipe's best: {best} ({step[best]:.3f} s/step)"]
    if "deepspeed-PipelineEngine" in step:
        lines.append(
            f"- vs DeepSpeed PipelineEngine: {step['deepspeed-PipelineEngine'] / step[best]:.3f}×"
        )
        ds_rss = [r["rss_mib"] for r in ok["deepspeed-PipelineEngine"]]
        our_rss = [r["rss_mib"] for r in ok[best]]
        lines.append(f"- peak RSS per rank: {our_rss} MiB vs DeepSpeed's {ds_rss} MiB")
    if top is not None:
        lines.append(
            f"- vs the best torch.distributed.pipelining ({top}): {step[top] / step[best]:.3f}×"
        )
    limits = (
        ("single-1t", f"physical limit (single-1t / {pipeline_ranks})", pipeline_ranks),
        ("single-1t-pair", "two busy cores' limit (single-1t-pair / 2)", 2),
    )
    for name, label, ways in limits:
        if name in step:
            lines.append(f"- {label}: {step[name] / ways:.3f} s/step; meshpipe's best reaches "
                         f"{step[name] / ways / step[best]:.1%} of it")  # fmt: skip
    return lines


def census_lines(ok: dict[str, list[dict[str, Any]]]) -> list[str]:
    """meshpipe's best against torch's best, rank by rank: the aten ops whose calls or output
    bytes differ, and how many ops ran the same."""
    best, peer = fastest(ok, "meshpipe"), fastest(ok, "torch")
    if best is None or peer is None:
        return []
    lines = [f"- aten ops of one step, {best} against {peer} (calls, MiB of outputs):"]
    for rank, (ours, theirs) in enumerate(zip(ok[best], ok[peer], strict=True)):
        mine, other = ours["census"], theirs["census"]
        same = [op for op in mine if mine[op] == other.get(op)]
        lines.append(f"  - rank {rank}: {len(same)} ops alike ({sum(mine[op][0] for op in same)} "
                     f"calls); differing:")  # fmt: skip
        for op in sorted(set(mine) | set(other)):
            a, b = mine.get(op, [0, 0]), other.get(op, [0, 0])
            if a != b:
                lines.append(f"    - {op}: {a[0]} vs {b[0]} calls, "
                             f"{a[1] / 2**20:.1f} vs {b[1] / 2**20:.1f} MiB")  # fmt: skip
    return lines
