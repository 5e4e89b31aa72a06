/**
 * Every error the client throws, rooted in `OutboxError`, mirroring the
 * Python client's tree. SQL API refusals (SQLSTATE class `OB`, listed in
 * docs/sql-api.md) carry their fields as JSON in the error's DETAIL; `fromDatabase`
 * turns them into these classes.
 *
 *     OutboxError
 *     ├── ValidationError        bad input; names the field (and the rule, if one applies)
 *     │   └── PayloadError       a JSON value that cannot be stored (size, depth, NUL, NaN)
 *     ├── IdempotencyConflict    a key already names another intent
 *     ├── NotFound
 *     │   ├── RunNotFound
 *     │   └── EffectNotFound
 *     ├── RunStateError          the run cannot take this now
 *     │   ├── RunTerminal        it has ended
 *     │   └── StepAlreadyRecorded   (handled by Run.transaction: it replays)
 *     ├── BudgetExceeded
 *     ├── EffectTimeout          waitForEffect ran out of time
 *     ├── StepFailed             a replayed step had recorded an error
 *     └── DatabaseError          anything else PostgreSQL or the driver reported (`cause`)
 */

function show(value: unknown): string {
  let text: string;
  try {
    text = typeof value === "string" ? `'${value}'` : JSON.stringify(value) ?? String(value);
  } catch {
    text = String(value);
  }
  return text.length <= 80 ? text : `${text.slice(0, 77)}...`;
}

/** Root of every error thrown by the client. */
export class OutboxError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/** A value that cannot be accepted; `field` names it. */
export class ValidationError extends OutboxError {
  constructor(
    readonly field: string,
    readonly value: unknown,
    readonly reason: string,
    readonly rule?: string,
    options?: { cause?: unknown },
  ) {
    super(`${field}=${show(value)}: ${reason}`, options);
  }
}

/** A JSON value (payload, inputs, state, result) that cannot be stored. */
export class PayloadError extends ValidationError {}

/** An idempotency key already names an intent with another kind, payload or owner. */
export class IdempotencyConflict extends OutboxError {
  constructor(
    readonly key: string,
    readonly reason: string,
    options?: { cause?: unknown },
  ) {
    super(`idempotency_key='${key}': ${reason}`, options);
  }
}

/** `startRun` with a business key and `onConflict: "reject"`: a run with this key exists. */
export class RunExists extends IdempotencyConflict {
  constructor(
    key: string,
    readonly runId: string,
    options?: { cause?: unknown },
  ) {
    super(key, `run ${runId} was already started with this key`, options);
  }
}

/** A record does not exist. */
export class NotFound extends OutboxError {}

/** No run has this id. */
export class RunNotFound extends NotFound {
  constructor(
    readonly runId: string,
    options?: { cause?: unknown },
  ) {
    super(`run_id='${runId}': no such run`, options);
  }
}

/** No effect has this id (or key). */
export class EffectNotFound extends NotFound {
  constructor(
    readonly effect: string,
    options?: { cause?: unknown },
  ) {
    super(`effect '${effect}': no such effect`, options);
  }
}

/** The run cannot take this action now. */
export class RunStateError extends OutboxError {}

/** The run has ended; it accepts no more steps, signals or intents. */
export class RunTerminal extends RunStateError {
  constructor(
    readonly runId: string,
    readonly status: string,
    options?: { cause?: unknown },
  ) {
    super(`run_id='${runId}' is ${status}: a terminal run accepts no more work`, options);
  }
}

/** The run is paused (`outbox runs pause`): it takes no steps until it is resumed. */
export class RunPaused extends RunStateError {
  constructor(
    readonly runId: string,
    readonly reason?: string,
    options?: { cause?: unknown },
  ) {
    super(`run_id='${runId}' is paused${reason ? ` (${reason})` : ""}: resume it first`, options);
  }
}

/** Another transaction (or an earlier attempt) recorded this step first. */
export class StepAlreadyRecorded extends RunStateError {
  constructor(
    readonly runId: string,
    readonly stepId: string,
    options?: { cause?: unknown },
  ) {
    super(`step_id='${stepId}' of run ${runId} is already recorded`, options);
  }
}

/** A step would spend beyond the run's budget; nothing of it was committed. */
export class BudgetExceeded extends OutboxError {
  constructor(
    readonly runId: string,
    readonly requested: number,
    readonly remaining: number,
    options?: { cause?: unknown },
  ) {
    super(`run_id='${runId}': step needs ${requested} but only ${remaining} remains`, options);
  }
}

/** `waitForEffect` gave up before the effect finished. */
export class EffectTimeout extends OutboxError {
  constructor(
    readonly effectId: string,
    readonly status: string,
  ) {
    super(`effect ${effectId} did not finish in time (still ${status})`);
  }
}

/** A replayed step had recorded an error instead of a result. */
export class StepFailed extends OutboxError {
  constructor(
    readonly stepId: string,
    readonly error: unknown,
  ) {
    super(`step_id='${stepId}' recorded an error: ${show(error)}`);
  }
}

/** PostgreSQL or the driver failed; the original error is `cause`. */
export class DatabaseError extends OutboxError {}

interface PgError {
  code?: string;
  detail?: string;
  message: string;
}

function isPgError(error: unknown): error is PgError {
  return error instanceof Error && typeof (error as PgError).code === "string";
}

/** The typed error for what the driver threw (SQL API refusals by SQLSTATE). */
export function fromDatabase(error: unknown): unknown {
  if (error instanceof OutboxError || !isPgError(error)) {
    return error;
  }
  const cause = { cause: error };
  let fields: Record<string, unknown> = {};
  if (error.code?.startsWith("OB") && error.detail) {
    try {
      fields = JSON.parse(error.detail) as Record<string, unknown>;
    } catch {
      fields = {};
    }
  }
  const text = (name: string): string => String(fields[name] ?? "?");
  switch (error.code) {
    case "OB001":
      return new ValidationError(text("field"), fields.value, text("reason"), fields.rule as string | undefined, cause);
    case "OB002":
      return new PayloadError(text("field"), fields.value, text("reason"), fields.rule as string | undefined, cause);
    case "OB003":
      return new IdempotencyConflict(text("key"), text("reason"), cause);
    case "OB004":
      return new RunNotFound(text("run_id"), cause);
    case "OB005":
      return new RunTerminal(text("run_id"), text("status"), cause);
    case "OB006":
      return new StepAlreadyRecorded(text("run_id"), text("step_id"), cause);
    case "OB007":
      return new BudgetExceeded(text("run_id"), Number(fields.requested), Number(fields.remaining), cause);
    case "OB008":
      return new RunStateError(error.message, cause);
    case "OB009":
      return new RunPaused(text("run_id"), fields.reason as string | undefined, cause);
    case "OB010":
      return new RunExists(text("key"), text("run_id"), cause);
    case "22P05": // jsonb refused a \u0000 or an unpaired surrogate escape
      return new PayloadError("payload", undefined, error.message, undefined, cause);
    default:
      return new DatabaseError(error.message, cause);
  }
}
