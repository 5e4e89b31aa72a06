/** What the tests need from their environment; missing is a failure, never a skip. */

export function required(name: string): string {
  const value = process.env[name];
  if (!value) {
    throw new Error(`${name} is not set: run these tests through tests/integration/test_typescript_client.py`);
  }
  return value;
}

export const dsn = (): string => required("OUTBOX_DSN");
