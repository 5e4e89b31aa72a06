"""The tamper-evident record: hash chains over steps and attempt logs, and signed run records.

PostgreSQL computes each link as the row is written (``storage/functions/chain.sql``
says where); this module recomputes them from the rows, with the same
algorithm, for ``outbox audit verify`` and for a run record exported by
``outbox audit export``:

- ``lp(v)``: ``"~"`` for null, else ``"<UTF-8 byte length>:<v>"``; ``us(t)``: a
  timestamp as integer microseconds since the Unix epoch (as text, through ``lp``);
- a run's chain starts at ``sha256("outbox.run.v1" lp(id) lp(agent) lp(inputs_hash))``;
  each completed step is ``sha256(prev + "outbox.step.v3" lp(run_id) lp(step_id)
  lp(kind) lp(status) lp(result) lp(error) lp(state) lp(plan) lp(us(completed_at))
  + intents)``, in the order steps completed, where the values are their own text
  (a large one read back from its reference) and ``intents`` is, for each effect
  the step created in ``step_index`` order, ``lp(id) lp(idempotency_key) lp(kind)
  lp(payload_hash)``: a deleted, added or rewritten intent breaks the step's link.
  The run's ``step_head`` is the last. Steps chained before migration 0023 are
  ``"outbox.step.v2"`` links (the texts as stored, no intents) and before 0021
  ``"outbox.step.v1"`` (no status, state or plan either): a step links when any
  version matches its hash (no edit passes as another version: the messages
  differ). A step that is not waiting must have a hash (a step is chained when it
  completes);
- an effect's chain starts at ``sha256("outbox.effect.v1" lp(id) lp(run_id) lp(kind)
  lp(idempotency_key) lp(payload_hash))``; each attempt-log row, in id order, is
  ``sha256(prev + "outbox.attempt.v2" lp(effect_id) lp(attempt) lp(worker)
  lp(us(started_at)) lp(us(finished_at)) lp(outcome) lp(detail_text)
  lp(effect_status) lp(result_hash))``, where ``effect_status`` and ``result_hash``
  (the sha256 of its ``result_text``) are where the effect stood once the row was
  logged (rows logged before migration 0023: ``"outbox.attempt.v1"``, without
  those two). So an effect's newest link covers its status and result: a terminal
  effect whose status or result is not what its newest row recorded, one with no
  row at all, or an ``attempt`` counter above its rows is a break;
- ``*_text`` is PostgreSQL's rendering of the stored ``jsonb`` (a record carries it
  beside the parsed value); ``payload_hash`` and ``inputs_hash`` are the sha256 of
  the value's own text (``payload_text``; since migration 0023, as the write
  functions compute them), or of the canonical JSON (sorted keys, no spaces,
  UTF-8) for values written before.

Effects written outside any run (``Outbox.transaction``) have the same
attempt-log chains; :func:`verify_effect` checks one, as ``outbox audit verify``
does for them when no run is named.

A record is signed with Ed25519 (the optional ``cryptography`` package: ``pip
install 'agent-outbox[audit]'``) over its canonical JSON without ``signature``;
anyone holding the public key can check it, no secret needed. ``docs/reference/audit.md``
has an independent verifier of a few dozen lines.

Values stored by reference (:mod:`outbox.blobs`) are checked apart from the
chains: :func:`value_breaks` names every referenced blob whose text does not hash
to its sha256. ``docs/reference/audit.md`` lists exactly what is and is not
detected. A signed export fixes the record at export time: keep it elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from outbox.blobs import reference_hash
from outbox.payloads import content_hash

__all__ = [
    "RECORD_FORMAT",
    "STEP_VALUES",
    "Break",
    "attempt_hash",
    "canonical",
    "effect_genesis",
    "lp",
    "run_genesis",
    "step_hash",
    "step_intents",
    "stored_values",
    "us",
    "value_breaks",
    "verify_effect",
    "verify_record",
]

#: v4 (migration 0023): steps carry their values' own texts, effects their payload's
#: and result's texts and attempt counters, attempt-log rows the effect's status and
#: result digest. A v1, v2 or v3 record still verifies.
RECORD_FORMAT = "agent-outbox.run-record.v4"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def lp(value: str | None) -> str:
    """Length-prefixed text (so no two field sequences hash alike); ``~`` for null."""
    return "~" if value is None else f"{len(value.encode())}:{value}"


def us(when: datetime | None) -> int | None:
    """A timestamp as integer microseconds since the Unix epoch (exact)."""
    return None if when is None else (when - _EPOCH) // timedelta(microseconds=1)


def _text(value: int | None) -> str | None:
    return None if value is None else str(value)


def _sha(prev: bytes, message: str) -> bytes:
    return hashlib.sha256(prev + message.encode()).digest()


def run_genesis(run_id: str, agent: str, inputs_hash: str) -> bytes:
    """Where a run's step chain starts."""
    return _sha(b"", "outbox.run.v1" + lp(run_id) + lp(agent) + lp(inputs_hash))


def step_hash(
    prev: bytes,
    step: Mapping[str, Any],
    run_id: str,
    *,
    version: int = 3,
    intents: Sequence[Mapping[str, Any]] = (),
) -> bytes:
    """The link of one completed step (``result_text``, ``error_text``, ``completed_us``).

    Version 3 (since migration 0023) hashes the values' own texts
    (``<field>_value_text``) and the ``intents`` the step created (effects, in
    ``step_index`` order); version 2 (since 0021) the texts as stored with
    ``status``, ``state_text`` and ``plan_text``; version 1 without those.
    """
    if version >= 3:
        fields = [
            run_id,
            step["step_id"],
            step["kind"],
            step["status"],
            *(step.get(f"{f}_value_text", step.get(f"{f}_text")) for f in STEP_VALUES),
            _text(step["completed_us"]),
        ]
        created = "".join(
            lp(e["id"]) + lp(e["idempotency_key"]) + lp(e["kind"]) + lp(e["payload_hash"])
            for e in intents
        )
        return _sha(prev, "outbox.step.v3" + "".join(lp(f) for f in fields) + created)
    v2 = version >= 2
    fields = [
        run_id,
        step["step_id"],
        step["kind"],
        *([step["status"]] if v2 else []),
        step["result_text"],
        step["error_text"],
        *([step.get("state_text"), step.get("plan_text")] if v2 else []),
        _text(step["completed_us"]),
    ]
    return _sha(prev, f"outbox.step.v{version}" + "".join(lp(f) for f in fields))


#: The values a step link covers, in order.
STEP_VALUES = ("result", "error", "state", "plan")


def step_intents(
    effects: Iterable[Mapping[str, Any]],
) -> dict[str, list[Mapping[str, Any]]]:
    """The effects each step created (not compensations), by step id, in ``step_index`` order."""
    by_step: dict[str, list[Mapping[str, Any]]] = {}
    for effect in effects:
        if effect.get("compensates") is None and effect.get("step_id") is not None:
            by_step.setdefault(effect["step_id"], []).append(effect)
    for found in by_step.values():
        found.sort(key=lambda e: (e["step_index"] if e["step_index"] is not None else -1, e["id"]))
    return by_step


def _step_follows(
    prev: bytes, step: Mapping[str, Any], run_id: str, intents: Sequence[Mapping[str, Any]]
) -> bool:
    """Whether ``step``'s hash is its link after ``prev``, in any version."""
    stored = bytes.fromhex(step["hash"])
    if step_hash(prev, step, run_id, intents=intents) == stored:
        return True
    rendered = {
        f"{f}_value_text": step[f"{f}_rendered_text"]
        for f in STEP_VALUES
        if step.get(f"{f}_rendered_text") is not None
    }
    # a wait's or a fork's link before migration 0036: a blob the client stored
    # (canonical JSON) was hashed as PostgreSQL renders it
    if rendered and step_hash(prev, {**step, **rendered}, run_id, intents=intents) == stored:
        return True
    return any(step_hash(prev, step, run_id, version=v) == stored for v in (2, 1))


def effect_genesis(effect: Mapping[str, Any]) -> bytes:
    """Where an effect's attempt-log chain starts (binds its kind, key and payload digest)."""
    return _sha(
        b"",
        "outbox.effect.v1"
        + lp(effect["id"])
        + lp(effect["run_id"])
        + lp(effect["kind"])
        + lp(effect["idempotency_key"])
        + lp(effect["payload_hash"]),
    )


def attempt_hash(prev: bytes, row: Mapping[str, Any]) -> bytes:
    """The link of one attempt-log row (``detail_text``, ``started_us``, ``finished_us``).

    A row that records its effect's status (``effect_status``, since migration
    0023) has a v2 link, which covers it and ``result_hash``; an older row a v1 link.
    """
    status = row.get("effect_status")
    message = (
        lp(row["effect_id"])
        + lp(str(row["attempt"]))
        + lp(row["worker"])
        + lp(_text(row["started_us"]))
        + lp(_text(row["finished_us"]))
        + lp(row["outcome"])
        + lp(row["detail_text"])
    )
    if status is None:
        return _sha(prev, "outbox.attempt.v1" + message)
    return _sha(prev, "outbox.attempt.v2" + message + lp(status) + lp(row.get("result_hash")))


def canonical(value: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces, UTF-8 (what digests and signatures are over)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _digest(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def _hashes_to(value: Any, text: str | None, digest: str) -> bool:
    """Whether a value's text (as the database renders it) hashes to ``digest``.

    ``text`` must also be the value's own: a record edited to carry another text
    beside its value does not pass. Values written before migration 0023 were
    hashed over their canonical JSON instead, which is accepted too.
    """
    if text is not None and hashlib.sha256(text.encode()).hexdigest() == digest:
        # the text hashed is the one shown: the value itself, or the blob its reference names
        shown = reference_hash(value)
        if (digest == shown) if shown is not None else json.loads(text) == value:
            return True
    return _digest(value) == digest


@dataclass(frozen=True)
class Break:
    """The first place a chain or digest does not hold."""

    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def _walk(rows: Sequence[Mapping[str, Any]], start: bytes, follows: Any) -> tuple[bytes, Any]:
    """Follow a chain through ``rows`` (listed by position); returns (head, first broken row).

    Rows are taken in the order given; when the next one does not follow, the
    one that does is looked for among the rest (a wait completed after a later
    step, say), so only a row no predecessor explains is a break.
    """
    remaining = list(rows)
    prev = start
    while remaining:
        for index, row in enumerate(remaining):
            if follows(prev, row):
                prev = bytes.fromhex(row["hash"])
                remaining.pop(index)
                break
        else:
            return prev, remaining[0]
    return prev, None


def _texts_differ(row: Mapping[str, Any], fields: Sequence[str]) -> list[str]:
    """The fields whose texts (what links hash) are not the value's.

    ``<field>_text`` is the value as stored; ``<field>_value_text`` its own text
    (a large value's blob, when the row holds its reference);
    ``<field>_rendered_text``, for a reference, that blob as PostgreSQL renders
    it (older links hashed it), which must be the same value.
    """
    differ = []
    for f in fields:
        if f"{f}_text" in row and json.loads(row[f"{f}_text"] or "null") != row.get(f):
            differ.append(f"{f}_text")
            continue
        own = row.get(f"{f}_value_text")
        if own is not None and not _hashes_to(
            row.get(f), own, hashlib.sha256(own.encode()).hexdigest()
        ):
            differ.append(f"{f}_value_text")
            continue
        rendered = row.get(f"{f}_rendered_text")
        if rendered is not None and (own is None or json.loads(rendered) != json.loads(own)):
            differ.append(f"{f}_rendered_text")
    return differ


def verify_record(record: Mapping[str, Any]) -> list[Break]:
    """Every break in a run record (empty: it holds): digests, step chain, attempt chains."""
    breaks: list[Break] = []
    run = record["run"]
    rid = run["id"]
    if not _hashes_to(run["inputs"], run.get("inputs_text"), run["inputs_hash"]):
        breaks.append(Break(f"run {rid}", "its inputs do not match inputs_hash"))
    intents = step_intents(record["effects"])
    chained = []
    for step in record["steps"]:
        where = f"run {rid} step {step['step_id']!r}"
        # A step is chained as it completes: only a wait under way has no hash yet.
        if step.get("hash") is None:
            if step["status"] != "waiting":
                breaks.append(Break(where, f"it is {step['status']} but has no hash"))
            continue
        if step["status"] != "completed":
            breaks.append(Break(where, f"it has a hash but is {step['status']}, not completed"))
        for field in _texts_differ(step, ("result", "state", "plan")):
            breaks.append(Break(where, f"{field} differs"))
        chained.append(step)
    head, broken = _walk(
        chained,
        run_genesis(rid, run["agent"], run["inputs_hash"]),
        lambda prev, s: _step_follows(prev, s, rid, intents.get(s["step_id"], ())),
    )
    if broken is not None:
        breaks.append(
            Break(
                f"run {rid} step {broken['step_id']!r}",
                "its hash does not follow the run's previous step (the step or one before it "
                "was changed or removed)",
            )
        )
    elif run.get("step_head") is not None and head.hex() != run["step_head"]:
        breaks.append(Break(f"run {rid}", "step_head is not the last step's hash (steps removed)"))
    compensated = {e["compensates"] for e in record["effects"] if e["status"] == "succeeded"} - {
        None
    }
    for effect in record["effects"]:
        breaks.extend(verify_effect(effect))
        if effect["status"] == "compensated" and effect["id"] not in compensated:
            breaks.append(
                Break(f"effect {effect['id']}", "it is compensated but no compensation succeeded")
            )
    return breaks


def verify_effect(effect: Mapping[str, Any]) -> list[Break]:
    """Every break in one effect of a record (its payload digest, its attempt-log chain)."""
    breaks: list[Break] = []
    where = f"effect {effect['id']}"
    if not _hashes_to(effect["payload"], effect.get("payload_text"), effect["payload_hash"]):
        breaks.append(Break(where, "its payload does not match payload_hash (altered)"))
    prev = effect_genesis(effect)
    for row in effect["attempts"]:
        at = f"{where} attempt-log row {row['id']} ({row['outcome']})"
        if row.get("hash") is None:
            breaks.append(Break(at, "it has no hash"))
            break
        if json.loads(row["detail_text"] or "null") != row["detail"]:
            breaks.append(Break(at, "detail_text differs from detail"))
        if attempt_hash(prev, row) != bytes.fromhex(row["hash"]):
            breaks.append(
                Break(at, "its hash does not match its content and the previous row's hash")
            )
            break
        prev = bytes.fromhex(row["hash"])
    breaks.extend(_end_breaks(effect, where))
    return breaks


#: The statuses an effect ends in (``outbox.models.TERMINAL_EFFECT_STATUSES``).
_ENDED = frozenset({"succeeded", "failed", "cancelled", "compensated", "rejected"})
#: An attempt under way: its row is logged when it ends.
_UNDER_WAY = frozenset({"in_flight", "dispatched"})


def _end_breaks(effect: Mapping[str, Any], where: str) -> list[Break]:
    """Where an effect stands against its attempt log (records since v4).

    Every end is logged, by the statement that ends the effect, and the row
    records the status and result digest the effect then has (its v2 link covers
    them); ``compensated`` is the one status set without a row, on a succeeded
    effect whose compensation succeeded (:func:`verify_record` checks that).
    """
    if "attempt" not in effect:  # a record exported before v4 carries no counter
        return []
    rows, status = effect["attempts"], effect["status"]
    if not rows and status in _ENDED:
        return [Break(where, f"it is {status} but its attempt log is empty (every end is logged)")]
    logged = max((row["attempt"] for row in rows), default=0)
    if effect["attempt"] > logged + (1 if status in _UNDER_WAY else 0):
        return [
            Break(
                where,
                f"its attempt counter {effect['attempt']} is above its attempt log's "
                f"({logged}): attempts were removed",
            )
        ]
    newest = rows[-1] if rows else None
    if newest is None or newest.get("effect_status") is None:
        return []  # logged before migration 0023: the row records no status
    recorded = newest["effect_status"]
    if status == "compensated" and recorded in ("succeeded", "compensated"):
        pass
    elif recorded != status and (status in _ENDED or recorded in _ENDED):
        return [
            Break(
                where,
                f"it is {status} but its newest attempt-log row ({newest['id']}) "
                f"recorded {recorded}",
            )
        ]
    text = effect.get("result_text")
    if json.loads(text or "null") != effect["result"]:
        return [Break(where, "result_text differs from result")]
    digest = None if text is None else hashlib.sha256(text.encode()).hexdigest()
    if digest != newest.get("result_hash"):
        return [
            Break(
                where,
                f"its result is not the one its newest attempt-log row ({newest['id']}) recorded",
            )
        ]
    return []


def stored_values(rows: Mapping[str, Any]) -> dict[str, str]:
    """The blobs a run's rows (``Store.audit_rows``) refer to: sha256 -> the first place using it.

    Without a ``run`` (effects outside runs) only the effects' payloads.
    """
    places: dict[str, str] = {}

    def note(value: Any, where: str) -> None:
        sha = reference_hash(value)
        if sha is not None:
            places.setdefault(sha, where)

    run = rows.get("run")
    if run:
        rid = str(run["id"])
        for field in ("inputs", "state", "plan", "result", "error"):
            note(run[field], f"run {rid} {field}")
        for step in rows["steps"]:
            for field in STEP_VALUES:
                note(step[field], f"run {rid} step {step['step_id']!r} {field}")
    for effect in rows["effects"]:
        note(effect["payload"], f"effect {effect['id']} payload")
    return places


def value_breaks(places: Mapping[str, str], blob_rows: Iterable[Mapping[str, Any]]) -> list[Break]:
    """Every stored value (``places``: sha256 -> where it is used) whose blob is altered or gone.

    ``blob_rows`` are ``outbox_blobs`` rows (``sha256``, ``data``), every shard's copy.
    """
    breaks = []
    found = set()
    for row in blob_rows:
        sha = row["sha256"]
        found.add(sha)
        if sha in places and content_hash(row["data"]) != sha:
            breaks.append(
                Break(
                    places[sha],
                    f"stored value sha256={sha} does not match its text in outbox_blobs (altered)",
                )
            )
    for sha in sorted(places.keys() - found):
        breaks.append(Break(places[sha], f"stored value sha256={sha} is missing from outbox_blobs"))
    return breaks
