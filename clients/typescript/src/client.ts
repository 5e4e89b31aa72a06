/**
 * The client: start runs, commit steps with their intents inside a PostgreSQL
 * transaction (your own rows included), send signals, read and await effects.
 *
 * Everything goes through the SQL API (docs/sql-api.md), so the rules, keys and
 * wake-ups are the ones the Python client applies; Python deliverers deliver.
 */

import pg from "pg";

import {
  EffectNotFound,
  EffectTimeout,
  RunNotFound,
  StepAlreadyRecorded,
  StepFailed,
  ValidationError,
  fromDatabase,
} from "./errors.js";
import { toJson } from "./json.js";
import { canonicalUuid } from "./keys.js";

/** A JSON value as stored. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** Options of one intent (the arguments of `outbox_intend`). */
export interface IntendOptions {
  /** Your own idempotency key; by default one is derived from (run, step, index). */
  key?: string;
  /** Effects sharing an ordering key are delivered one at a time, in intent order. */
  orderingKey?: string;
  maxAttempts?: number;
  delaySeconds?: number;
  schemaVersion?: number;
  /** The effect that undoes this one if the run is cancelled after it succeeded. */
  compensate?: { kind: string; payload: unknown };
  /** Reserved from the run's budget when the step commits; settled by the outcome. */
  cost?: number | string;
  /**
   * Hold the effect as `awaiting_approval` until an operator approves its payload's
   * digest: `true`, or a policy `{ timeout, on_timeout, escalate_to }`.
   */
  approval?: boolean | { timeout?: number | string; on_timeout?: string; escalate_to?: string };
  /** Higher is claimed first (default: the run's priority, or 0). */
  priority?: number;
  /** Deliverers share capacity between fairness keys (default: the run's). */
  fairnessKey?: string;
}

/** An intent as written: its id and key, and whether this call created it. */
export interface Intent {
  id: string;
  idempotencyKey: string;
  /** False when the key already named the same intent (a retried write). */
  created: boolean;
}

/** Where an effect is (`outbox_effect_status`). */
export interface EffectStatus {
  id: string;
  kind: string;
  status: string;
  idempotencyKey: string;
  attempt: number;
  result: Json | null;
  lastError: string | null;
  runId: string | null;
  stepId: string | null;
  stepIndex: number | null;
  createdAt: Date;
  updatedAt: Date;
  completedAt: Date | null;
}

/** A run as stored (`outbox_run_status`). */
export interface RunStatus {
  id: string;
  agent: string;
  agentVersion: string;
  status: string;
  inputs: Json;
  state: Json;
  plan: Json;
  currentStep: string | null;
  result: Json | null;
  error: Json | null;
  budget: string | null;
  spent: string;
  reserved: string;
}

/** What `signal` did: stored (or a duplicate of one stored), and did it wake the run. */
export interface SignalReceipt {
  signalId: string | null;
  duplicate: boolean;
  wokeRun: boolean;
}

/** Effect statuses that no longer change by delivery. */
/** (`rejected`: refused at an approval gate; as `TERMINAL_EFFECT_STATUSES` in outbox/models.py.) */
export const TERMINAL_EFFECT_STATUSES = ["succeeded", "failed", "cancelled", "compensated", "rejected"] as const;

/** Anything that runs a query: a `pg` Client, PoolClient or Pool. */
export interface Queryable {
  query<R extends pg.QueryResultRow = pg.QueryResultRow>(text: string, values?: unknown[]): Promise<pg.QueryResult<R>>;
}

async function run<R extends pg.QueryResultRow>(db: Queryable, text: string, values: unknown[]): Promise<R[]> {
  try {
    return (await db.query<R>(text, values)).rows;
  } catch (error) {
    throw fromDatabase(error);
  }
}

const INTEND = `SELECT effect_id, idempotency_key, created FROM outbox_intend(
  kind => $1, payload => $2::jsonb, key => $3, ordering_key => $4, run_id => $5::uuid,
  step_id => $6, max_attempts => $7::integer, delay_seconds => $8::double precision,
  schema_version => $9::integer, compensate => $10::jsonb, cost => $11::numeric,
  approval => $12::jsonb, priority => $13::integer, fairness_key => $14)`;

async function intend(
  db: Queryable,
  runId: string | null,
  stepId: string | null,
  kind: string,
  payload: unknown,
  options: IntendOptions,
): Promise<Intent> {
  const compensate =
    options.compensate === undefined
      ? null
      : toJson({ kind: options.compensate.kind, payload: options.compensate.payload ?? null }, "compensate");
  const [row] = await run<{ effect_id: string; idempotency_key: string; created: boolean }>(db, INTEND, [
    kind,
    toJson(payload, "payload"),
    options.key ?? null,
    options.orderingKey ?? null,
    runId,
    stepId,
    options.maxAttempts ?? null,
    options.delaySeconds ?? 0,
    options.schemaVersion ?? 1,
    compensate,
    options.cost === undefined ? null : String(options.cost),
    options.approval === undefined ? null : toJson(options.approval, "approval"),
    options.priority ?? null,
    options.fairnessKey ?? null,
  ]);
  return { id: row!.effect_id, idempotencyKey: row!.idempotency_key, created: row!.created };
}

/** Intents of no run, written with your rows in one transaction (`outbox.transaction`). */
export class OutboxTransaction {
  constructor(readonly client: pg.ClientBase) {}

  /** Run a query in this transaction (your own rows). */
  query<R extends pg.QueryResultRow = pg.QueryResultRow>(text: string, values?: unknown[]): Promise<pg.QueryResult<R>> {
    return this.client.query<R>(text, values);
  }

  /** Record that effect `kind` with `payload` must happen, once, when this transaction commits. */
  intend(kind: string, payload: unknown, options: IntendOptions = {}): Promise<Intent> {
    return intend(this.client, null, null, kind, payload, options);
  }
}

/** What a step function receives: one open transaction, and the step's checkpoint. */
export class StepTransaction {
  private state: string | null = null;
  private plan: string | null = null;

  constructor(
    readonly client: pg.ClientBase,
    readonly runId: string,
    readonly stepId: string,
  ) {}

  /** Run a query in the step's transaction: it commits (or rolls back) with the step. */
  query<R extends pg.QueryResultRow = pg.QueryResultRow>(text: string, values?: unknown[]): Promise<pg.QueryResult<R>> {
    return this.client.query<R>(text, values);
  }

  /** Record that effect `kind` with `payload` must happen, once, if this step commits. */
  intend(kind: string, payload: unknown, options: IntendOptions = {}): Promise<Intent> {
    return intend(this.client, this.runId, this.stepId, kind, payload, options);
  }

  /** Debit the run's budget by `amount` for `reason` if this step commits (once per reason). */
  async spend(amount: number | string, reason: string): Promise<void> {
    await run(this.client, "SELECT outbox_spend($1::uuid, $2, $3::numeric, $4)", [
      this.runId,
      this.stepId,
      String(amount),
      reason,
    ]);
  }

  /** Replace the run's state when this step commits. */
  setState(state: unknown): void {
    this.state = toJson(state, "state");
  }

  /** Replace the run's plan when this step commits. */
  setPlan(plan: unknown): void {
    this.plan = toJson(plan, "plan");
  }

  /** @internal */
  checkpoint(): { state: string | null; plan: string | null } {
    return { state: this.state, plan: this.plan };
  }
}

/** Options of `Run.transaction`. */
export interface TransactionOptions {
  /**
   * Join this client's open transaction (in a savepoint) instead of opening
   * one: the step commits when you commit.
   */
  client?: pg.ClientBase;
}

/** A handle on one run: its steps replay, its transactions commit atomically. */
export class Run {
  constructor(
    private readonly outbox: Outbox,
    readonly id: string,
  ) {}

  /** The run as stored now. */
  async status(): Promise<RunStatus> {
    const [row] = await run<Record<string, unknown>>(this.outbox.pool, "SELECT * FROM outbox_run_status($1::uuid)", [this.id]);
    if (row === undefined) {
      throw new RunNotFound(this.id);
    }
    return {
      id: row.id as string,
      agent: row.agent as string,
      agentVersion: row.agent_version as string,
      status: row.status as string,
      inputs: row.inputs as Json,
      state: row.state as Json,
      plan: row.plan as Json,
      currentStep: row.current_step as string | null,
      result: row.result as Json | null,
      error: row.error as Json | null,
      budget: row.budget as string | null,
      spent: row.spent as string,
      reserved: row.reserved as string,
    };
  }

  /**
   * Run `fn` in one transaction and commit the step's result, its intents, its
   * checkpoint and your rows together, or none of them. A step already
   * recorded returns its recorded result without calling `fn` (also when
   * another process records it while `fn` runs: yours is rolled back).
   */
  async transaction<T>(stepId: string, fn: (tx: StepTransaction) => Promise<T>, options: TransactionOptions = {}): Promise<T> {
    const recorded = await this.recorded(stepId, this.outbox.pool);
    if (recorded.found) {
      return recorded.result as T;
    }
    const joined = options.client;
    const client = joined ?? (await this.outbox.pool.connect());
    const [begin, commit, abort] = joined
      ? ["SAVEPOINT outbox_step", "RELEASE SAVEPOINT outbox_step", "ROLLBACK TO SAVEPOINT outbox_step"]
      : ["BEGIN", "COMMIT", "ROLLBACK"];
    let result: unknown;
    try {
      await client.query(begin);
      try {
        const tx = new StepTransaction(client, this.id, stepId);
        result = await fn(tx);
        const { state, plan } = tx.checkpoint();
        await run(client, "SELECT outbox_commit_step($1::uuid, $2, result => $3::jsonb, state => $4::jsonb, plan => $5::jsonb)", [
          this.id,
          stepId,
          toJson(result, "result"),
          state,
          plan,
        ]);
        await run(client, commit, []);
      } catch (error) {
        await client.query(abort).catch(() => undefined);
        const typed = fromDatabase(error);
        if (!(typed instanceof StepAlreadyRecorded)) {
          throw typed;
        }
        // Another transaction recorded this step first; ours was rolled back whole.
        const again = await this.recorded(stepId, client);
        if (!again.found) {
          throw typed;
        }
        return again.result as T;
      }
    } finally {
      if (!joined) {
        (client as pg.PoolClient).release();
      }
    }
    return JSON.parse(toJson(result, "result")) as T;
  }

  /**
   * Call `fn` once for this run (outside any transaction) and record its
   * result under `stepId`; a replay returns the recorded result without calling it.
   */
  async call<T>(stepId: string, fn: () => Promise<T>): Promise<T> {
    const recorded = await this.recorded(stepId, this.outbox.pool);
    if (recorded.found) {
      return recorded.result as T;
    }
    const result = toJson(await fn(), "result");
    try {
      await run(this.outbox.pool, "SELECT outbox_commit_step($1::uuid, $2, result => $3::jsonb, step_kind => 'call')", [
        this.id,
        stepId,
        result,
      ]);
    } catch (error) {
      if (error instanceof StepAlreadyRecorded) {
        return (await this.recorded(stepId, this.outbox.pool)).result as T;
      }
      throw error;
    }
    return JSON.parse(result) as T;
  }

  /** End the run as completed, with an optional result. */
  async complete(result?: unknown): Promise<void> {
    await run(this.outbox.pool, "SELECT outbox_finish_run($1::uuid, 'completed', result => $2::jsonb)", [
      this.id,
      result === undefined ? null : toJson(result, "result"),
    ]);
  }

  /** End the run as failed, with a JSON description of why. */
  async fail(error: unknown): Promise<void> {
    await run(this.outbox.pool, "SELECT outbox_finish_run($1::uuid, 'failed', error => $2::jsonb)", [
      this.id,
      toJson(error, "error"),
    ]);
  }

  private async recorded(stepId: string, db: Queryable): Promise<{ found: boolean; result?: unknown }> {
    const [row] = await run<{ status: string; result: unknown; error: unknown }>(
      db,
      "SELECT status, result, error FROM outbox_step($1::uuid, $2)",
      [this.id, stepId],
    );
    if (row === undefined || row.status !== "completed") {
      return { found: false };
    }
    if (row.error !== null) {
      throw new StepFailed(stepId, row.error);
    }
    return { found: true, result: row.result };
  }
}

/** How to connect: a DSN, or a pool you own. */
export interface OutboxOptions {
  connectionString?: string;
  /** Yours: its sessions must keep the ISO DateStyle (the default), which node-postgres reads. */
  pool?: pg.Pool;
  /** Size of the pool this client creates (default 5). */
  max?: number;
}

/** Options of `startRun`. */
export interface StartRunOptions {
  /** Caps what the run's steps may spend. */
  budget?: number | string;
  /** Choose the run's id (starting again with the same arguments returns the same run). */
  runId?: string;
  /** A business key: one run per key. */
  key?: string;
  /** A second start with the same `key`: answer the first run (default) or refuse it with `RunExists` (`"reject"`). */
  onConflict?: "return_existing" | "reject";
  /** Higher is claimed first by workers; the run's effects inherit it. */
  priority?: number;
  /** Workers and deliverers share capacity between fairness keys; effects inherit it. */
  fairnessKey?: string;
  /** `"dry_run"`: the run's effects go to recording deliverers, never to a sink. */
  mode?: "live" | "dry_run";
}

/** Options of `waitForEffect`. */
export interface WaitOptions {
  /** Give up after this long (default 30 s). */
  timeoutMs?: number;
  /** Longest pause between two looks (default 500 ms; the first is 20 ms). */
  maxPollMs?: number;
}

function effectStatus(row: Record<string, unknown>): EffectStatus {
  return {
    id: row.id as string,
    kind: row.kind as string,
    status: row.status as string,
    idempotencyKey: row.idempotency_key as string,
    attempt: row.attempt as number,
    result: row.result as Json | null,
    lastError: row.last_error as string | null,
    runId: row.run_id as string | null,
    stepId: row.step_id as string | null,
    stepIndex: row.step_index as number | null,
    createdAt: row.created_at as Date,
    updatedAt: row.updated_at as Date,
    completedAt: row.completed_at as Date | null,
  };
}

/** Entry point: a connection pool to the outbox database. Call `close()` when done. */
export class Outbox {
  readonly pool: pg.Pool;
  private readonly ownsPool: boolean;

  constructor(options: OutboxOptions = {}) {
    if (options.pool !== undefined) {
      this.pool = options.pool;
      this.ownsPool = false;
    } else {
      const connectionString = options.connectionString ?? process.env.OUTBOX_DSN;
      if (!connectionString) {
        throw new ValidationError("connectionString", connectionString, "pass a DSN or a pool, or set OUTBOX_DSN");
      }
      this.pool = new pg.Pool({ connectionString, max: options.max ?? 5 });
      // node-postgres parses timestamps only in the ISO output style: a DSN's or a
      // server's other DateStyle would read every createdAt as null. A client's
      // queries run in order, so this one runs before any the pool hands it out for
      // (a connection that cannot run it fails that first query).
      this.pool.on("connect", (client) => {
        client.query("SET DateStyle = ISO").catch(() => undefined);
      });
      this.ownsPool = true;
    }
  }

  /** Release every connection (only a pool this client created). */
  async close(): Promise<void> {
    if (this.ownsPool) {
      await this.pool.end();
    }
  }

  /** Start a run of `agent` pinned to `version`, with immutable `inputs`. */
  async startRun(agent: string, version: string, inputs?: unknown, options: StartRunOptions = {}): Promise<Run> {
    const runId = options.runId === undefined ? null : canonicalUuid(options.runId);
    const [row] = await run<{ id: string }>(
      this.pool,
      `SELECT outbox_start_run(agent => $1, version => $2, inputs => $3::jsonb, budget => $4::numeric,
         run_id => $5::uuid, key => $6, on_conflict => coalesce($7, 'return_existing'),
         priority => coalesce($8::integer, 0), fairness_key => coalesce($9, ''),
         mode => coalesce($10, 'live')) AS id`,
      [
        agent,
        version,
        toJson(inputs ?? null, "inputs"),
        options.budget === undefined ? null : String(options.budget),
        runId,
        options.key ?? null,
        options.onConflict ?? null,
        options.priority ?? null,
        options.fairnessKey ?? null,
        options.mode ?? null,
      ],
    );
    return new Run(this, row!.id);
  }

  /** A handle on an existing run (no query). */
  run(runId: string): Run {
    return new Run(this, canonicalUuid(runId));
  }

  /**
   * Intents that belong to no run, committed with your rows. With `client`,
   * join that client's open transaction (in a savepoint).
   */
  async transaction<T>(fn: (tx: OutboxTransaction) => Promise<T>, options: TransactionOptions = {}): Promise<T> {
    const joined = options.client;
    const client = joined ?? (await this.pool.connect());
    const [begin, commit, abort] = joined
      ? ["SAVEPOINT outbox_tx", "RELEASE SAVEPOINT outbox_tx", "ROLLBACK TO SAVEPOINT outbox_tx"]
      : ["BEGIN", "COMMIT", "ROLLBACK"];
    try {
      await client.query(begin);
      try {
        const result = await fn(new OutboxTransaction(client));
        await run(client, commit, []);
        return result;
      } catch (error) {
        await client.query(abort).catch(() => undefined);
        throw fromDatabase(error);
      }
    } finally {
      if (!joined) {
        (client as pg.PoolClient).release();
      }
    }
  }

  /** Send signal `name` with a JSON payload to a run; the same `dedupKey` is accepted once. */
  async signal(runId: string, name: string, payload?: unknown, options: { dedupKey?: string } = {}): Promise<SignalReceipt> {
    const [row] = await run<{ signal_id: string | null; duplicate: boolean; woke_run: boolean }>(
      this.pool,
      "SELECT * FROM outbox_signal($1::uuid, $2, $3::jsonb, dedup_key => $4)",
      [canonicalUuid(runId), name, toJson(payload ?? null, "payload"), options.dedupKey ?? null],
    );
    return { signalId: row!.signal_id, duplicate: row!.duplicate, wokeRun: row!.woke_run };
  }

  /** Where an effect is now. */
  async effect(effectId: string): Promise<EffectStatus> {
    const [row] = await run<Record<string, unknown>>(this.pool, "SELECT * FROM outbox_effect_status($1::uuid)", [
      canonicalUuid(effectId, "effectId"),
    ]);
    if (row === undefined) {
      throw new EffectNotFound(effectId);
    }
    return effectStatus(row);
  }

  /** Where the effect with this idempotency key is now. */
  async effectByKey(key: string): Promise<EffectStatus> {
    const [row] = await run<Record<string, unknown>>(this.pool, "SELECT * FROM outbox_effect_by_key($1)", [key]);
    if (row === undefined) {
      throw new EffectNotFound(key);
    }
    return effectStatus(row);
  }

  /**
   * Wait until an effect is succeeded, failed, cancelled, compensated or rejected
   * and return its status (an `unknown` or `awaiting_approval` one waits for a
   * person, so it waits on).
   */
  async waitForEffect(effectId: string, options: WaitOptions = {}): Promise<EffectStatus> {
    const deadline = Date.now() + (options.timeoutMs ?? 30_000);
    let pause = 20;
    for (;;) {
      const found = await this.effect(effectId);
      if ((TERMINAL_EFFECT_STATUSES as readonly string[]).includes(found.status)) {
        return found;
      }
      if (Date.now() >= deadline) {
        throw new EffectTimeout(effectId, found.status);
      }
      await new Promise((resolve) => setTimeout(resolve, Math.min(pause, Math.max(0, deadline - Date.now()))));
      pause = Math.min(pause * 2, options.maxPollMs ?? 500);
    }
  }
}
