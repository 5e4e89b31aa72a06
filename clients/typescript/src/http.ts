/**
 * The same client over the HTTP API of `outbox serve` (docs/http-api.md), for
 * code that cannot reach PostgreSQL: start runs, record a step with its intents
 * in one call, send signals, read runs and effects, await an effect (long poll).
 *
 * No rule is checked here: the server's Python client checks them, and its
 * refusals become the errors of `errors.ts` (a 422 is a `ValidationError`
 * naming the field and the rule). Every call is safe to repeat, so calls that
 * fail on the way (a network error, a 5xx) are sent again with the same ids:
 * a start carries a `runId` and a signal a `dedupKey` (generated when not given),
 * a step its `stepId`.
 */

import { randomUUID } from "node:crypto";

import {
  BudgetExceeded,
  EffectNotFound,
  EffectTimeout,
  IdempotencyConflict,
  OutboxError,
  RunNotFound,
  RunStateError,
  RunTerminal,
  ValidationError,
} from "./errors.js";
import type { IntendOptions, Json, StartRunOptions } from "./client.js";

/** Where the server is and how to call it. */
export interface HttpOutboxOptions {
  /** The server, e.g. `http://127.0.0.1:8080` (the API is under `/api/v1`). */
  baseUrl: string;
  /** `OUTBOX_API_TOKEN` of the server. */
  token: string;
  /** Tries of one call when the network or the server fails (default 4). */
  attempts?: number;
  /** Pause before the first retry, doubled each time (default 200 ms). */
  backoffMs?: number;
  /** Seconds one long poll may wait (the server caps it; default 30). */
  pollSeconds?: number;
}

/** One intent of a step, as `tx.intend(kind, payload, options)` takes it. */
/** Options of `HttpOutbox.startRun` (the body of `POST /runs`). */
export interface HttpStartRunOptions extends Omit<StartRunOptions, "budget"> {
  inputs?: unknown;
  budget?: number;
}

export interface HttpIntent extends IntendOptions {
  kind: string;
  payload: unknown;
}

/** One step: its result, the run's new state and plan, debits and intents. */
export interface StepBody {
  result?: unknown;
  /** Left out: the run's state stays. */
  state?: unknown;
  /** Left out: the run's plan stays. */
  plan?: unknown;
  intents?: HttpIntent[];
  spend?: { amount: number; reason: string }[];
}

/** A record as the API answers it (the fields of the JSON Schemas in `schemas/`). */
export type ApiRecord = { [field: string]: Json };

/** The recorded step and its effects; `replayed` when it had been recorded before. */
export interface StepRecorded {
  step: ApiRecord;
  replayed: boolean;
  effects: ApiRecord[];
}

/** Where an awaited effect is; `done` once it can no longer change by delivery. */
export interface EffectOutcome {
  done: boolean;
  status: string;
  result: Json | null;
  error: string | null;
  effect: ApiRecord;
}

/** A failure of the API that is none of the typed refusals (auth, limits, the server). */
export class HttpApiError extends OutboxError {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
  ) {
    super(`${status} ${code}: ${message}`);
  }
}

interface Refusal {
  error: string;
  code: string;
  field?: string;
  rule?: string;
  key?: string;
}

function typed(status: number, body: Refusal, runId: string | undefined): Error {
  switch (body.code) {
    case "invalid":
      return new ValidationError(body.field ?? "body", undefined, body.error, body.rule);
    case "idempotency_conflict":
      return new IdempotencyConflict(body.key ?? "?", body.error);
    case "run_not_found":
      return new RunNotFound(runId ?? "?");
    case "effect_not_found":
      return new EffectNotFound(body.field ?? "?");
    case "run_terminal":
      return new RunTerminal(runId ?? "?", / is (\w+): /.exec(body.error)?.[1] ?? "ended");
    case "run_state":
      return new RunStateError(body.error);
    case "budget_exceeded": {
      const [, requested, remaining] = /needs (\S+) but only (\S+) remains/.exec(body.error) ?? [];
      return new BudgetExceeded(runId ?? "?", Number(requested), Number(remaining));
    }
    default:
      return new HttpApiError(status, body.code, body.error);
  }
}

/** Statuses worth sending the same call again for (it is idempotent). */
const RETRIED = new Set([500, 502, 503, 504]);

/** Options as the API's fields: `orderingKey` is sent as `ordering_key`; amounts as numbers. */
const camel = (options: object): Record<string, unknown> =>
  Object.fromEntries(
    Object.entries(options).map(([name, value]) => [
      name.replace(/[A-Z]/g, (letter) => `_${letter.toLowerCase()}`),
      name === "cost" || name === "budget" ? (value === undefined ? undefined : Number(value)) : value,
    ]),
  );

/** agent-outbox over HTTP. */
export class HttpOutbox {
  private readonly base: string;
  private readonly attempts: number;
  private readonly backoffMs: number;
  private readonly pollSeconds: number;

  constructor(private readonly options: HttpOutboxOptions) {
    this.base = options.baseUrl.replace(/\/+$/, "") + "/api/v1";
    this.attempts = options.attempts ?? 4;
    this.backoffMs = options.backoffMs ?? 200;
    this.pollSeconds = options.pollSeconds ?? 30;
  }

  /** Start a run; pass `runId` to name it (a repeat then answers the same run). */
  async startRun(
    agent: string,
    version: string,
    options: HttpStartRunOptions = {},
  ): Promise<{ run: ApiRecord; replayed: boolean }> {
    const { inputs, runId, ...rest } = options;
    const body = { agent, version, inputs, run_id: runId ?? randomUUID(), ...camel(rest) };
    return this.call("POST", "/runs", body);
  }

  /** Record step `stepId` of a run atomically; a recorded step answers as it was (`replayed`). */
  async step(runId: string, stepId: string, step: StepBody): Promise<StepRecorded> {
    const body: Record<string, unknown> = {
      step_id: stepId,
      result: step.result ?? null,
      intents: (step.intents ?? []).map(({ kind, payload, ...rest }) => ({ kind, payload: payload ?? null, ...camel(rest) })),
      spend: step.spend ?? [],
    };
    if ("state" in step) body.state = step.state ?? null;
    if ("plan" in step) body.plan = step.plan ?? null;
    return this.call("POST", `/runs/${runId}/steps`, body, runId);
  }

  /** Send signal `name` to a run; the same `dedupKey` is accepted once. */
  async signal(
    runId: string,
    name: string,
    payload: unknown = null,
    options: { dedupKey?: string } = {},
  ): Promise<{ signal_id: string | null; duplicate: boolean; woke_run: boolean }> {
    const body = { name, payload, dedup_key: options.dedupKey ?? randomUUID() };
    return this.call("POST", `/runs/${runId}/signals`, body, runId);
  }

  /** End the run as completed (a repeat keeps the first result). */
  complete(runId: string, result: unknown = null): Promise<{ run: ApiRecord; replayed: boolean }> {
    return this.call("POST", `/runs/${runId}/complete`, { result }, runId);
  }

  /** End the run as failed (a repeat keeps the first error). */
  fail(runId: string, error: unknown): Promise<{ run: ApiRecord; replayed: boolean }> {
    return this.call("POST", `/runs/${runId}/fail`, { error }, runId);
  }

  /** A run and its completed steps. */
  run(runId: string): Promise<{ run: ApiRecord; steps: ApiRecord[] }> {
    return this.call("GET", `/runs/${runId}`, undefined, runId);
  }

  /** One effect and its attempt log. */
  effect(effectId: string): Promise<{ effect: ApiRecord; attempts: ApiRecord[] }> {
    return this.call("GET", `/effects/${effectId}`);
  }

  /** Effects of a run (and step), in intent order. */
  async effects(filter: { runId?: string; stepId?: string; status?: string; kind?: string; limit?: number } = {}): Promise<ApiRecord[]> {
    const query = new URLSearchParams();
    const names = { runId: "run_id", stepId: "step_id", status: "status", kind: "kind", limit: "limit" } as const;
    for (const [name, value] of Object.entries(filter)) {
      if (value !== undefined) query.set(names[name as keyof typeof names], String(value));
    }
    return (await this.call<{ effects: ApiRecord[] }>("GET", `/effects?${query}`)).effects;
  }

  /** Wait, one long poll after another, until the effect has ended; `EffectTimeout` after `timeoutMs`. */
  async waitForEffect(effectId: string, options: { timeoutMs?: number } = {}): Promise<EffectOutcome> {
    const deadline = Date.now() + (options.timeoutMs ?? 60_000);
    for (;;) {
      const left = Math.max(0, Math.min(this.pollSeconds, (deadline - Date.now()) / 1000));
      const outcome = await this.call<EffectOutcome>("GET", `/effects/${effectId}/outcome?wait=${left}`);
      if (outcome.done) return outcome;
      if (Date.now() >= deadline) throw new EffectTimeout(effectId, outcome.status);
    }
  }

  private async call<T>(method: string, path: string, body?: unknown, runId?: string): Promise<T> {
    const init: RequestInit = {
      method,
      headers: { Authorization: `Bearer ${this.options.token}`, "Content-Type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
    };
    let lastError: unknown;
    for (let attempt = 1; attempt <= this.attempts; attempt++) {
      if (attempt > 1) await new Promise((done) => setTimeout(done, this.backoffMs * 2 ** (attempt - 2)));
      let answer: Response;
      try {
        answer = await fetch(this.base + path, init);
      } catch (error) {
        lastError = error; // not sent, or its answer lost: the call is safe to send again
        continue;
      }
      const text = await answer.text();
      let parsed: unknown;
      try {
        parsed = JSON.parse(text);
      } catch {
        parsed = { error: text.slice(0, 200), code: "not_json" };
      }
      if (answer.ok) return parsed as T;
      lastError = typed(answer.status, parsed as Refusal, runId);
      if (!RETRIED.has(answer.status)) throw lastError;
    }
    throw lastError instanceof Error ? lastError : new HttpApiError(0, "unreachable", String(lastError));
  }
}
