/**
 * The client over the HTTP API of a real `outbox serve` (started by
 * tests/integration/test_typescript_client.py: OUTBOX_API_URL, OUTBOX_API_TOKEN),
 * and one effect delivered by `python -m outbox deliver` to the suite's
 * idempotent sink, awaited with the long poll.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtempSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import {
  BudgetExceeded,
  HttpApiError,
  HttpOutbox,
  IdempotencyConflict,
  RunNotFound,
  RunTerminal,
  ValidationError,
  deriveKey,
} from "../src/index.js";
import { required } from "./support/env.js";

const api = (): HttpOutbox => new HttpOutbox({ baseUrl: required("OUTBOX_API_URL"), token: required("OUTBOX_API_TOKEN") });

test("http: a step with intents is recorded once and replayed on a retry", async () => {
  const outbox = api();
  const { run } = await outbox.startRun("shop-http", "1", { inputs: { order: "h-1" } });
  const runId = String(run.id);
  const step = { result: { placed: true }, state: { cursor: 1 }, intents: [{ kind: "email.send", payload: { to: "a@example.com" } }, { kind: "sms.send", payload: { to: "+1" }, orderingKey: "c-1" }] };
  const first = await outbox.step(runId, "place", step);
  const again = await outbox.step(runId, "place", step);
  assert.deepEqual([first.replayed, again.replayed], [false, true]);
  assert.deepEqual(first.effects.map((e) => e.idempotency_key), [deriveKey(runId, "place", 0), deriveKey(runId, "place", 1)]);
  assert.deepEqual(again.effects.map((e) => e.id), first.effects.map((e) => e.id));
  assert.deepEqual((await outbox.run(runId)).run.state, { cursor: 1 });
  assert.equal((await outbox.effects({ runId })).length, 2);
});

test("http: a start and a signal are safe to repeat by their ids", async () => {
  const outbox = api();
  const runId = randomUUID();
  const one = await outbox.startRun("shop-http", "1", { runId, inputs: { n: 1 } });
  const two = await outbox.startRun("shop-http", "1", { runId, inputs: { n: 1 } });
  assert.deepEqual([one.replayed, two.replayed, two.run.id], [false, true, runId]);
  await assert.rejects(outbox.startRun("shop-http", "2", { runId, inputs: { n: 1 } }), (e: unknown) => e instanceof HttpApiError && e.code === "run_conflict" && e.status === 409);
  const sent = await outbox.signal(runId, "approval", { by: "cfo" }, { dedupKey: "mail-1" });
  const resent = await outbox.signal(runId, "approval", { by: "cfo" }, { dedupKey: "mail-1" });
  assert.deepEqual([sent.duplicate, resent.duplicate], [false, true]);
  const done = await outbox.complete(runId, { total: 1 });
  const doneAgain = await outbox.complete(runId, { total: 2 });
  assert.deepEqual([done.replayed, doneAgain.replayed, doneAgain.run.result], [false, true, { total: 1 }]);
  await assert.rejects(outbox.step(runId, "late", {}), RunTerminal);
});

test("http: refusals are the typed errors, naming the field and the rule", async () => {
  const outbox = api();
  const { run } = await outbox.startRun("shop-http", "1", { budget: 1 });
  const runId = String(run.id);
  await assert.rejects(
    outbox.step(runId, "s", { intents: [{ kind: "http.request", payload: { url: "https://x.example", headers: { Cookie: "a" } } }] }),
    (e: unknown) => e instanceof ValidationError && e.field === "intents[0].payload.headers" && e.rule === "credential-header",
  );
  await assert.rejects(outbox.step(runId, "s", { spend: [{ amount: 5, reason: "llm" }] }), (e: unknown) => e instanceof BudgetExceeded && e.requested === 5 && e.remaining === 1);
  await outbox.step(runId, "k", { intents: [{ kind: "k", payload: { a: 1 }, key: `mine-${runId}` }] });
  const other = String((await outbox.startRun("shop-http", "1")).run.id);
  await assert.rejects(outbox.step(other, "k", { intents: [{ kind: "k", payload: { a: 2 }, key: `mine-${runId}` }] }), (e: unknown) => e instanceof IdempotencyConflict && e.key === `mine-${runId}`);
  await assert.rejects(outbox.run(randomUUID()), RunNotFound);
  const anonymous = new HttpOutbox({ baseUrl: required("OUTBOX_API_URL"), token: "not-the-token-0123456789" });
  await assert.rejects(anonymous.run(runId), (e: unknown) => e instanceof HttpApiError && e.status === 401);
});

async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
  const port = (server.address() as { port: number }).port;
  await new Promise((done) => server.close(done));
  return port;
}

test("http: calls are retried while the server is away, and the long poll returns the outcome", { timeout: 120_000 }, async () => {
  // A client pointed at a port where nothing listens yet: it retries until the server is up.
  const port = await freePort();
  const late = new HttpOutbox({ baseUrl: `http://127.0.0.1:${port}`, token: required("OUTBOX_API_TOKEN"), attempts: 8, backoffMs: 250 });
  const python = required("OUTBOX_PYTHON");
  const serve = spawn(python, ["-m", "outbox", "serve", "--port", String(port), "--no-console"], { env: process.env, stdio: "ignore" });
  const workdir = mkdtempSync(join(tmpdir(), "outbox-ts-http-"));
  writeFileSync(join(workdir, "deliverers.toml"), `[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n`);
  const deliver = spawn(python, ["-m", "outbox", "deliver", "--config", join(workdir, "deliverers.toml"), "--kind", "http.request", "--poll", "0.2"], { env: process.env, stdio: "ignore" });
  try {
    const runId = randomUUID();
    const { run } = await late.startRun("shop-http", "1", { runId });
    assert.equal(run.id, runId);
    const sink = required("OUTBOX_SINK_URL");
    const recorded = await late.step(runId, "notify", { intents: [{ kind: "http.request", payload: { url: `${sink}/orders`, json: { operation: `http-${runId}` } } }] });
    const outcome = await late.waitForEffect(String(recorded.effects[0]!.id), { timeoutMs: 60_000 });
    assert.deepEqual([outcome.done, outcome.status], [true, "succeeded"]);
  } finally {
    serve.kill("SIGTERM");
    deliver.kill("SIGTERM");
  }
});

test("http: a run's business key, priority, fairness key and mode reach the API", async () => {
  const outbox = api();
  const key = `http-order-${randomUUID()}`;
  const options = { inputs: { n: 2 }, key, priority: 3, fairnessKey: "tenant-h", mode: "dry_run" as const };
  const { run } = await outbox.startRun("shop-http", "1", options);
  assert.deepEqual([run.key, run.priority, run.fairness_key, run.dry_run], [key, 3, "tenant-h", true]);
  const again = await outbox.startRun("shop-http", "1", options);
  assert.equal(again.run.id, run.id);
  const recorded = await outbox.step(String(run.id), "pay", {
    intents: [{ kind: "email.send", payload: { to: "c@example.com" }, priority: 7, fairnessKey: "tenant-i" }],
  });
  assert.deepEqual(
    [recorded.effects[0]!.priority, recorded.effects[0]!.fairness_key],
    [7, "tenant-i"],
  );
});
