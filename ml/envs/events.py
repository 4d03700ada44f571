"""`events`: drive a small state machine to a target state by publishing events through a tool.

An order goes created -> paid -> packed -> shipped -> delivered, and may be cancelled before it
ships; a ticket goes open -> assigned -> resolved -> closed, and may be reopened once resolved.
The model reads the state (`state`), publishes events (`publish`); an event the current state does
not allow is rejected by the environment with the reason, and changes nothing. The episode is
scored on the final state alone: it is right when the entity ends in the target state.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator

from crucible.ml import envs
from crucible.ml.envs.base import Call, Environment, InstanceError, Observation, Tool, split_of

MACHINES = {
    "order": {"start": "created", "events": {
        "pay": {"created": "paid"}, "pack": {"paid": "packed"}, "ship": {"packed": "shipped"},
        "deliver": {"shipped": "delivered"}, "cancel": {"created": "cancelled", "paid": "cancelled",
                                                         "packed": "cancelled"}}},
    "ticket": {"start": "open", "events": {
        "assign": {"open": "assigned"}, "resolve": {"assigned": "resolved"}, "close": {"resolved": "closed"},
        "reopen": {"resolved": "open"}}},
}


def states(machine: str) -> list[str]:
    m = MACHINES[machine]
    found = {m["start"]} | {s for moves in m["events"].values() for pair in moves.items() for s in pair}
    return sorted(found)


def path(machine: str, start: str, target: str) -> list[str] | None:
    """The shortest list of events from start to target (None when unreachable)."""
    events = MACHINES[machine]["events"]
    seen, queue = {start: []}, deque([start])
    while queue:
        at = queue.popleft()
        if at == target:
            return seen[at]
        for event, moves in sorted(events.items()):
            nxt = moves.get(at)
            if nxt and nxt not in seen:
                seen[nxt] = seen[at] + [event]
                queue.append(nxt)
    return None


class Events(Environment):
    name = "events"
    description = "Publish events to bring an entity to a target state."
    tools = (Tool("state", "The entity's current state and the events it accepts now.", {}),
             Tool("publish", "Publishes one event for the entity.", {"event": "the event's name"}))
    max_turns = 8

    def check_instance(self, data: dict) -> None:
        machine = data.get("machine")
        if machine not in MACHINES:
            raise InstanceError(f"events needs 'machine': one of {', '.join(sorted(MACHINES))}")
        for field in ("start", "target"):
            if data.get(field) not in states(machine):
                raise InstanceError(f"events needs {field!r}: a state of {machine!r} ({', '.join(states(machine))})")
        if path(machine, data["start"], data["target"]) is None:
            raise InstanceError(f"events: no events take a {machine} from {data['start']} to {data['target']}")

    def current(self, data: dict, earlier: list[Call]) -> str:
        """The state after the events accepted so far (rejected ones changed nothing)."""
        state = data["start"]
        for call in earlier:
            if call.name == "publish":
                state = MACHINES[data["machine"]]["events"].get(call.arguments["event"].strip(), {}).get(state, state)
        return state

    def observe(self, task, earlier, call, result=None) -> Observation:
        data = self.instance(task)
        state = self.current(data, earlier)
        events = MACHINES[data["machine"]]["events"]
        allowed = sorted(e for e, moves in events.items() if state in moves)
        if call.name == "state":
            return Observation(f"{data['machine']} is {state}; accepts: {', '.join(allowed) or 'nothing'}")
        event = call.arguments["event"].strip()
        if event not in events:
            return Observation(f"rejected: unknown event {event[:40]!r}; events are {', '.join(sorted(events))}",
                               failed=True)
        if state not in events[event]:
            return Observation(f"rejected: {event} is not allowed when the {data['machine']} is {state}",
                               failed=True)
        return Observation(f"accepted: {data['machine']} is {events[event][state]}")

    def check_answer(self, task, answer: str, calls: list[Call]) -> dict[str, float]:
        data = self.instance(task)
        return {"answer_correct": float(self.current(data, calls) == data["target"])}

    def generate(self, split: str, *, seed: int, group_size: int = 8) -> Iterator:
        rng = random.Random(seed)
        while True:
            machine = rng.choice(sorted(MACHINES))
            start, target = rng.choice(states(machine)), rng.choice(states(machine))
            if start == target or path(machine, start, target) is None:
                continue
            identity = f"{machine}:{start}:{target}"  # held out: whole start/target pairs, never trained on
            if split_of(identity) != split:
                continue
            entity = f"{machine} {rng.randrange(1, 1000)}"
            prompt = f"The {entity} is {start}. Bring it to {target} by publishing events, then say done."
            yield self.task(prompt, {"machine": machine, "start": start, "target": target, "entity": entity},
                            split=split, key=f"{identity}:{entity}:{rng.randrange(1 << 30)}", group_size=group_size)

    def reference(self, task) -> list[str]:
        data = self.instance(task)
        return ["@state"] + [f"@publish {e}" for e in path(data["machine"], data["start"], data["target"])] + ["done"]


envs.register(Events())
