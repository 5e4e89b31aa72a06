/**
 * TypeScript writes, Python delivers: intents committed by this client reach a
 * real idempotent HTTP sink through `python -m outbox deliver`, and a
 * deliverer killed with SIGKILL mid-flow loses nothing and applies nothing twice.
 *
 * Needs OUTBOX_DSN, OUTBOX_SINK_URL (deliverers.testing.IdempotentHttpSink) and
 * OUTBOX_PYTHON (an interpreter with agent-outbox installed); the pytest test
 * tests/integration/test_typescript_client.py provides them.
 */

import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { mkdtempSync, openSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Outbox } from "../src/index.js";
import { dsn, required } from "./support/env.js";

const KIND = "http.request";
let outbox: Outbox;
let workdir: string;

before(async () => {
  outbox = new Outbox({ connectionString: dsn() });
  workdir = mkdtempSync(join(tmpdir(), "outbox-ts-delivery-"));
  writeFileSync(join(workdir, "deliverers.toml"), `[kinds."${KIND}"]\nallow_private = ["127.0.0.1"]\n`);
});

after(async () => {
  await outbox.close();
});

function deliverer(name: string): ChildProcess {
  const log = openSync(join(workdir, `${name}.log`), "a");
  const args = ["-m", "outbox", "deliver", "--config", join(workdir, "deliverers.toml"), "--kind", KIND];
  // Two calls at a time against a slow sink: the kill lands with calls in flight.
  args.push("--concurrency", "2", "--batch-size", "2", "--lease", "1", "--poll", "0.2");
  return spawn(required("OUTBOX_PYTHON"), args, { env: process.env, stdio: ["ignore", log, log] });
}

async function statuses(runId: string): Promise<Record<string, number>> {
  const { rows } = await outbox.pool.query<{ status: string; n: string }>(
    "SELECT status, count(*) AS n FROM outbox_effects WHERE run_id = $1 GROUP BY status",
    [runId],
  );
  return Object.fromEntries(rows.map((r) => [r.status, Number(r.n)]));
}

async function until(what: string, condition: () => Promise<boolean>, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await condition())) {
    if (Date.now() > deadline) {
      throw new Error(`timed out waiting for ${what}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

async function exited(child: ChildProcess): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
  if (child.exitCode !== null || child.signalCode !== null) {
    return { code: child.exitCode, signal: child.signalCode };
  }
  const [code, signal] = (await once(child, "exit")) as [number | null, NodeJS.Signals | null];
  return { code, signal };
}

test("a deliverer killed mid-flow: nothing lost, nothing applied twice", { timeout: 180_000 }, async () => {
  const sink = required("OUTBOX_SINK_URL");
  const total = 30;
  // The sink may have served an earlier run of these tests: count from here, and name
  // this run's operations after it.
  const before = (await (await fetch(`${sink}/stats`)).json()) as Record<string, number>;
  const run = await outbox.startRun("orders", "1", { batch: "kill-9" });
  const ids: string[] = [];
  for (let step = 0; step < 3; step++) {
    await run.transaction(`notify-${step}`, async (tx) => {
      for (let i = 0; i < total / 3; i++) {
        const operation = `ts-order-${run.id}-${step}-${i}`;
        ids.push((await tx.intend(KIND, { url: `${sink}/orders`, json: { operation } })).id);
      }
    });
  }

  const doomed = deliverer("doomed");
  await until("some deliveries", async () => ((await statuses(run.id)).succeeded ?? 0) >= 4);
  doomed.kill("SIGKILL");
  assert.equal((await exited(doomed)).signal, "SIGKILL");
  const atKill = await statuses(run.id);
  assert.ok((atKill.succeeded ?? 0) < total, `killed mid-flow: ${JSON.stringify(atKill)}`);

  const survivor = deliverer("survivor");
  try {
    await until("every effect delivered", async () => (await statuses(run.id)).succeeded === total);
  } finally {
    survivor.kill("SIGTERM");
    const { code } = await exited(survivor);
    assert.equal(code, 0, readFileSync(join(workdir, "survivor.log"), "utf8"));
  }

  const stats = (await (await fetch(`${sink}/stats`)).json()) as Record<string, unknown>;
  const keys = new Set(await Promise.all(ids.map(async (id) => (await outbox.effect(id)).idempotencyKey)));
  const ours = (list: unknown, mine: (item: string) => boolean): string[] => (list as string[]).filter(mine);
  assert.deepEqual(ours(stats.duplicate_keys_applied, (k) => keys.has(k)), [], "no key applied twice");
  assert.deepEqual(ours(stats.duplicate_operations, (o) => o.includes(run.id)), [], "no operation applied twice");
  assert.equal((stats.keys_applied as number) - (before.keys_applied ?? 0), total, "no intent lost");
  assert.equal((stats.operations_applied as number) - (before.operations_applied ?? 0), total);
  const first = await outbox.waitForEffect(ids[0]!, { timeoutMs: 1000 });
  assert.equal(first.status, "succeeded");
  assert.ok(first.attempt >= 1);
});
