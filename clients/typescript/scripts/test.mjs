// `npm test`: the client's tests need a migrated PostgreSQL, a sink, Python deliverers and
// an `outbox serve`. With their five variables set (as the Python suite sets them), the
// tests run here. Without them, the Python suite's test starts all of that and runs
// `npm test` again with the variables set: tests/integration/test_typescript_client.py.
import { spawnSync } from "node:child_process";
import { mkdtempSync, readdirSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const client = resolve(here, "..");
const repository = resolve(client, "..", "..");
const NEEDED = ["OUTBOX_DSN", "OUTBOX_SINK_URL", "OUTBOX_PYTHON", "OUTBOX_API_URL", "OUTBOX_API_TOKEN"];
const SUITE = "tests/integration/test_typescript_client.py";

function run(command, args, cwd) {
  const done = spawnSync(command, args, { cwd, stdio: "inherit", env: process.env });
  if (done.error) {
    console.error(`${command}: ${done.error.message}`);
    return 1;
  }
  return done.status ?? 1;
}

const missing = NEEDED.filter((name) => !process.env[name]);
if (missing.length === 0) {
  // The tests run from a build of their own, inside the client (so `pg` resolves from its
  // node_modules): a build of dist/ by anything else meanwhile truncates the files it
  // rewrites, and a test file loaded at that moment would see a module with no exports.
  const out = mkdtempSync(join(client, ".test-build-"));
  try {
    const tsc = join(client, "node_modules", "typescript", "bin", "tsc");
    process.exitCode = run(process.execPath, [tsc, "-p", ".", "--outDir", out], client);
    if (process.exitCode === 0) {
      const files = readdirSync(join(out, "test")).filter((f) => f.endsWith(".test.js"));
      const tests = files.sort().map((f) => join(out, "test", f));
      process.exitCode = run(process.execPath, ["--test", "--test-concurrency=1", ...tests], client);
    }
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
  process.exit();
}

// A Python that has agent-outbox and its test extra: the suite starts what the tests need.
const candidates = [process.env.OUTBOX_PYTHON, "python3", "python"].filter(Boolean);
const python = candidates.find(
  (p) => spawnSync(p, ["-c", "import outbox, pytest, deliverers"], { cwd: repository, stdio: "ignore" }).status === 0,
);
if (python === undefined) {
  console.error(
    `These tests need ${missing.join(", ")}: a migrated PostgreSQL, a sink, Python deliverers ` +
      `and an \`outbox serve\`. The Python suite starts them all: at the repository root, ` +
      `\`pip install -e '.[test]'\` (in a virtualenv), then \`npm test\` here again, or ` +
      `\`pytest ${SUITE}\` there.`,
  );
  process.exit(1);
}
console.error(
  `${missing.join(", ")} not set: running the tests under the Python suite ` +
    `(${python} -m pytest ${SUITE}), which starts PostgreSQL, a sink, deliverers and outbox serve.`,
);
process.exit(
  run(python, ["-m", "pytest", SUITE, "-q", "-p", "no:cacheprovider", "-k", "the_typescript_clients_tests_pass"], repository),
);
