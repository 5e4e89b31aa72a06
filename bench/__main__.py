"""Every benchmark of agent-outbox, side by side on one PostgreSQL: ``python -m bench``.

One process starts one embedded PostgreSQL (default durability: fsync on) in
a temporary directory and runs these sections in this order (``--only``
picks some; ``--quick`` shrinks each one):

  baseline       pure-SQL SKIP LOCKED claim 100 + complete loop (the limit)
  daemon         DeliveryDaemon in-process, no-op sink, backlogs 500 and 20k
  processes      one and two `outbox deliver` processes, no-op python.call sink
  procrastinate  one Procrastinate worker draining as many no-op jobs
  latency        commit -> handler start at 100/s, beside Procrastinate's
  fairness       a trickle of one fairness key, and of one kind, beside a 50k backlog
  write          run.transaction (1 intent) vs a bare insert, 1/4/8 writers
  pgbench        the floor: the same work in SQL, 1/4/8 clients
  dbos           DBOS Transact no-op two-step workflows, 1 and 8 threads
  recovery       kill -9 of a deliverer holding effects -> all redelivered
  memory         peak RSS of a deliverer draining 1k vs 1M effects
  scale          claims with 10k/1M/10M finished rows; `outbox gc` retention
  stream         stream mode (relay + Kafka) vs poll mode, same processes
  runctl         claims of large payloads, of many fairness keys; pausing a run
  async          steps/s through AsyncOutbox and Outbox, 1 and 50 runs
  console        every console page's server time at 1M effects
  http           steps posted to `outbox serve` vs run.transaction; the long poll
  citus          steps and deliveries on a Citus cluster vs a plain server, same binaries

It prints the targets, writes every figure as JSON (``--json``, by default
bench/results/last.json) and the page (``--report``; by default
docs/performance.md after a full run). The full run
takes about 45 minutes on a 2-core machine, ``--quick`` about 10. Run it on a
quiet machine: each section records how much CPU other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import (
    citus,
    components,
    delivery,
    fairness,
    http_api,
    latency,
    memory,
    recovery,
    report,
    scale,
    stream,
    write,
)
from bench.harness import REPO, Bench, ForeignCpu, importable, log, machine_info

Section = Callable[[Bench, Path, bool], dict[str, Any]]
SECTIONS: dict[str, Section] = {
    "baseline": delivery.baseline,
    "daemon": delivery.daemon,
    "processes": delivery.deliverer_processes,
    "procrastinate": delivery.procrastinate,
    "latency": latency.latency,
    "fairness": fairness.fairness,
    "write": write.write,
    "pgbench": write.pgbench,
    "dbos": write.dbos,
    "recovery": recovery.recovery,
    "memory": memory.memory,
    "scale": scale.scale,
    "stream": stream.stream,
    "runctl": components.runctl_figures,
    "async": components.async_figures,
    "console": components.console_figures,
    "http": http_api.http,
    "citus": citus.citus,
}
#: Sections that need a package of the bench extra.
NEEDS = {"procrastinate": "procrastinate", "dbos": "dbos"}
PG_STAT_STATEMENTS = {
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_planning": "on",
}
PAGE = REPO / "docs" / "performance.md"
LAST = REPO / "bench" / "results" / "last.json"  # kept (git-ignored), to re-render with --render


def top_statements(bench: Bench) -> list[dict[str, Any]]:
    """The 12 statements that took most server time since the last call; then reset."""
    rows = bench.rows(
        "SELECT calls, mean_exec_time, total_plan_time / calls, rows::float8 / calls,"
        " wal_bytes::float8 / calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 160)"
        " FROM pg_stat_statements WHERE calls > 0"
        " ORDER BY total_exec_time + total_plan_time DESC LIMIT 12"
    )
    bench.value("SELECT pg_stat_statements_reset()")
    names = ("calls", "mean_exec_ms", "mean_plan_ms", "rows_per_call", "wal_bytes_per_call")
    return [dict(zip((*names, "query"), row, strict=True)) for row in rows]


def run(bench: Bench, chosen: list[str], quick: bool, profile: bool) -> dict[str, Any]:
    """Each chosen section in turn; one that fails or cannot run is noted, not fatal."""
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    foreign: dict[str, float] = {}
    durations: dict[str, float] = {}
    workdir = bench.home / "work"
    workdir.mkdir(exist_ok=True)
    others = ForeignCpu(bench.server.pgdata)
    for name in (s for s in SECTIONS if s in chosen):
        if name in NEEDS and (why := importable(NEEDS[name])):
            skipped[name] = f"not installed ({why}): pip install -e '.[bench]'"
            continue
        log(f"section {name}")
        if profile:
            top_statements(bench)
        others.mark()
        began = time.perf_counter()
        try:
            results[name] = SECTIONS[name](bench, workdir, quick)
        except Exception as exc:  # one broken section must not lose the others
            log(f"section {name} FAILED: {exc!r}")
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"[-4000:]
            continue
        seconds = time.perf_counter() - began
        foreign[name] = others.since_mark() / seconds
        durations[name] = seconds
        if profile:
            results[name]["top_statements"] = top_statements(bench)
        if foreign[name] > report.DISTURBED:
            log(f"WARNING: other processes used {foreign[name]:.0%} of a CPU meanwhile")
    meta = {"foreign_cpu_share_by_section": foreign, "section_seconds": durations}
    return {"results": results, "skipped": skipped, "meta": meta}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", nargs="+", metavar="SECTION", help="run only these sections")
    parser.add_argument("--quick", action="store_true", help="smaller and fewer repetitions")
    parser.add_argument(
        "--json", metavar="PATH", default=str(LAST), help=f"every figure as JSON (default: {LAST})"
    )
    parser.add_argument(
        "--report",
        metavar="PATH",
        help=f"write the page to PATH (default after a full run: {PAGE})",
    )
    parser.add_argument(
        "--pg-stat-statements",
        action="store_true",
        help="record each section's top statements (a profiling aid: adds overhead)",
    )
    parser.add_argument("--render", metavar="JSON", help="measure nothing: render a saved run")
    args = parser.parse_args(args_list)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        Path(args.report or PAGE).write_text(report.markdown(data))
        print(report.summary_text(data))
        return 0
    chosen = [s for item in args.only or SECTIONS for s in item.split(",") if s]
    if unknown := sorted(set(chosen) - set(SECTIONS)):
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    page = Path(args.report) if args.report else None
    if page is None and not args.quick and not args.only:
        page = PAGE
    home = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    home.chmod(0o711)  # as root, the server runs as another user, who must enter it
    bench = Bench(home, PG_STAT_STATEMENTS if args.pg_stat_statements else None)
    began = time.perf_counter()
    try:
        log(f"starting PostgreSQL in {home}")
        bench.start()
        if args.pg_stat_statements:
            bench.value("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        meta = machine_info(bench)
        outcome = run(bench, chosen, args.quick, args.pg_stat_statements)
    finally:
        bench.stop()
        shutil.rmtree(home, ignore_errors=True)
    meta.update(
        command=" ".join(["python -m bench", *map(shlex.quote, args_list)]),
        suite="quick" if args.quick else "default",
        seconds=time.perf_counter() - began,
        loadavg_after=os.getloadavg(),
        **outcome.pop("meta"),
    )
    data = {"meta": meta, **outcome}
    print(report.summary_text(data))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=2, default=str) + "\n")
    if page is not None:
        page.write_text(report.markdown(data))
        log(f"wrote {page}")
    failed = [name for name, why in outcome["skipped"].items() if why.startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
