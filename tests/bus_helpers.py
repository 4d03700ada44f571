"""What several tests do with the bus: read a topic from its start to its end."""
from __future__ import annotations

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
