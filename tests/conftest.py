"""Test session wiring: a real Kafka broker and a real chDB store, started once per session.

Set CRUCIBLE_TEST_KAFKA_BOOTSTRAP or CRUCIBLE_TEST_CLICKHOUSE_URL to run the
same tests against brokers and servers you already have.
"""
from __future__ import annotations

import os
import uuid

import pytest

from crucible.local.kafka import LocalKafka
from crucible.shared.procs import free_ports
from crucible.shared.settings import Settings

pytest_plugins = ["tests.fixtures_store", "tests.checkout_guard"]

# Hypothesis keeps its example database and caches in a folder of its own: a temporary one, never
# the checkout (tests leave it as they found it), removed when the session's process ends.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

from hypothesis import configuration as _hypothesis_configuration  # noqa: E402

_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="crucible-hypothesis-")
_hypothesis_configuration.set_hypothesis_home_dir(_HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)


# Every sample's trace is kept in tests (the default keeps a share, by trace id): tests follow
# particular tasks through the services. tests/test_telemetry.py tests the sampling itself.
os.environ.setdefault("CRUCIBLE_OTEL_TRACE_RATIO", "1")

SASL_USER, SASL_PASSWORD = "crucible-test", "sasl-pw-8c1e"  # the session broker's SASL/PLAIN login


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory) -> LocalKafka | None:
    """The session's broker (with a SASL_PLAINTEXT listener beside its plain one); None when external."""
    if os.environ.get("CRUCIBLE_TEST_KAFKA_BOOTSTRAP"):
        yield None
        return
    port, controller_port, sasl_port = free_ports(3)
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"), port=port, controller_port=controller_port,
                        heap="512m", settings=Settings(), sasl_port=sasl_port,
                        sasl_users={SASL_USER: SASL_PASSWORD})
    broker.start(echo=lambda *_: None)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker) -> str:
    return os.environ.get("CRUCIBLE_TEST_KAFKA_BOOTSTRAP") or kafka_broker.bootstrap


@pytest.fixture
def settings(kafka_bootstrap, tmp_path) -> Settings:
    """Settings for one test: its own topic prefix and consumer groups, so tests never see each other's records."""
    tag = uuid.uuid4().hex[:8]
    return Settings(
        kafka_bootstrap=kafka_bootstrap,
        topic_prefix=f"t{tag}.",
        consumer_group_prefix=f"t{tag}-",
        home=tmp_path / "home",
    )


@pytest.fixture
def stack_settings(settings, store_url, store_database) -> Settings:
    """Per-test settings with both the real broker and a fresh database in the real store."""
    return settings.model_copy(update={"clickhouse_url": store_url, "clickhouse_database": store_database})
