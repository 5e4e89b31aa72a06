"""The hold of a paused or stopping run's effects on a cluster.

A retry that puts an effect back to ``pending`` is held by the trigger on the
shard it lives on (``outbox_effects_hold_paused``), which reads the run on that
node: the same tests as on one server (tests/integration/test_pause.py,
tests/integration/test_cancel_in_doubt.py). No other Citus test had an answer
or a reconciler put an effect of a stopped run back.
"""

from __future__ import annotations

from tests.integration.test_cancel_in_doubt import (  # noqa: F401 (the tests)
    test_a_late_retry_answer_of_a_lost_attempt_does_not_make_it_due,
)
from tests.integration.test_pause import (  # noqa: F401 (the tests)
    test_an_attempt_in_flight_finishes_and_a_retry_it_asks_for_is_held,
)
