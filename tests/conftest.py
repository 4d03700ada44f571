"""Test session wiring: a real Kafka broker and a real chDB store, started once per session.

Set CRUCIBLE_TEST_KAFKA_BOOTSTRAP or CRUCIBLE_TEST_CLICKHOUSE_URL to run the
same tests against brokers and servers you already have.
"""
from __future__ import annotations

import os
import uuid

import pytest

from crucible.local.kafka import LocalKafka
from crucible.shared.procs import free_port
from crucible.shared.settings import Settings

pytest_plugins = ["tests.fixtures_store", "tests.checkout_guard"]


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    external = os.environ.get("CRUCIBLE_TEST_KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"), port=free_port(), controller_port=free_port(),
                        heap="512m", settings=Settings())
    broker.start(echo=lambda *_: None)
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


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
