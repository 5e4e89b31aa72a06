/**
 * Reads JSON lines `[runId, stepId, index]` on stdin and writes the derived key
 * of each on stdout: the Python property test compares them with outbox.keys
 * and outbox_derive_key (tests/integration/test_typescript_client.py).
 */

import { createInterface } from "node:readline";

import { deriveKey } from "../../src/index.js";

const lines = createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) {
    continue;
  }
  const [runId, stepId, index] = JSON.parse(line) as [string, string, number];
  process.stdout.write(`${deriveKey(runId, stepId, index)}\n`);
}
