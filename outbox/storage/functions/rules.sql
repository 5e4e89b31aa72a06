-- Every limit and list the SQL API enforces, in one place: outbox.intent_rules
-- (the Python client's rules, with their codes and reasons), the Settings
-- defaults, and the limits that keep a value readable by every client (JSON
-- depth and integer digits). tests/integration/test_sql_api_rules.py holds it
-- equal to the Python constants. A session or database may override the
-- settings (outbox_setting: SET outbox.max_payload_bytes = ...). An E'' literal,
-- its backslashes doubled: a function's body is read in its caller's session,
-- and one with standard_conforming_strings off would take the JSON's for escapes.
CREATE OR REPLACE FUNCTION outbox_intent_rules() RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT E'{
  "kind_pattern": "^[A-Za-z0-9_.:-]+$",
  "max_kind_length": 200,
  "max_key_length": 500,
  "max_attempts": 1000,
  "max_schema_version": 2147483647,
  "max_delay_seconds": 315360000,
  "max_amount": 1000000000000000,
  "max_agent_length": 200,
  "max_version_length": 100,
  "max_name_length": 200,
  "max_payload_bytes": 67108864,
  "blob_threshold_bytes": 16384,
  "max_priority": 1000,
  "max_fairness_key_length": 200,
  "max_step_intents": 10000,
  "max_step_bytes": 67108864,
  "max_step_id_length": 200,
  "notify_window_ms": 3.0,
  "max_json_depth": 100,
  "max_integer_digits": 4300,
  "live_run_statuses": ["runnable", "running", "waiting", "paused"],
  "active_run_statuses": ["runnable", "running", "waiting"],
  "control_characters": "[\\\\x01-\\\\x1f\\\\x7f-\\\\x9f\\\\u2028\\\\u2029]",
  "headers_field": "headers",
  "url_field": "url",
  "header_name_pattern": "^[!#$%&''*+.^_`|~0-9A-Za-z-]+$",
  "header_value_forbidden": "[\\\\x01-\\\\x08\\\\x0a-\\\\x1f\\\\x7f-\\\\x9f\\\\u2028\\\\u2029]",
  "header_name_rules": [
    {
      "code": "framing-header",
      "names": ["connection", "content-length", "expect", "host", "http2-settings", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"],
      "prefixes": ["proxy-"],
      "pattern": null
    },
    {
      "code": "reserved-header",
      "names": ["idempotency-key"],
      "prefixes": ["x-outbox-"],
      "pattern": null
    },
    {
      "code": "credential-header",
      "names": ["authorization", "cookie", "set-cookie", "www-authenticate"],
      "prefixes": [],
      "pattern": "token|secret|passw(or)?d|passphrase|credential|session|cookie|api-?key|access-?key|private-?key|secret-?key|authori[sz]ation|authentication|(^|-)auth(-|$)|(^|-)(subscription|functions?|app|application|master|license|insert|signing|auth|encryption(-customer)?)-?key(-|$)"
    }
  ],
  "query_name_rules": [
    {
      "code": "credential-query-parameter",
      "names": ["authorization", "cookie", "jwt", "key", "pass", "pwd", "set-cookie", "sig", "signature", "www-authenticate", "x-amz-credential", "x-amz-signature", "x-goog-credential", "x-goog-signature"],
      "prefixes": [],
      "pattern": "token|secret|passw(or)?d|passphrase|credential|session|cookie|api-?key|access-?key|private-?key|secret-?key|authori[sz]ation|authentication|(^|-)auth(-|$)|(^|-)(subscription|functions?|app|application|master|license|insert|signing|auth|encryption(-customer)?)-?key(-|$)"
    }
  ],
  "credential_value_pattern": "^\\\\s*(bearer|basic|token|(api-?)?key|ssws|oauth)\\\\s+[A-Za-z0-9._~+/-]{16,}=*\\\\s*$",
  "reasons": {
    "control-character": "holds a control character (CR, LF, NUL, ...), which is refused",
    "surrogate": "holds a lone surrogate, which is not valid Unicode text",
    "headers-type": "must be an object of header names to text values",
    "header-name-syntax": "is not a valid header name (an HTTP token: letters, digits and !#$%&''*+.^_`|~-)",
    "header-value-type": "must be text",
    "header-value-control": "holds a control character (CR, LF, NUL, ...) other than a tab",
    "credential-value": "is an authorization scheme and its secret; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)",
    "url-type": "must be text",
    "url-control": "holds a control character (CR, LF, NUL, ...)",
    "url-userinfo": "holds a user name or password before the host; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)",
    "framing-header": "is a hop-by-hop or framing header: the HTTP client sets it",
    "reserved-header": "is set by the deliverer (the idempotency key travels as the intent''s key)",
    "credential-header": "carries a credential; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)",
    "credential-query-parameter": "carries a credential; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)"
  }
}'::jsonb
$$;

-- A setting: outbox.<name> if the session or database sets it, else the rule.
CREATE OR REPLACE FUNCTION outbox_setting(name text) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT coalesce(nullif(current_setting('outbox.' || name, true), ''), outbox_intent_rules()->>name)
$$;

-- Kinds a caller cannot name (outbox.intent_rules.RESERVED_KIND_PREFIXES).
CREATE OR REPLACE FUNCTION outbox_reserved_kind_prefixes() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT ARRAY['dry-run:']
$$;

-- Statuses in which a run takes steps and intents (models.ACTIVE_RUN_STATUSES):
-- the live ones but paused (a paused run still takes signals).
-- (A constant, not read from outbox_intent_rules(): it is inlined into every step.)
CREATE OR REPLACE FUNCTION outbox_active_run_statuses() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT '{runnable,running,waiting}'::text[]
$$;

-- Statuses in which a run accepts steps, signals and intents (models.LIVE_RUN_STATUSES).
CREATE OR REPLACE FUNCTION outbox_live_run_statuses() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT '{runnable,running,waiting,paused}'::text[]
$$;

-- What the database itself sets for outbox.<name> (ALTER DATABASE ... SET), if
-- anything: unlike current_setting, nothing a session does changes it.
CREATE OR REPLACE FUNCTION outbox_database_setting(name text) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT nullif(substr(c, length(name) + 9), '')
  FROM pg_catalog.pg_db_role_setting AS s, unnest(s.setconfig) AS c
 WHERE s.setdatabase = (SELECT d.oid FROM pg_catalog.pg_database AS d
                         WHERE d.datname = current_database())
   AND s.setrole = 0 AND c LIKE 'outbox.' || name || '=%'
$$;

-- A numeric limit (max_payload_bytes, max_step_intents, ...): outbox_setting's
-- value. The caps (all but blob_threshold_bytes, which only chooses where a value
-- is stored) a session can only lower: above the database's own value, or the
-- rule when the database sets none, the ceiling holds. The ceiling is read only
-- when the session asks for more than the rule, so a client on the defaults (or
-- stricter) pays nothing for it; a database that lowers a cap below the rule
-- binds sessions that do not set their own (SQL API callers), as before.
--
-- One expression, no FROM: the planner inlines it where it is called (a step asks
-- for seven limits; a call each costs about 12 us, the inlined form a fraction).
CREATE OR REPLACE FUNCTION outbox_limit(name text) RETURNS bigint
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT CASE WHEN name = 'blob_threshold_bytes'
              OR outbox_setting(name)::bigint <= (outbox_intent_rules()->>name)::bigint
            THEN outbox_setting(name)::bigint
            ELSE least(outbox_setting(name)::bigint,
                       coalesce(outbox_database_setting(name)::bigint,
                                (outbox_intent_rules()->>name)::bigint)) END
$$;
