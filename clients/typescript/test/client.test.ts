import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import {
  BudgetExceeded,
  EffectNotFound,
  EffectTimeout,
  IdempotencyConflict,
  Outbox,
  PayloadError,
  RunExists,
  RunNotFound,
  RunTerminal,
  ValidationError,
  deriveKey,
} from "../src/index.js";
import { dsn } from "./support/env.js";

let outbox: Outbox;

before(async () => {
  outbox = new Outbox({ connectionString: dsn() });
  await outbox.pool.query("CREATE TABLE IF NOT EXISTS ts_orders (id text PRIMARY KEY, total numeric NOT NULL)");
  // The tests' own table: emptied, so that running them again on the same database works.
  await outbox.pool.query("DELETE FROM ts_orders");
});

after(async () => {
  await outbox.close();
});

async function count(sql: string, values: unknown[] = []): Promise<number> {
  const { rows } = await outbox.pool.query<{ n: string }>(`SELECT count(*) AS n FROM ${sql}`, values);
  return Number(rows[0]!.n);
}

class Boom extends Error {}

test("a step commits its checkpoint, intents and the caller's rows together", async () => {
  const run = await outbox.startRun("shop", "1", { order: "o-1" });
  const result = await run.transaction("place", async (tx) => {
    await tx.query("INSERT INTO ts_orders (id, total) VALUES ($1, $2)", ["o-1", 99.5]);
    const email = await tx.intend("email.send", { to: "ap@example.com", order: "o-1" });
    const sms = await tx.intend("sms.send", { to: "+100" }, { orderingKey: "customer-1" });
    tx.setState({ cursor: 1 });
    tx.setPlan(["place", "ship"]);
    return { email: email.idempotencyKey, sms: sms.idempotencyKey };
  });
  assert.deepEqual(result, { email: deriveKey(run.id, "place", 0), sms: deriveKey(run.id, "place", 1) });
  const status = await run.status();
  assert.deepEqual([status.status, status.state, status.plan, status.currentStep], ["runnable", { cursor: 1 }, ["place", "ship"], "place"]);
  assert.equal(await count("ts_orders WHERE id = 'o-1'"), 1);
  assert.equal(await count("outbox_effects WHERE run_id = $1", [run.id]), 2);
  const effect = await outbox.effectByKey(result.email);
  assert.deepEqual([effect.kind, effect.status, effect.runId, effect.stepId, effect.stepIndex], ["email.send", "pending", run.id, "place", 0]);
});

test("a step that throws writes nothing, and can be taken again", async () => {
  const run = await outbox.startRun("shop", "1", { order: "o-2" });
  let calls = 0;
  const place = async (fail: boolean) =>
    run.transaction("place", async (tx) => {
      calls += 1;
      await tx.query("INSERT INTO ts_orders (id, total) VALUES ($1, $2)", ["o-2", 10]);
      await tx.intend("email.send", { order: "o-2" });
      tx.setState({ placed: true });
      if (fail) {
        throw new Boom("payment service timed out");
      }
      return "placed";
    });
  await assert.rejects(place(true), Boom);
  assert.equal(await count("ts_orders WHERE id = 'o-2'"), 0);
  assert.equal(await count("outbox_effects WHERE run_id = $1", [run.id]), 0);
  assert.deepEqual((await run.status()).state, {});
  assert.equal(await place(false), "placed");
  assert.equal(await place(false), "placed", "the recorded result is replayed");
  assert.equal(calls, 2, "a recorded step does not run again");
  assert.equal(await count("outbox_effects WHERE run_id = $1", [run.id]), 1);
});

test("two processes racing on one step make one set of rows; both get the winner's result", async () => {
  const run = await outbox.startRun("shop", "1", { order: "o-3" });
  const other = new Outbox({ connectionString: dsn() });
  try {
    let release!: () => void;
    const hold = new Promise<void>((resolve) => (release = resolve));
    const first = run.transaction("place", async (tx) => {
      await tx.intend("email.send", { order: "o-3", by: "first" });
      await hold;
      return "first";
    });
    const second = other.run(run.id).transaction("place", async (tx) => {
      release();
      await tx.intend("email.send", { order: "o-3", by: "second" });
      return "second";
    });
    const results = await Promise.all([first, second]);
    assert.equal(results[0], results[1]);
    assert.equal(await count("outbox_effects WHERE run_id = $1", [run.id]), 1);
    assert.equal(await count("outbox_steps WHERE run_id = $1", [run.id]), 1);
  } finally {
    await other.close();
  }
});

test("a step joins the caller's open transaction", async () => {
  const run = await outbox.startRun("shop", "1", { order: "o-4" });
  const client = await outbox.pool.connect();
  try {
    await client.query("BEGIN");
    await client.query("INSERT INTO ts_orders (id, total) VALUES ('o-4', 1)");
    await run.transaction("place", async (tx) => tx.intend("email.send", { order: "o-4" }), { client });
    await client.query("ROLLBACK");
  } finally {
    client.release();
  }
  assert.equal(await count("ts_orders WHERE id = 'o-4'"), 0);
  assert.equal(await count("outbox_steps WHERE run_id = $1", [run.id]), 0, "rolled back with the caller");
});

test("plain intents of no run commit with the caller's rows", async () => {
  const key = `order-o-5-${randomUUID()}`;
  const made = await outbox.transaction(async (tx) => {
    await tx.query("INSERT INTO ts_orders (id, total) VALUES ('o-5', 5)");
    return tx.intend("email.send", { order: "o-5" }, { key });
  });
  assert.equal(made.created, true);
  const again = await outbox.transaction((tx) => tx.intend("email.send", { order: "o-5" }, { key }));
  assert.deepEqual(again, { ...made, created: false });
  await assert.rejects(
    outbox.transaction((tx) => tx.intend("email.send", { order: "o-5", changed: true }, { key })),
    IdempotencyConflict,
  );
  await assert.rejects(
    outbox.transaction((tx) => tx.intend("sms.send", { order: "o-5" }, { key })),
    (error: IdempotencyConflict) => error.key === key && /kind/.test(error.reason),
  );
});

test("bad input is refused with the field named, and nothing is written", async () => {
  const run = await outbox.startRun("shop", "1");
  const cases: [() => Promise<unknown>, typeof ValidationError, string][] = [
    [() => run.transaction("s", (tx) => tx.intend("bad kind", {})), ValidationError, "kind"],
    [() => run.transaction("s", (tx) => tx.intend("k", { n: Number.NaN })), PayloadError, "payload"],
    [() => run.transaction("s", (tx) => tx.intend("k", { t: "a\u0000b" })), PayloadError, "payload"],
    [() => run.transaction("s", (tx) => tx.intend("k", "\ud800")), PayloadError, "payload"],
    [() => run.transaction("s", (tx) => tx.intend("k", { headers: { "Transfer-Encoding": "chunked" } })), ValidationError, "payload.headers"],
    [() => run.transaction("s", (tx) => tx.intend("k", { url: "https://u:p@example.com/" })), ValidationError, "payload.url"],
    [() => run.transaction("s", (tx) => tx.intend("k", {}, { key: "a\r\nb" })), ValidationError, "key"],
    [() => run.transaction("s", (tx) => tx.intend("k", {}, { maxAttempts: 0 })), ValidationError, "max_attempts"],
    [() => run.transaction("s", (tx) => tx.intend("k", {}, { cost: "NaN" })), ValidationError, "cost"],
    [() => run.transaction("", async () => 1), ValidationError, "step_id"],
    [() => outbox.startRun("", "1"), ValidationError, "agent"],
    [() => outbox.startRun("a", "1", undefined, { runId: "nope" }), ValidationError, "runId"],
  ];
  for (const [call, type, field] of cases) {
    await assert.rejects(call(), (error: ValidationError) => error instanceof type && error.field === field, field);
  }
  await assert.rejects(
    run.transaction("s", (tx) => tx.intend("k", { headers: { Cookie: "sid=1" } })),
    (error: ValidationError) => error.rule === "credential-header",
  );
  assert.equal(await count("outbox_effects WHERE run_id = $1", [run.id]), 0);
  assert.equal(await count("outbox_steps WHERE run_id = $1", [run.id]), 0);
});

test("budgets: costs are reserved, debits spent, and a step beyond the budget commits nothing", async () => {
  const run = await outbox.startRun("shop", "1", null, { budget: 10 });
  await run.transaction("charge", async (tx) => {
    await tx.spend(1.5, "model call");
    await tx.intend("charge.create", { amount: 3 }, { cost: 3 });
  });
  const status = await run.status();
  assert.deepEqual([status.spent, status.reserved], ["1.5", "3"]);
  await assert.rejects(
    run.transaction("too-much", (tx) => tx.spend(6, "model call")),
    (error: BudgetExceeded) => error instanceof BudgetExceeded && error.requested === 6 && error.remaining === 5.5,
  );
  assert.equal((await run.status()).spent, "1.5");
});

test("call records a result once", async () => {
  const run = await outbox.startRun("shop", "1");
  let calls = 0;
  const fetch = () => run.call("fetch", async () => ({ calls: ++calls }));
  assert.deepEqual(await fetch(), { calls: 1 });
  assert.deepEqual(await fetch(), { calls: 1 });
});

test("signals are stored once per dedup key; a finished run refuses them", async () => {
  const run = await outbox.startRun("shop", "1");
  const first = await outbox.signal(run.id, "approve", { by: "ops" }, { dedupKey: "d-1" });
  const again = await outbox.signal(run.id, "approve", { by: "ops" }, { dedupKey: "d-1" });
  assert.equal(first.duplicate, false);
  assert.deepEqual(again, { signalId: null, duplicate: true, wokeRun: false });
  await run.complete({ ok: true });
  assert.equal((await run.status()).status, "completed");
  await assert.rejects(outbox.signal(run.id, "approve"), RunTerminal);
  await assert.rejects(run.transaction("late", async () => 1), RunTerminal);
  await assert.rejects(outbox.signal(randomUUID(), "approve"), RunNotFound);
});

test("an effect's outcome is read and awaited", async () => {
  const made = await outbox.transaction((tx) => tx.intend("never.delivered", { n: 1 }));
  const found = await outbox.effect(made.id);
  assert.deepEqual([found.status, found.attempt, found.idempotencyKey], ["pending", 0, made.idempotencyKey]);
  await assert.rejects(outbox.waitForEffect(made.id, { timeoutMs: 100 }), EffectTimeout);
  await outbox.pool.query(
    "UPDATE outbox_effects SET status = 'succeeded', result = '{\"sent\": true}', completed_at = now() WHERE id = $1",
    [made.id],
  );
  const done = await outbox.waitForEffect(made.id, { timeoutMs: 5000 });
  assert.deepEqual([done.status, done.result], ["succeeded", { sent: true }]);
  await assert.rejects(outbox.effect(randomUUID()), EffectNotFound);
});

test("a run's business key, priority and fairness key; its effects inherit them or set their own", async () => {
  const key = `order-${randomUUID()}`;
  const options = { key, priority: 5, fairnessKey: "tenant-a" };
  const run = await outbox.startRun("shop", "1", { order: key }, options);
  const again = await outbox.startRun("shop", "1", { order: key }, options);
  assert.equal(again.id, run.id);
  await assert.rejects(
    outbox.startRun("shop", "1", { order: key }, { ...options, onConflict: "reject" }),
    (error: RunExists) => error instanceof RunExists && error.runId === run.id,
  );
  await assert.rejects(outbox.startRun("shop", "1", {}, { priority: 1e9 }), (error: ValidationError) => error.field === "priority");
  const [inherited, own, gated] = await run.transaction("notify", async (tx) => [
    await tx.intend("email.send", { to: "a@example.com" }),
    await tx.intend("email.send", { to: "b@example.com" }, { priority: -2, fairnessKey: "tenant-b" }),
    await tx.intend("payment.send", { amount: 900 }, { approval: { timeout: 3600, on_timeout: "reject" } }),
  ]);
  const { rows } = await outbox.pool.query<{ id: string; priority: number; fairness_key: string; status: string }>(
    "SELECT id, priority, fairness_key, status FROM outbox_effects WHERE run_id = $1",
    [run.id],
  );
  const byId = new Map(rows.map((row) => [row.id, row]));
  assert.deepEqual(
    [inherited!, own!, gated!].map((intent) => {
      const row = byId.get(intent.id)!;
      return [row.priority, row.fairness_key, row.status];
    }),
    [
      [5, "tenant-a", "pending"],
      [-2, "tenant-b", "pending"],
      [5, "tenant-a", "awaiting_approval"],
    ],
  );
});

test("a dry run started from TypeScript is one; its intents go to the dry-run namespace", async () => {
  const run = await outbox.startRun("shop", "1", { order: "dry" }, { mode: "dry_run" });
  const intent = await run.transaction("notify", (tx) => tx.intend("email.send", { to: "ap@example.com" }));
  const effect = await outbox.effect(intent.id);
  assert.ok(effect.kind.startsWith("dry-run:"), effect.kind);
  await assert.rejects(
    outbox.startRun("shop", "1", {}, { mode: "rehearsal" as "live" }),
    (error: ValidationError) => error.field === "mode",
  );
});

test("timestamps read back as dates whatever DateStyle the DSN or the server sets", async () => {
  // node-postgres reads timestamps only in the ISO style: under 'SQL, DMY' a
  // timestamp reads '07/12/2026 22:58:51.12 UTC', which it cannot parse
  const base = dsn();
  const options = encodeURIComponent("-c DateStyle=SQL,DMY");
  const other = new Outbox({ connectionString: `${base}${base.includes("?") ? "&" : "?"}options=${options}` });
  try {
    const run = await other.startRun("shop", "1", { order: "o-datestyle" });
    const { idempotencyKey } = await run.transaction("place", (tx) => tx.intend("email.send", { to: "d@example.com" }));
    const effect = await other.effectByKey(idempotencyKey);
    const [{ now }] = (await other.pool.query<{ now: Date }>("SELECT now()")).rows as [{ now: Date }];
    for (const at of [effect.createdAt, effect.updatedAt]) {
      assert.ok(at instanceof Date && !Number.isNaN(at.getTime()), `${String(at)} is not a date`);
      assert.ok(Math.abs(now.getTime() - at.getTime()) < 60_000, `${at.toISOString()} is not ${now.toISOString()}`);
    }
    // the DSN's day-month order is the session's still: only the output style is ISO's
    const { rows } = await other.pool.query<{ DateStyle: string }>("SHOW DateStyle");
    assert.equal(rows[0]!.DateStyle, "ISO, DMY");
  } finally {
    await other.close();
  }
});
