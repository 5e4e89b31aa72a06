/**
 * Idempotency keys, derived exactly as `outbox.keys` (Python) and
 * `outbox_derive_key` (SQL) derive them: hex sha256 over length-prefixed parts
 * (an 8-byte big-endian byte length, then the UTF-8 bytes).
 */

import { createHash } from "node:crypto";

import { ValidationError } from "./errors.js";

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/** A UUID in the text form PostgreSQL and Python print (lower case, hyphenated). */
export function canonicalUuid(value: string, field = "runId"): string {
  if (typeof value !== "string" || !UUID.test(value)) {
    throw new ValidationError(field, value, "not a UUID");
  }
  return value.toLowerCase();
}

function lengthPrefixed(...parts: string[]): string {
  const digest = createHash("sha256");
  for (const part of parts) {
    const data = Buffer.from(part, "utf8");
    const length = Buffer.alloc(8);
    length.writeBigUInt64BE(BigInt(data.length));
    digest.update(length);
    digest.update(data);
  }
  return digest.digest("hex");
}

/**
 * The default key of the `index`-th intent of step `stepId` in run `runId`:
 * the same triple always gives the same key, so a replayed step re-derives it.
 */
export function deriveKey(runId: string, stepId: string, index: number): string {
  if (!Number.isSafeInteger(index) || index < 0) {
    throw new ValidationError("index", index, "must be a non-negative integer");
  }
  return lengthPrefixed(canonicalUuid(runId), stepId, String(index));
}

/** The key of the effect that compensates (undoes) the effect with `originalKey`. */
export function compensationKey(originalKey: string): string {
  return lengthPrefixed("compensate", originalKey);
}
