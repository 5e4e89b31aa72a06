/**
 * A TypeScript order service on agent-outbox.
 *
 * Placing an order writes the order row and the intent to send its
 * confirmation email in ONE PostgreSQL transaction: either both exist or
 * neither does, so there is never an order without its email, nor an email
 * about an order that was rolled back. A Python deliverer (`outbox deliver`)
 * sends the email once, with a stable idempotency key, however often it is
 * retried or restarted; this service then reads the email's outcome.
 *
 *     node dist/order-service.js ORDER_ID CUSTOMER_EMAIL TOTAL
 *
 * Environment: OUTBOX_DSN (the outbox database), EMAIL_API_URL (where the
 * deliverer posts emails; default the sample sink, http://127.0.0.1:8080/email).
 */

import { createHash } from "node:crypto";

import { Outbox, type EffectStatus } from "agent-outbox";

const outbox = new Outbox({ connectionString: process.env.OUTBOX_DSN });
const emailApi = process.env.EMAIL_API_URL ?? "http://127.0.0.1:8080/email";

/** One run per order, its id derived from the order's: a retried request finds the same run. */
function runIdFor(orderId: string): string {
  const hex = createHash("sha256").update(`order:${orderId}`).digest("hex");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20, 32)}`;
}

async function placeOrder(orderId: string, customer: string, total: string): Promise<string> {
  // A retried request (same order, same details) starts nothing new, and the
  // recorded step replays: no second order row, no second email.
  const run = await outbox.startRun("order-service", "1", { orderId, customer, total }, { runId: runIdFor(orderId) });
  const placed = await run.transaction("place-order", async (tx) => {
    await tx.query("INSERT INTO shop_orders (id, customer, total) VALUES ($1, $2, $3)", [orderId, customer, total]);
    const email = await tx.intend("email.send", {
      url: emailApi,
      json: {
        to: customer,
        subject: `Order ${orderId} confirmed`,
        text: `Thank you: we received your order of ${total}.`,
        operation: `order-confirmation-${orderId}`,
      },
    });
    tx.setState({ orderId, emailId: email.id });
    return { emailId: email.id, emailKey: email.idempotencyKey };
  });
  if ((await run.status()).status !== "completed") {
    await run.complete(placed);
  }
  return placed.emailId;
}

async function main(): Promise<void> {
  const [orderId, customer, total] = process.argv.slice(2);
  if (!orderId || !customer || !total) {
    console.error("usage: node dist/order-service.js ORDER_ID CUSTOMER_EMAIL TOTAL");
    process.exitCode = 2;
    return;
  }
  await outbox.pool.query(
    `CREATE TABLE IF NOT EXISTS shop_orders (
       id text PRIMARY KEY, customer text NOT NULL, total numeric NOT NULL,
       placed_at timestamptz NOT NULL DEFAULT now())`,
  );
  const emailId = await placeOrder(orderId, customer, total);
  console.log(`order ${orderId} placed; confirmation email ${emailId} intended`);
  const email: EffectStatus = await outbox.waitForEffect(emailId, { timeoutMs: 60_000 });
  console.log(JSON.stringify({ order: orderId, email: email.status, attempts: email.attempt, result: email.result }));
}

try {
  await main();
} finally {
  await outbox.close();
}
