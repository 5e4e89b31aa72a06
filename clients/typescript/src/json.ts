/**
 * JSON at the boundary: what JSON.stringify would silently change is refused
 * here, naming the field, before anything reaches the database. (NaN and
 * Infinity would become null; PostgreSQL's jsonb cannot hold a NUL character
 * or a lone surrogate.) Sizes, depth and the payload rules are the SQL API's.
 */

import { PayloadError } from "./errors.js";

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

function checkText(text: string, field: string, what: string): void {
  if (text.includes("\u0000")) {
    throw new PayloadError(field, text, `${what} contains a NUL character, which PostgreSQL cannot store`);
  }
  if (LONE_SURROGATE.test(text)) {
    throw new PayloadError(field, text, `${what} contains a lone surrogate, which is not valid Unicode text`);
  }
}

/** The JSON text of `value` (`undefined` is JSON null), or a PayloadError naming `field`. */
export function toJson(value: unknown, field: string): string {
  let text: string | undefined;
  try {
    text = JSON.stringify(value, function (this: unknown, key: string, item: unknown) {
      checkText(key, field, "a key");
      if (typeof item === "number" && !Number.isFinite(item)) {
        throw new PayloadError(field, String(item), "not valid JSON: NaN and Infinity are not numbers in JSON");
      }
      if (typeof item === "string") {
        checkText(item, field, "a string");
      }
      return item;
    });
  } catch (error) {
    if (error instanceof PayloadError) {
      throw error;
    }
    throw new PayloadError(field, value, `not JSON-serialisable: ${(error as Error).message}`);
  }
  return text ?? "null";
}
