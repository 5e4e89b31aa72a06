"""Sections of ``python -m bench`` for the parts beside delivery: run control, async, console.

- ``runctl``: claims of 100 draining a backlog with small payloads, with large
  ones stored by reference, and the same in the row (:func:`bench.runctl.large_section`);
  the claim with 1, 10 and 100 fairness keys holding backlogs; pausing and
  resuming a run with 10,000 pending effects.
- ``async``: steps per second through ``AsyncOutbox`` and ``Outbox``, 1 run and
  50 runs (:mod:`bench.async_steps`).
- ``console``: every console page's server time with 10,000 runs and 1,000,000
  effects loaded (:mod:`bench.console`; ``--quick``: a tenth of that).
- ``http``: steps posted to ``outbox serve`` beside ``run.transaction``, and the
  long poll (:mod:`bench.http_api`; its tables are drawn here).

Each runs in scratch databases of the run's one server, so its figures sit on
the generated page beside the others (they had a page of their own before).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import async_steps, console, runctl
from bench.harness import Bench, log
from bench.runctl_support import migrated, scratch


def _admin(bench: Bench) -> str:
    return bench.server.dsn("postgres")


def runctl_figures(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    reps, n = (1, 2_000) if quick else (3, 10_000)
    admin = _admin(bench)
    return {
        "large": runctl.large_section(admin, reps, n, 64 * 1024),
        "lanes": runctl.lanes_section(admin, reps),
        "pause": runctl.pause_section(admin, reps),
    }


def async_figures(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    seconds, reps = (2.0, 1) if quick else (5.0, 3)
    with scratch(_admin(bench), async_steps.DATABASE) as dsn:
        migrated(dsn)
        return {"seconds": seconds, "variants": async_steps.measure(dsn, seconds, reps)}


def console_figures(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    runs, repeat = (1_000, 5) if quick else (console.RUNS, 15)
    with scratch(_admin(bench), console.DATABASE) as dsn:
        migrated(dsn)
        log(f"console: loading {runs:,} runs and {runs * console.EFFECTS_PER_RUN:,} effects")
        loaded = console.load(dsn, runs=runs)
        pages = console.serve_and_measure(dsn, repeat)
    return {
        "runs": runs,
        "effects": runs * console.EFFECTS_PER_RUN,
        "load_s": loaded,
        "pages": pages,
    }


# -- the page -------------------------------------------------------------------------


def component_targets(t: Any, r: dict[str, Any]) -> None:
    """The targets these sections measure (``t``: :class:`bench.targets.Targets`)."""
    from bench.cells import get

    large = get(r, "runctl", "large") or {}
    if len(large) == 3:
        small, by_ref, _ = (_ms(large[k]["p50"]) for k in large)
        t.ratio(
            "run control: a claim of large payloads by reference ≤ 1.1x small ones",
            by_ref,
            small,
            1.1,
            "ms p50",
            most=True,
            of=list(large.values())[1].get("p50_vs_small"),
        )
    pages = get(r, "console", "pages") or []
    if pages:
        worst = max(p["max_ms"] for p in pages)
        slowest = max(pages, key=lambda p: p["max_ms"])["page"]
        shown = f"{worst:,.0f} ms at most ({slowest})"
        effects = get(r, "console", "effects") or 0
        target = f"console: every page under 300 ms at {effects:,} effects"
        t.add(target, worst, 300, shown, most=True)


LARGE = (
    "payloads=label | claim of 100: p50 ms=p50_ms:r2 | p99 ms=p99_ms:m2"
    " | row bytes (avg)=row_bytes_avg:m0 | outbox_effects MB=effects_table_mb:m1"
    " | outbox_blobs MB=blobs_table_mb:m1"
)
LANES = "lanes with a backlog=label | claim of 100: p50 ms=ms:r2"
PAUSE = "a run with 10,000 pending effects=label | median (min-max)=shown"
ASYNC = (
    "client=label | steps/s=steps_per_s:r0 | client CPU µs per step=client_cpu_us_per_step:m0"
    " | waiting for a CPU, s/s=cpu_wait_share:m2"
)
CONSOLE = "page=page | p50 ms=p50_ms:m1 | max ms=max_ms:m1"
HTTP = (
    "client threads=label | HTTP steps/s=http_steps_per_s:r0"
    " | run.transaction steps/s=direct_steps_per_s:r0 | HTTP / direct=ratio:r2"
)
LONG_POLL = (
    "effects=polls | ended while their poll waited=polls_that_waited"
    " | p50 ms=p50_ms:m0 | p95 ms=p95_ms:m0 | max ms=max_ms:m0"
)


def _ms(spread: dict[str, float]) -> dict[str, float]:
    return {k: 1000 * v for k, v in spread.items()}


def component_sections(r: dict[str, Any]) -> list[tuple[str, str, str, list[dict[str, Any]]]]:
    """Title, caption, columns and rows of each table these sections fill."""
    from bench.cells import get, rng

    out: list[tuple[str, str, str, list[dict[str, Any]]]] = []
    rc = r.get("runctl") or {}
    if large := rc.get("large"):
        rows = [
            {"label": k, **v, "p50_ms": _ms(v["p50"]), "p99_ms": _ms(v["p99"])}
            for k, v in large.items()
        ]
        out.append(
            (
                "Run control: claims of large payloads",
                "Claims of 100 draining the backlog.",
                LARGE,
                rows,
            )
        )
    if lanes := rc.get("lanes"):
        rows = [{"label": k, "ms": _ms(v)} for k, v in lanes.items()]
        out.append(("Run control: claims with many fairness keys", "", LANES, rows))
    if pause := rc.get("pause"):
        names = {
            "pause_s": "pause",
            "resume_s": "resume",
            "claim_p50_before": "another kind's claim of 100, p50, before the pause",
            "claim_p50_while_paused": "the same while the 10,000 are held",
        }
        rows = [{"label": text, "shown": rng(_ms(pause[k]), 2, " ms")} for k, text in names.items()]
        out.append(("Run control: pausing a run", "", PAUSE, rows))
    if variants := get(r, "async", "variants"):
        rows = [{"label": k, **v} for k, v in variants.items()]
        caption = f"`run.transaction` (state + one intent), {get(r, 'async', 'seconds')} s each."
        out.append(("Async and sync clients", caption, ASYNC, rows))
    if pages := get(r, "console", "pages"):
        c = r["console"]
        caption = (
            f"{c['runs']:,} runs, {c['effects']:,} effects; the page's own `Server-Timing`"
            " (request in → response headers), state-count cache off."
        )
        out.append(("Operator console", caption, CONSOLE, pages))
    if http := r.get("http"):
        rows = [{"label": k, **v} for k, v in http.items() if k.isdigit()]
        caption = (
            f"Steps with one intent, {http['seconds']} s each, {http['reps']} repetition(s);"
            " the ratio is each repetition's pair."
        )
        out.append(("HTTP API: steps over HTTP", caption, HTTP, rows))
        caption = "The effect's `completed_at` → the `/outcome?wait=30` answer's arrival."
        out.append(("HTTP API: the long poll", caption, LONG_POLL, [http["long_poll"]]))
    return out
