"""Run-control figures: claims before and after, large payloads, lanes, the write path.

    python -m bench.runctl [--only SECTIONS] [--baseline-ref main] [--reps 3] [--json PATH]

Sections (``--only`` takes a comma-separated list; ``large``, ``lanes`` and ``pause``
are also the ``runctl`` section of ``python -m bench``, and the fairness figures
its ``fairness`` section):

  claims     the plain claim (no priorities, one fairness key): p50/p99 of claims of 100
             and of 1 from a 30,000-effect backlog, this code beside a baseline's
  write      steps/s of one writer (``run.transaction``: state + one intent), beside a baseline
  large      claim p50/p99 draining 10,000 effects with small payloads, with large payloads
             stored by reference, and (to show what that buys) the same large payloads in
             the row; row and table sizes
  lanes      claim p50 with 1, 10 and 100 fairness keys holding backlogs (one probe per lane)
  pause      how long pausing and resuming a run with 10,000 pending effects takes, and the
             claim p50 of another run's backlog while they are held (paused rows leave the
             claim index, as in-flight ones do)

``--baseline-ref REF`` (or ``--baseline DIR`` holding an ``outbox`` package) runs the
``claims`` and ``write`` sections with that code too, each measurement in a child
process importing that ``outbox`` against a database that code migrated, interleaved
with this code's. Without a baseline those sections measure this code only.

With ``OUTBOX_DSN`` set it uses that server (scratch databases are created and
dropped); otherwise it starts an embedded PostgreSQL in a temporary directory with
default durability (fsync on) and removes it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from bench.runctl_support import (
    MB,
    REPO,
    backlog,
    claim_times,
    libpq,
    migrated,
    quantiles,
    scratch,
    spread,
)

SECTIONS = ("claims", "write", "large", "lanes", "pause")


# -- children: one measurement with whichever outbox package is importable --------------


def child_claims(dsn: str) -> dict[str, Any]:
    migrated(dsn)
    backlog(dsn, "bench.plain", 30_000)
    with psycopg.connect(libpq(dsn), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox_effects")
        conn.execute("CHECKPOINT")
    batch = claim_times(dsn, "bench.plain", 100, 200)
    single = claim_times(dsn, "bench.plain", 1, 200)
    return {"batch_100": quantiles(batch), "batch_1": quantiles(single)}


def child_write(dsn: str, seconds: float = 4.0) -> dict[str, Any]:
    from outbox import Outbox

    migrated(dsn)
    with Outbox.connect(dsn) as ob:
        run = ob.start_run("bench", "1", {})
        n = 0

        def step(tx: Any) -> None:
            tx.set_state({"n": n})
            tx.intend("bench.write", {"n": n})

        for _ in range(50):  # warm
            run.transaction(f"w{n}", step)
            n += 1
        started = time.perf_counter()
        count = 0
        while time.perf_counter() - started < seconds:
            run.transaction(f"s{n}", step)
            n += 1
            count += 1
        return {"steps_per_s": count / (time.perf_counter() - started)}


CHILDREN: dict[str, Callable[[str], dict[str, Any]]] = {
    "claims": child_claims,
    "write": child_write,
}


def in_child(section: str, dsn: str, baseline: Path | None) -> dict[str, Any]:
    """Run one measurement in a child process, with the baseline's ``outbox`` if given."""
    env = dict(os.environ)
    paths = [str(REPO)] if baseline is None else [str(baseline), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(
        [sys.executable, "-m", "bench.runctl", "--child", section, "--dsn", dsn],
        env=env,
        cwd=tempfile.gettempdir(),  # so REPO's outbox is not first on the path by accident
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {section} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def before_after(admin: str, section: str, baseline: Path | None, reps: int) -> dict[str, Any]:
    """``section`` measured ``reps`` times with this code (and the baseline's), interleaved."""
    variants = {"this": None} if baseline is None else {"this": None, "baseline": baseline}
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for rep in range(reps):
        for name, code in variants.items():
            with scratch(admin, f"bench_runctl_{section}") as dsn:
                got[name].append(in_child(section, dsn, code))
            print(f"  {section} rep {rep + 1} {name}: {got[name][-1]}", flush=True)
    return got


# -- large payloads ---------------------------------------------------------------------


def fill_payloads(dsn: str, kind: str, n: int, size: int, threshold: int) -> float:
    """``n`` effects of ``kind`` whose payloads are ``size`` bytes of distinct text."""
    from outbox import Outbox

    started = time.perf_counter()
    with Outbox.connect(dsn, blob_threshold_bytes=threshold) as ob:
        run = ob.start_run("bench", "1", {})
        per_step = 50
        for s in range(n // per_step):

            def step(tx: Any, s: int = s) -> None:
                for i in range(per_step):
                    body = os.urandom(size // 2).hex()[: size - 40]
                    tx.intend(kind, {"n": s * per_step + i, "body": body})

            run.transaction(f"fill-{s}", step)
    return time.perf_counter() - started


def sizes(dsn: str, kind: str) -> dict[str, float]:
    with psycopg.connect(libpq(dsn)) as conn:
        row = conn.execute(
            "SELECT avg(pg_column_size(e.*)), max(pg_column_size(e.*)) FROM outbox_effects e "
            "WHERE kind = %s",
            (kind,),
        ).fetchone()
        table = conn.execute(
            "SELECT pg_total_relation_size('outbox_effects'),"
            " pg_total_relation_size('outbox_blobs')"
        ).fetchone()
    assert row is not None and table is not None
    return {
        "row_bytes_avg": float(row[0]),
        "row_bytes_max": float(row[1]),
        "effects_table_mb": table[0] / MB,
        "blobs_table_mb": table[1] / MB,
    }


def warm(dsn: str) -> None:
    """Read the effects table and its claim index into shared buffers (each variant alike)."""
    with psycopg.connect(libpq(dsn), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
        conn.execute("SELECT count(*), sum(length(payload::text)) FROM outbox_effects")
        conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE status = 'pending' AND kind = 'bench.large'"
        )


def large_section(admin: str, reps: int, n: int, size: int) -> dict[str, Any]:
    """Claims draining ``n`` effects: small payloads, large ones by reference, large in the row.

    The variants take turns, one repetition each, so a machine that gets busier
    or quieter while this runs does not favour one of them.
    """
    variants = {
        "small payloads (100 B)": (100, 16 * 1024),
        f"large payloads ({size // 1024} KiB) by reference": (size, 16 * 1024),
        f"large payloads ({size // 1024} KiB) in the row": (size, 2 * size),
    }
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for _rep in range(reps):
        for name, (payload, threshold) in variants.items():
            with scratch(admin, "bench_runctl_large") as dsn:
                migrated(dsn)
                fill = fill_payloads(dsn, "bench.large", n, payload, threshold)
                warm(dsn)
                found = sizes(dsn, "bench.large")
                times = claim_times(dsn, "bench.large", 100, n // 100 - 5)
                got[name].append({"fill_seconds": fill, **found, **quantiles(times)})
                print(f"  large {name}: p50 {got[name][-1]['p50'] * 1000:.2f} ms", flush=True)
    out: dict[str, Any] = {}
    small = next(iter(got.values()))
    for name, runs in got.items():
        figures = [key for key in runs[0] if isinstance(runs[0][key], float)]
        out[name] = {key: spread([r[key] for r in runs]) for key in figures}
        # Each repetition's p50 over the small payloads' of the same turn: the pair a target judges.
        out[name]["p50_vs_small"] = spread(
            [r["p50"] / s["p50"] for r, s in zip(runs, small, strict=True)]
        )
    return out


# -- lanes ----------------------------------------------------------------------------------


def lanes_section(admin: str, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lanes in (1, 10, 100):
        p50s = []
        for _rep in range(reps):
            with scratch(admin, "bench_runctl_lanes") as dsn:
                migrated(dsn)
                per = max(2_000, 40_000 // lanes)
                for lane in range(lanes):
                    backlog(dsn, "bench.lanes", per, fairness_key=f"tenant-{lane:03d}")
                with psycopg.connect(libpq(dsn), autocommit=True) as conn:
                    conn.execute("VACUUM ANALYZE outbox_effects")
                p50s.append(quantiles(claim_times(dsn, "bench.lanes", 100, 150))["p50"])
        out[str(lanes)] = spread(p50s)
        print(f"  lanes {lanes}: p50 {out[str(lanes)]['median'] * 1000:.2f} ms", flush=True)
    return out


# -- pause ------------------------------------------------------------------------------------


def pause_section(admin: str, reps: int) -> dict[str, Any]:
    from outbox import Outbox

    got: list[dict[str, float]] = []
    for _rep in range(reps):
        with scratch(admin, "bench_runctl_pause") as dsn:
            migrated(dsn)
            backlog(dsn, "bench.other", 30_000)
            with Outbox.connect(dsn) as ob:
                run = ob.start_run("bench", "1", {})
                with psycopg.connect(libpq(dsn), autocommit=True) as conn:
                    conn.execute(
                        """INSERT INTO outbox_effects (id, shard, run_id, kind, payload,
                                  payload_hash, idempotency_key, status)
                           SELECT gen_random_uuid(), outbox_shard_of(%(run)s), %(run)s,
                                  'bench.held', '{}'::jsonb, 'x',
                                  md5(%(run)s::text || g::text), 'pending'
                             FROM generate_series(1, 10000) g""",
                        {"run": run.id},
                    )
                    conn.execute("VACUUM ANALYZE outbox_effects")
                before = quantiles(claim_times(dsn, "bench.other", 100, 50))["p50"]
                started = time.perf_counter()
                ob.pause(run.id, "bench")
                paused = time.perf_counter() - started
                during = quantiles(claim_times(dsn, "bench.other", 100, 50))["p50"]
                started = time.perf_counter()
                ob.resume(run.id)
                resumed = time.perf_counter() - started
            got.append(
                {
                    "pause_s": paused,
                    "resume_s": resumed,
                    "claim_p50_before": before,
                    "claim_p50_while_paused": during,
                }
            )
            print(f"  pause: {got[-1]}", flush=True)
    return {key: spread([g[key] for g in got]) for key in got[0]}


# -- report -----------------------------------------------------------------------------------


def ms(value: float) -> str:
    return f"{value * 1000:.2f}"


def render(results: dict[str, Any]) -> str:
    """The figures as the Markdown tables docs/performance.md shows."""
    lines: list[str] = []
    claims = results.get("claims")
    if claims:
        lines += [
            "| code | claim of 100: p50 ms | p99 ms | claim of 1: p50 ms | p99 ms |",
            "|---|---|---|---|---|",
        ]
        for name, reps in claims.items():
            b = spread([r["batch_100"]["p50"] for r in reps])
            b99 = spread([r["batch_100"]["p99"] for r in reps])
            one = spread([r["batch_1"]["p50"] for r in reps])
            one99 = spread([r["batch_1"]["p99"] for r in reps])
            lines.append(
                f"| {name} | {ms(b['median'])} ({ms(b['min'])}-{ms(b['max'])}) "
                f"| {ms(b99['median'])} | {ms(one['median'])} ({ms(one['min'])}-{ms(one['max'])}) "
                f"| {ms(one99['median'])} |"
            )
        if "baseline" in claims:
            this = statistics.median(r["batch_100"]["p50"] for r in claims["this"])
            base = statistics.median(r["batch_100"]["p50"] for r in claims["baseline"])
            lines.append(f"\nclaim of 100, this / baseline p50: {this / base:.2f}x")
        lines.append("")
    write = results.get("write")
    if write:
        lines += ["| code | steps/s (one writer) |", "|---|---|"]
        for name, reps in write.items():
            s = spread([r["steps_per_s"] for r in reps])
            lines.append(f"| {name} | {s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}) |")
        lines.append("")
    large = results.get("large")
    if large:
        lines += [
            "| payloads | claim of 100: p50 ms | p99 ms | row bytes (avg) | outbox_effects MB "
            "| outbox_blobs MB |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in large.items():
            lines.append(
                f"| {name} | {ms(r['p50']['median'])} ({ms(r['p50']['min'])}-"
                f"{ms(r['p50']['max'])}) | {ms(r['p99']['median'])} "
                f"| {r['row_bytes_avg']['median']:,.0f} | {r['effects_table_mb']['median']:,.1f} "
                f"| {r['blobs_table_mb']['median']:,.1f} |"
            )
        names = list(large)
        ratio = large[names[1]]["p50"]["median"] / large[names[0]]["p50"]["median"]
        lines.append(f"\nby reference / small, claim p50: {ratio:.2f}x")
        lines.append("")
    lanes = results.get("lanes")
    if lanes:
        lines += ["| lanes with a backlog | claim of 100: p50 ms |", "|---|---|"]
        for count, s in lanes.items():
            lines.append(f"| {count} | {ms(s['median'])} ({ms(s['min'])}-{ms(s['max'])}) |")
        lines.append("")
    pause = results.get("pause")
    if pause:

        def cell(key: str) -> str:
            f = pause[key]
            return f"{ms(f['median'])} ms ({ms(f['min'])}-{ms(f['max'])})"

        lines += [
            "| a run with 10,000 pending effects | median (min-max) |",
            "|---|---|",
            f"| pause | {cell('pause_s')} |",
            f"| resume | {cell('resume_s')} |",
            f"| another kind's claim of 100, p50, before the pause | {cell('claim_p50_before')} |",
            f"| the same while the 10,000 are held | {cell('claim_p50_while_paused')} |",
            "",
        ]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def baseline_dir(ref: str | None, path: Path | None, work: Path) -> Path | None:
    """A directory holding the baseline's ``outbox`` package (from ``git archive REF``)."""
    if path is not None:
        return path
    if ref is None:
        return None
    target = work / "baseline"
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "outbox"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.runctl", description=__doc__)
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline-ref", default=None, help="git ref to compare with (e.g. main)")
    parser.add_argument("--baseline", type=Path, default=None, help="dir with an outbox package")
    parser.add_argument("--large-effects", type=int, default=10_000)
    parser.add_argument("--large-bytes", type=int, default=64 * 1024)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dsn", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(CHILDREN[args.child](args.dsn)))
        return 0

    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    work = Path(tempfile.mkdtemp(prefix="outbox-bench-runctl-"))
    work.chmod(0o711)  # as root, the server runs as another user, who must enter it
    server = None
    admin = os.environ.get("OUTBOX_DSN")
    if not admin:
        from outbox.storage.admin.embedded import EmbeddedServer

        server = EmbeddedServer(work / "pg")
        admin = server.ensure_running()
    results: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
    try:
        baseline = baseline_dir(args.baseline_ref, args.baseline, work)
        results["meta"]["baseline"] = args.baseline_ref or (
            str(args.baseline) if args.baseline else None
        )
        with psycopg.connect(libpq(admin)) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            results["meta"]["postgresql"] = version[0] if version else None
        results["meta"]["load_before"] = os.getloadavg()
        for section in sections:
            print(f"{section}…", flush=True)
            if section in CHILDREN:
                results[section] = before_after(admin, section, baseline, args.reps)
            elif section == "large":
                results[section] = large_section(
                    admin, args.reps, args.large_effects, args.large_bytes
                )
            elif section == "lanes":
                results[section] = lanes_section(admin, args.reps)
            elif section == "pause":
                results[section] = pause_section(admin, args.reps)
        results["meta"]["load_after"] = os.getloadavg()
    finally:
        if server is not None:
            server.stop(mode="fast")
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(render(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
