import assert from "node:assert/strict";
import { randomInt, randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import pg from "pg";

import { ValidationError, compensationKey, deriveKey } from "../src/index.js";
import { dsn } from "./support/env.js";

let client: pg.Client;

before(async () => {
  client = new pg.Client({ connectionString: dsn() });
  await client.connect();
});

after(async () => {
  await client.end();
});

test("keys match the ones Python derives", () => {
  // outbox.keys.derive_key and compensation_key on the same inputs
  assert.equal(
    deriveKey("12345678-1234-5678-1234-567812345678", "send-summary", 0),
    "13777fd3746ea81c2931cafbf22f45088a09c6a2fbfa702c1c694a15c8dfe7df",
  );
  assert.equal(
    deriveKey("01A22F67-0009-7B28-82BE-F8F62F402E8F", "ünï-çødé ✓ 𝄞", 1234567),
    "33c034da87262c1a3e50832422cab0e985ff0fa67b9a829352acd7f55ac3a5cb",
  );
  assert.equal(compensationKey("abc"), "a6dfad1581e6d7833d026b1dbad5da16f4001a3b248f7c5f815f4dedf76a703c");
});

function randomText(): string {
  const pool = ["a", "Z", "-", " ", "é", "✓", "𝄞", "鍵", "\n", "\u2028", "0", "\\", '"'];
  let text = "";
  for (let i = randomInt(0, 12); i > 0; i--) {
    text += pool[randomInt(0, pool.length)];
  }
  return text;
}

test("keys match the ones SQL derives over many inputs", async () => {
  const triples = Array.from({ length: 500 }, () => [randomUUID(), randomText(), randomInt(0, 2 ** 31 - 1)] as const);
  const { rows } = await client.query<{ key: string }>(
    `SELECT outbox_derive_key(r, s, i) AS key
       FROM unnest($1::uuid[], $2::text[], $3::integer[]) WITH ORDINALITY AS t(r, s, i, n) ORDER BY n`,
    [triples.map((t) => t[0]), triples.map((t) => t[1]), triples.map((t) => t[2])],
  );
  assert.deepEqual(
    rows.map((r) => r.key),
    triples.map(([r, s, i]) => deriveKey(r, s, i)),
  );
});

test("a key needs a UUID and a non-negative integer index", () => {
  assert.throws(() => deriveKey("not-a-uuid", "s", 0), ValidationError);
  assert.throws(() => deriveKey(randomUUID(), "s", -1), ValidationError);
  assert.throws(() => deriveKey(randomUUID(), "s", 1.5), ValidationError);
});
