/**
 * agent-outbox for TypeScript: a service's own rows and its intended effects
 * commit in one PostgreSQL transaction; agent-outbox's deliverers perform each
 * effect once, with a stable idempotency key.
 */

export {
  Outbox,
  OutboxTransaction,
  Run,
  StepTransaction,
  TERMINAL_EFFECT_STATUSES,
} from "./client.js";
export type {
  EffectStatus,
  Intent,
  IntendOptions,
  Json,
  OutboxOptions,
  Queryable,
  RunStatus,
  SignalReceipt,
  StartRunOptions,
  TransactionOptions,
  WaitOptions,
} from "./client.js";
export {
  BudgetExceeded,
  DatabaseError,
  EffectNotFound,
  EffectTimeout,
  IdempotencyConflict,
  NotFound,
  OutboxError,
  PayloadError,
  RunExists,
  RunNotFound,
  RunPaused,
  RunStateError,
  RunTerminal,
  StepAlreadyRecorded,
  StepFailed,
  ValidationError,
  fromDatabase,
} from "./errors.js";
export { HttpApiError, HttpOutbox } from "./http.js";
export type {
  ApiRecord,
  EffectOutcome,
  HttpIntent,
  HttpOutboxOptions,
  HttpStartRunOptions,
  StepBody,
  StepRecorded,
} from "./http.js";
export { toJson } from "./json.js";
export { canonicalUuid, compensationKey, deriveKey } from "./keys.js";
