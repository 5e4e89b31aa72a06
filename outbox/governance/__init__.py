"""Governance: what decides whether an intended effect may happen, and the record that proves it.

- :mod:`~outbox.governance.intent_rules`: the limits and lists every intent is checked against;
- :mod:`~outbox.governance.gates`: approval gates and the conditions that hold an effect;
- :mod:`~outbox.governance.chain` and :mod:`~outbox.governance.chain_signing`: the
  tamper-evident hash chains of a run and their signatures;
- :mod:`~outbox.governance.audit_record`: a run's self-contained record;
- :mod:`~outbox.governance.effect_diff`: what two runs intended, compared.

Pure data and checks, no I/O: the runs and storage layers apply them.
"""
