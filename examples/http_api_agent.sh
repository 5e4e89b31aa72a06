#!/usr/bin/env bash
# An agent that is not Python, over agent-outbox's HTTP API: curl and jq only.
#
# It starts a run, records one atomic step with three effect intents (an HTTP
# call each, to a sink that honours Idempotency-Key), sends the step again the
# way a retry after a lost answer would (the recorded step comes back, nothing
# new is written), shows a key conflict refused with 409, awaits each effect's
# outcome with a long poll, and completes the run.
#
# On the embedded default (./.outbox), in four terminals or in the background:
#
#   export OUTBOX_API_TOKEN=$(head -c 24 /dev/urandom | base64)
#   outbox serve                                   # the API on http://127.0.0.1:8080/api/v1
#   outbox sink --port 8081                        # a sample sink: GET /stats
#   printf '[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n' > deliverers.toml
#   outbox deliver --config deliverers.toml        # performs the effects
#   bash examples/http_api_agent.sh
#
# OUTBOX_API_URL (default http://127.0.0.1:8080) and SINK_URL (default
# http://127.0.0.1:8081) point elsewhere. See docs/http-api.md.
set -euo pipefail

API="${OUTBOX_API_URL:-http://127.0.0.1:8080}/api/v1"
SINK="${SINK_URL:-http://127.0.0.1:8081}"
: "${OUTBOX_API_TOKEN:?set OUTBOX_API_TOKEN to the token outbox serve was started with}"

# call METHOD PATH [JSON]: the answer's body; exits on anything but a 2xx.
call() {
    curl --silent --show-error --fail-with-body -X "$1" "$API$2" \
        -H "Authorization: Bearer $OUTBOX_API_TOKEN" \
        -H "Content-Type: application/json" \
        ${3:+--data-binary "$3"}
}

# 1. Start a run under an id of our own, so that a retried start answers the same run.
RUN_ID=$(cat /proc/sys/kernel/random/uuid)
call POST /runs "$(jq -n --arg id "$RUN_ID" \
    '{run_id: $id, agent: "invoice-mailer", version: "1", inputs: {month: "2026-10"}}')" |
    jq -c '{started: .run.id, status: .run.status}'

# 2. One atomic step: its result, the run's state and plan, and three intents
#    commit together or not at all. Each intent's key is derived from
#    (run, step, index), so every attempt at the sink carries the same one.
STEP=$(jq -n --arg sink "$SINK" '{
    step_id: "send-invoices",
    result: {invoices: 3},
    state: {cursor: 3},
    plan: ["send-invoices", "close-month"],
    intents: [range(3) | {
        kind: "http.request",
        payload: {url: "\($sink)/invoices", json: {operation: "invoice-\(.)"}}
    }]
}')
call POST "/runs/$RUN_ID/steps" "$STEP" |
    jq -c '{recorded: .step.step_id, replayed, effects: [.effects[].idempotency_key[0:12]]}'

# 3. The same step again: the recorded result and effects, nothing written.
call POST "/runs/$RUN_ID/steps" "$STEP" |
    jq -c '{recorded: .step.step_id, replayed, result: .step.result, effects: (.effects | length)}'

# 4. A key names one intent: reusing one for another payload is a 409 naming it.
call POST "/runs/$RUN_ID/steps" \
    '{"step_id": "charge", "intents": [{"kind": "http.request", "key": "charge-2026-10",
      "payload": {"url": "'"$SINK"'/charges", "json": {"operation": "charge", "cents": 500}}}]}' |
    jq -c '{recorded: .step.step_id, key: .effects[0].idempotency_key}'
curl --silent -X POST "$API/runs/$RUN_ID/steps" \
    -H "Authorization: Bearer $OUTBOX_API_TOKEN" -H "Content-Type: application/json" \
    --data-binary '{"step_id": "charge-again", "intents": [{"kind": "http.request",
      "key": "charge-2026-10", "payload": {"url": "'"$SINK"'/charges",
      "json": {"operation": "charge", "cents": 900}}}]}' \
    --write-out '\n' | jq -c '{refused: .code, field, key}'

# 5. Await each effect's outcome: a long poll that answers when the deliverer
#    has performed it (or after 20 s with done=false: ask again).
for id in $(call GET "/effects?run_id=$RUN_ID" | jq -r '.effects[].id'); do
    call GET "/effects/$id/outcome?wait=20" |
        jq -c '{effect: .effect.idempotency_key[0:12], done, status, http: .result.status}'
done

# 6. The end of the run.
call POST "/runs/$RUN_ID/complete" '{"result": {"sent": 4}}' |
    jq -c '{run: .run.id, status: .run.status}'
