"""What several tests do with the bus: read a topic from its start to its end; write a record as someone
without the deployment's key would."""
from __future__ import annotations

from aiokafka import AIOKafkaProducer

from crucible.shared import bus


async def read_all(settings, topic: str) -> list:
    """Every message on `topic` now, from its first record (an observer: nothing is dead-lettered)."""
    reader = bus.Reader([topic], None, settings=settings, offsets={topic: {}}, dead_letters=False)
    out = []
    async with reader:
        while True:
            batch = await reader.fetch(timeout_ms=500)
            out += [i.message for i in batch]
            if not batch and await reader.at_end():
                return out


async def publish_unsigned(settings, topic: str, message, key: bytes) -> None:
    """Writes `message` as it is, headers and all, with a plain client: no Crucible producer signs it."""
    raw = AIOKafkaProducer(**bus.connection(settings))
    await raw.start()
    try:
        await raw.send_and_wait(settings.topic(topic), message.SerializeToString(), key=key,
                                headers=bus.publish_headers(message))
    finally:
        await raw.stop()
