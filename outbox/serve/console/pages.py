"""The console's pages and actions (server-rendered; one line of JavaScript at most).

Every read goes through ``Store.views`` (keyset pages by index) and every
action through the same client methods the CLI uses (``Outbox.resolve_effect``,
``retry_effect``, ``cancel``, ``approve_effect``, ``reject_effect``), so the
attempt log records who and why exactly as it does for ``outbox effects resolve``
and ``outbox runs cancel``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode
from uuid import UUID

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from outbox.errors import ApprovalRefused, NotFound, OutboxError, RunStateError, ValidationError
from outbox.governance.intent_rules import identifier_violation
from outbox.models import EffectStatus, RunStatus
from outbox.serve.console.auth import OPERATOR_KEY, ConsoleAuth, Operator, name_problem
from outbox.serve.console.present import (
    age,
    clip,
    delivery_chart,
    duration,
    last_pass,
    next_attempt,
    pretty,
    redact,
    shown,
)
from outbox.serve.ops import Cached, CachedCounts
from outbox.serve.transport import BODY_KEY

if TYPE_CHECKING:
    from outbox.client import Outbox

__all__ = ["Console"]

log = logging.getLogger("outbox.serve.console")

PAGE_SIZE = 50
#: Age filters of the runs list: label -> seconds.
AGES = {"1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
_TEMPLATES = Path(__file__).with_name("templates")
#: What the console says after an action (``?flash=``): its own words only, so a
#: link cannot make the console display a message of the sender's choosing.
FLASHES = frozenset({"resolved", "retrying", "approved", "rejected", "cancelled"})

Page = Callable[[Request], Any]


def _uuid(text: str) -> UUID | None:
    try:
        return UUID(text)
    except ValueError:
        return None


def _choice(value: str | None, allowed: Any) -> str | None:
    return value if value in {str(a) for a in allowed} else None


class Console:
    """The console of one Outbox: its pages, actions and templates."""

    def __init__(self, outbox: Outbox, auth: ConsoleAuth, counts: CachedCounts) -> None:
        self.outbox = outbox
        self.views = outbox.store.views
        self.auth = auth
        self.counts = counts
        self.deliveries = Cached(self.views.delivery_by_minute, counts.ttl)
        self.env = Environment(
            loader=FileSystemLoader(_TEMPLATES),
            autoescape=select_autoescape(["html"]),
            trim_blocks=True,
            lstrip_blocks=True,
            # Every text a page prints is redacted (last_error, cancel_reason, notes,
            # keys, ...), not only the fields a template remembered to filter.
            finalize=last_pass,
        )
        self.env.filters.update(
            age=age,
            clip=clip,
            duration=duration,
            next_attempt=next_attempt,
            pretty=pretty,
            redact=redact,
            shown=shown,
        )

    def checked(self, page: Page) -> Page:
        """``page`` behind the console's request checks.

        A query parameter holding a control character (a NUL would fail in
        PostgreSQL) is a 400 naming it. The session cookie is checked, then
        looked up among the signed-out ones, and the operator (or None) is left
        in the request for :meth:`ConsoleAuth.operator`.
        """

        async def checked_page(request: Request) -> Response:
            request.scope[OPERATOR_KEY] = None
            for name, value in request.query_params.multi_items():
                if identifier_violation(name + value, "query") is not None:
                    shown_name = ascii(name[:40])
                    return self.problem(
                        request,
                        400,
                        f"query parameter {shown_name} holds a control character "
                        "(NUL, CR, LF, ...)",
                    )
            session = self.auth.session(request)
            if session is not None and not await run_in_threadpool(
                self.views.session_revoked, session.revocation
            ):
                request.scope[OPERATOR_KEY] = session
            response: Response = await page(request)
            return response

        return checked_page

    # -- rendering ------------------------------------------------------------------

    def render(
        self, request: Request, template: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        """A page, with the CSRF token its forms need and who is signed in."""
        seed, new = self.auth.csrf_seed(request)
        operator = self.auth.operator(request)
        html = self.env.get_template(template).render(
            request=request,
            operator=operator,
            can_sign_in=self.auth.enabled,
            csrf=self.auth.csrf_token(seed),
            now=datetime.now(UTC),
            flash=_choice(request.query_params.get("flash"), FLASHES),
            **context,
        )
        response = HTMLResponse(html, status_code=status_code)
        response.headers["Content-Security-Policy"] = (
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
        )
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Cache-Control"] = "no-store"
        if new:
            self.auth.set_csrf_cookie(response, request, seed)
        return response

    def problem(self, request: Request, status: int, message: str) -> HTMLResponse:
        """An error page (the message is shown as text)."""
        return self.render(request, "problem.html", status_code=status, message=message)

    # -- pages ----------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        """Backlog by kind and status, oldest pending age, delivery over the last hour."""
        counts = await run_in_threadpool(self.counts.get)
        buckets = await run_in_threadpool(self.deliveries.get)
        minutes = [b for b in buckets if b["minute"] is not None]
        delivered = sum(int(b["delivered"]) for b in minutes)
        backlog: dict[str, dict[str, int]] = {}
        for (status, kind), n in sorted(counts.effects.items()):
            backlog.setdefault(kind, {})[status] = n
        return self.render(
            request,
            "overview.html",
            backlog=backlog,
            open_total=sum(counts.effects.values()),
            unknown_total=sum(
                n for (s, _), n in counts.effects.items() if s == EffectStatus.UNKNOWN.value
            ),
            statuses=[
                s.value
                for s in (
                    EffectStatus.PENDING,
                    EffectStatus.IN_FLIGHT,
                    EffectStatus.DISPATCHED,
                    EffectStatus.UNKNOWN,
                )
            ],
            runs=counts.runs,
            oldest_pending=counts.oldest_pending_seconds,
            delivered=delivered,
            rate=delivered / 60.0,
            p95=max((float(b["p95"]) for b in minutes if b["p95"] is not None), default=None),
            chart=delivery_chart(minutes),
        )

    async def runs(self, request: Request) -> Response:
        """Runs, newest first, filtered; a search box for a run id or an idempotency key."""
        q = request.query_params
        found = None
        if q.get("q"):
            found = await run_in_threadpool(self.views.find, q["q"])
            if found is not None:
                return RedirectResponse(f"/console/{found[0]}s/{found[1]}", status_code=303)
        filters: dict[str, Any] = {
            "agent": q.get("agent") or None,
            "version": q.get("version") or None,
            "status": _choice(q.get("status"), RunStatus),
            "newer_than_s": AGES.get(q.get("newer", "")),
            "older_than_s": AGES.get(q.get("older", "")),
        }
        try:
            page = await run_in_threadpool(
                lambda: self.views.runs(**filters, cursor=q.get("cursor") or None, limit=PAGE_SIZE)
            )
        except ValueError:
            return self.problem(request, 400, "bad cursor: start from the first page")
        return self.render(
            request,
            "runs.html",
            page=page,
            query=q,
            searched=q.get("q"),
            statuses=[s.value for s in RunStatus],
            ages=list(AGES),
            next_url=_next_url(request, page.next_cursor),
        )

    async def run(self, request: Request) -> Response:
        """One run: steps, state and plan, budget ledger, signals, effects; cancel."""
        run_id = _uuid(request.path_params["run_id"])
        detail = None if run_id is None else await run_in_threadpool(self.views.run, run_id)
        if detail is None:
            return self.problem(request, 404, "no such run")
        return self.render(request, "run.html", d=detail, live=detail.run.status in _CANCELLABLE)

    async def effects(self, request: Request) -> Response:
        """Effects, newest first, by status and kind."""
        q = request.query_params
        status = _choice(q.get("status"), EffectStatus)
        kind = q.get("kind") or None
        try:
            page = await run_in_threadpool(
                lambda: self.views.effects(
                    status=status, kind=kind, cursor=q.get("cursor") or None, limit=PAGE_SIZE
                )
            )
        except ValueError:
            return self.problem(request, 400, "bad cursor: start from the first page")
        return self.render(
            request,
            "effects.html",
            page=page,
            query=q,
            statuses=[s.value for s in EffectStatus],
            next_url=_next_url(request, page.next_cursor),
        )

    async def effect(self, request: Request) -> Response:
        """One effect: payload (redacted), key, ordering key, attempt log, lease, compensation."""
        effect_id = _uuid(request.path_params["effect_id"])
        found = None if effect_id is None else await run_in_threadpool(self.views.effect, effect_id)
        if found is None:
            return self.problem(request, 404, "no such effect")
        effect, attempts, compensations = found
        return self.render(
            request, "effect.html", e=effect, attempts=attempts, compensations=compensations
        )

    async def queue(self, request: Request) -> Response:
        """The ``unknown`` queue (resolve), ``failed`` effects (retry), held effects (review)."""
        q = request.query_params
        try:
            unknown = await run_in_threadpool(
                lambda: self.views.queue(
                    EffectStatus.UNKNOWN, cursor=q.get("unknown_after") or None, limit=PAGE_SIZE
                )
            )
            failed = await run_in_threadpool(
                lambda: self.views.queue(
                    EffectStatus.FAILED, cursor=q.get("failed_after") or None, limit=PAGE_SIZE
                )
            )
            held = await run_in_threadpool(
                lambda: self.views.queue(
                    EffectStatus.AWAITING_APPROVAL,
                    cursor=q.get("held_after") or None,
                    limit=PAGE_SIZE,
                )
            )
        except ValueError:
            return self.problem(request, 400, "bad cursor: start from the first page")
        return self.render(
            request,
            "queue.html",
            unknown=unknown,
            failed=failed,
            unknown_next=_next_url(request, unknown.next_cursor, "unknown_after"),
            failed_next=_next_url(request, failed.next_cursor, "failed_after"),
            held=held,
            held_next=_next_url(request, held.next_cursor, "held_after"),
        )

    async def versions(self, request: Request) -> Response:
        """Unfinished runs per agent version: a version with none can retire."""
        rows = await run_in_threadpool(self.views.versions)
        versions: dict[tuple[str, str], dict[str, int]] = {}
        for row in rows:
            versions.setdefault((row["agent"], row["agent_version"]), {})[row["status"]] = int(
                row["runs"]
            )
        return self.render(request, "versions.html", versions=versions)

    # -- signing in -------------------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        """The sign-in form (operator credential and a name for the attempt log)."""
        return self.render(request, "login.html", next=_safe_next(request.query_params.get("next")))

    async def login(self, request: Request) -> Response:
        """Check the credential; start a session."""
        form = _form(request)
        refusal = self.auth.csrf_refusal(request, form.get("csrf"))
        if refusal is not None:
            return self.problem(request, 403, refusal)
        name = form.get("name", "").strip()
        if not self.auth.enabled:
            return self.problem(
                request, 403, "this console is read-only: no operator credential is configured"
            )
        if not self.auth.credentials.is_operator(form.get("token", "")):
            # %a: whatever the name holds, it stays on one line of the log.
            log.warning("console: a sign-in with a wrong credential (name %a)", name[:100])
            return self.render(
                request, "login.html", status_code=403, error="wrong credential", next="/console/"
            )
        problem = name_problem(name)
        if problem is not None:
            return self.render(
                request, "login.html", status_code=400, error=problem, next="/console/"
            )
        response = RedirectResponse(_safe_next(form.get("next")), status_code=303)
        self.auth.sign_in(response, request, name)
        return response

    async def logout(self, request: Request) -> Response:
        """End the session: revoked in the database, so a copy of the cookie is worthless."""
        refusal = self.auth.csrf_refusal(request, _form(request).get("csrf"))
        if refusal is not None:
            return self.problem(request, 403, refusal)
        session = self.auth.session(request)
        if session is not None:
            await run_in_threadpool(
                self.views.revoke_session, session.revocation, session.expires_at
            )
        response = RedirectResponse("/console/", status_code=303)
        self.auth.sign_out(response)
        return response

    # -- actions ----------------------------------------------------------------------

    async def resolve(self, request: Request) -> Response:
        """Resolve an ``unknown`` effect as succeeded, retry or failed, with a note."""
        return await self._act(
            request,
            lambda op, form, eid: self.outbox.resolve_effect(
                eid, outcome=form.get("outcome", ""), note=form.get("note", ""), operator=op.who
            ),
            "resolved",
        )

    async def retry(self, request: Request) -> Response:
        """Put a ``failed`` effect back to pending (same key), with a note."""

        def retry(op: Operator, form: dict[str, str], eid: UUID) -> Any:
            note = form.get("note", "")
            if not note.strip():
                raise ValidationError("note", note, "say why (it is kept in the attempt log)")
            return self.outbox.retry_effect(eid, operator=op.who, note=note)

        return await self._act(request, retry, "retrying")

    async def approve(self, request: Request) -> Response:
        """Release an effect held for approval: the form names the digest of the payload shown."""

        def approve(op: Operator, form: dict[str, str], eid: UUID) -> Any:
            return self.outbox.approve_effect(
                eid,
                digest=form.get("digest", ""),
                note=_note(form, "say why it may happen (kept in the attempt log)"),
                by=op.who,
                via="console",
            )

        return await self._act(request, approve, "approved")

    async def reject(self, request: Request) -> Response:
        """End an effect held for approval as rejected (bound to the digest shown, too)."""

        def reject(op: Operator, form: dict[str, str], eid: UUID) -> Any:
            return self.outbox.reject_effect(
                eid,
                digest=form.get("digest") or None,
                note=_note(form, "say why it must not happen (kept in the attempt log)"),
                by=op.who,
                via="console",
            )

        return await self._act(request, reject, "rejected")

    async def cancel(self, request: Request) -> Response:
        """Cancel a run (its pending effects are cancelled, then compensation runs)."""
        form_run = request.path_params["run_id"]

        def cancel(op: Operator, form: dict[str, str], _: UUID) -> Any:
            reason = form.get("note", "")
            if not reason.strip():
                raise ValidationError("note", reason, "say why the run is cancelled")
            return self.outbox.cancel(form_run, reason, by=op.who, via="console")

        return await self._act(request, cancel, "cancelled", param="run_id", page="runs")

    async def _act(
        self,
        request: Request,
        action: Callable[[Operator, dict[str, str], UUID], Any],
        done: str,
        *,
        param: str = "effect_id",
        page: str = "effects",
    ) -> Response:
        form = _form(request)
        refusal = self.auth.csrf_refusal(request, form.get("csrf"))
        if refusal is not None:
            log.warning("console: %s %s refused: %s", request.method, request.url.path, refusal)
            return self.problem(request, 403, refusal)
        operator = self.auth.operator(request)
        if operator is None:
            return self.problem(
                request,
                403,
                "sign in with the operator credential to act (the console is read-only)",
            )
        target = _uuid(request.path_params[param])
        if target is None:
            return self.problem(request, 404, "no such " + param.removesuffix("_id"))
        try:
            await run_in_threadpool(action, operator, form, target)
        except NotFound as exc:
            return self.problem(request, 404, str(exc))
        except ApprovalRefused as exc:
            # refused, and the refusal is in the attempt log (wrong digest, decided, too late)
            return self.problem(request, 409, str(exc))
        except (ValidationError, RunStateError) as exc:
            return self.problem(request, 409 if isinstance(exc, RunStateError) else 400, str(exc))
        except OutboxError as exc:
            log.warning("console action failed: %s", exc)
            return self.problem(request, 500, "the action failed; nothing was changed")
        log.info("console: %s %s %s by %s", done, param.removesuffix("_id"), target, operator.who)
        back = _safe_next(form.get("next")) if form.get("next") else f"/console/{page}/{target}"
        sep = "&" if "?" in back else "?"
        return RedirectResponse(f"{back}{sep}{urlencode({'flash': done})}", status_code=303)


_CANCELLABLE = {RunStatus.RUNNABLE, RunStatus.RUNNING, RunStatus.WAITING}


def _note(form: dict[str, str], why: str) -> str:
    note = form.get("note", "")
    if not note.strip():
        raise ValidationError("note", note, why)
    return note


def _form(request: Request) -> dict[str, str]:
    """The url-encoded form of a POST (already read, size-bounded, by BodyLimit)."""
    body: bytes = request.scope.get(BODY_KEY, b"")
    try:
        fields = parse_qs(body.decode(), max_num_fields=50)
    except (UnicodeDecodeError, ValueError):
        return {}
    return {k: v[0] for k, v in fields.items()}


def _safe_next(target: str | None) -> str:
    """A redirect target inside the console only (no open redirect)."""
    if target and target.startswith("/console/") and "//" not in target and "\\" not in target:
        return target
    return "/console/"


def _next_url(request: Request, cursor: str | None, name: str = "cursor") -> str | None:
    if cursor is None:
        return None
    params = dict(request.query_params)
    params.pop("flash", None)
    params[name] = cursor
    return f"{request.url.path}?{urlencode(params)}"
