"""Plain data across the wall between the test harness and the candidate's process.

The harness calls the candidate's functions through a pipe; arguments and
return values cross as *plain data* only: None, bool, int, float, complex,
str, bytes, bytearray and lists, tuples, sets, frozensets and dicts of those,
and the standard library's values made of them (Fraction, Decimal, date,
datetime, time, timedelta, range, deque: exactly those classes).
What the harness gets back is rebuilt from a JSON tree by `from_tree`, so it is
always an exact builtin value: no subclass, no custom `__eq__`, `__hash__` or
`__bool__`, no generator, nothing that can run the candidate's code inside the
harness. That, not any list of known tricks, is why a returned object cannot
claim to equal the expected value. The one thing a tree may name instead of holding is a container
of the call's own arguments (a reference to its place in them, `places`/`resolver`): the tests' own
object there, as a result that shares it would be in one process; and a container a tree holds twice
is written once and referred to again ("#"), so sharing inside a value crosses too.

`to_tree` runs on the candidate's side (in its process, so it is advisory):
subclasses of plain types are converted through the base type's own C slots,
which read the real stored value whatever the subclass overrides; values that
look like an attempt (a class of the candidate's own, a subclass overriding
comparison or hashing, a generator) are reported so the verdict can name them.

Stdlib only: this module is loaded into the sandbox worker, which has no site-packages.
"""
from __future__ import annotations

import base64
import collections
import itertools
import json
import json.encoder
import json.scanner
import builtins as builtins_module
import importlib
import math
import re
import sys

MAX_DEPTH = 64
MAX_NODES = 1_000_000
MAX_INT_BITS = 8192  # larger ints cross as hex text: decimal text past 4300 digits is refused by int()
_SURROGATE = re.compile("[\ud800-\udfff]")

# Dunders that decide how a value compares, hashes, tests true or converts: a type of the
# candidate's that overrides any of them in a returned value is trying to steer a check. (How it
# prints is not among them: the tests get the value rebuilt, never the candidate's object, and a
# namedtuple, an IntEnum or a list that prints itself are honest answers.)
STEERING_DUNDERS = frozenset({
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__len__",
    "__contains__", "__iter__", "__getitem__", "__index__", "__int__", "__float__", "__complex__",
    "__getattr__", "__getattribute__", "__class__",
    "__instancecheck__", "__subclasscheck__", "__abs__", "__round__", "__trunc__", "__floor__", "__ceil__",
    "__reduce__", "__reduce_ex__", "__del__",
})

# Builtin types no honest answer returns: the interpreter's own machinery.
_MACHINERY_TYPE_NAMES = frozenset({"frame", "code", "traceback", "module", "cell"})


def _generator():
    yield


# Iterators the tests receive as an iterator over the items drawn from them (in the candidate's process,
# where a generator's code runs): a generator, map, filter, zip, a container's or itertools' iterator.
ITERATOR_TYPES = frozenset({type(_generator()), map, filter, zip, enumerate, reversed,
                            *(type(iter(c)) for c in ([], (), "", "\u0100", b"", bytearray(), range(1), range(1 << 70),
                                                      {}, {}.values(), {}.items(), set(), frozenset()))}
                           | {t for t in vars(itertools).values() if isinstance(t, type)})
_VIEW_TAGS = {type({}.keys()): "K", type({}.values()): "V", type({}.items()): "E"}


class Raised(Exception):
    """Drawing the items of a returned iterator raised `exc` (in the tests it would have, as they drew)."""

    def __init__(self, exc: Exception):
        super().__init__(str(exc))
        self.exc = exc


class NotPlain(TypeError):
    """A value that cannot cross as plain data; `suspicious` says it looks like an attempt to forge a check."""

    def __init__(self, message: str, suspicious: bool = False):
        super().__init__(message)
        self.suspicious = suspicious


# --- candidate side: value -> tree -------------------------------------------------------------

# Bound once at import: the candidate may rebind names in builtins later, these stay the real ones.
_type, _len, _isinstance, _repr = type, len, isinstance, repr
_int_index, _float_value, _str_value, _bytes_value = int.__index__, float.__float__, str.__str__, bytes.__bytes__
_list_iter, _tuple_iter, _dict_items = list.__iter__, tuple.__iter__, dict.items
_set_iter, _frozenset_iter = set.__iter__, frozenset.__iter__
_complex_real, _complex_imag = complex.real.__get__, complex.imag.__get__
_bytearray_copy = bytearray.copy  # a bytearray's own bytes; any other object (an array.array, a buffer) refused

# Plain base type -> how to read a subclass instance's real value through the base's own slot.
_CONVERT = (
    (bool, None),  # bool cannot be subclassed
    (int, lambda v: _int_index(v)),
    (float, lambda v: _float_value(v)),
    (str, lambda v: _str_value(v)),
    (bytes, lambda v: _bytes_value(v)),
    (bytearray, lambda v: _bytearray_copy(v)),
    (complex, lambda v: complex(_complex_real(v), _complex_imag(v))),
    (list, lambda v: list(_list_iter(v))),
    (tuple, lambda v: tuple(_tuple_iter(v))),
    (dict, lambda v: dict(_dict_items(v))),
    (set, lambda v: set(_set_iter(v))),
    (frozenset, lambda v: frozenset(_frozenset_iter(v))),
)


def _is_stdlib_class(cls) -> bool:
    """collections.Counter, OrderedDict, defaultdict...: subclasses an honest answer may return."""
    module = getattr(cls, "__module__", "") or ""
    top = module.split(".")[0]
    names = getattr(sys, "stdlib_module_names", ())
    if top not in names:
        return False
    owner = sys.modules.get(module)
    return owner is not None and getattr(owner, getattr(cls, "__qualname__", ""), None) is cls


def _steering_overrides(cls, base) -> list[str]:
    found = []
    for klass in getattr(cls, "__mro__", ()):
        if klass is base or klass is object:
            break
        if _is_stdlib_class(klass):
            continue
        found += sorted(STEERING_DUNDERS & set(getattr(klass, "__dict__", {})))
    return found


def to_tree(value, flags: list | None = None, _depth: int = 0, _budget: list | None = None,
            places: dict | None = None, _done: dict | None = None):
    """The JSON tree for `value`; raises NotPlain. Converted subclasses that override steering
    dunders are appended to `flags` as (pattern, detail). `places`: containers the other side holds
    already (id -> where, as `places` finds them: a call's arguments), which cross as a reference to
    that place (["@", ...]) and are that very object there, as in one process. A container met again
    in the same tree crosses as a reference to where it was first written (["#", n]: the n-th
    container written, counted as each is finished), so what a value shares inside itself (a row held
    twice, an argument passed twice) is shared on the other side too."""
    if _done is None:
        _done = {}  # id -> (container, its number): the containers written so far (held: no id reused)
    budget = _budget if _budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise NotPlain(f"more than {MAX_NODES} values")
    if _depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    t = _type(value)
    if t is str:
        # JSON text writes a surrogate as an escape, and reads two escapes in a row as one character:
        # a string holding surrogates crosses as its code units, each kept as it is.
        if value.isascii() or _SURROGATE.search(value) is None:
            return value
        return ["u", base64.b64encode(value.encode("utf-8", "surrogatepass")).decode("ascii")]
    if t is type(None) or t is bool:
        return value
    if t is int:
        return value if value.bit_length() < MAX_INT_BITS else ["I", format(value, "x")]
    if t is float:
        return value if math.isfinite(value) else ["F", _repr(value)]
    if t in SHARED_TYPES:
        where = places.get(id(value)) if places is not None else None
        if where is not None and where[0] is value:
            return ["@", *where[1]]
        written = _done.get(id(value))
        if written is not None and written[0] is value:
            return ["#", written[1]]
    d = _depth + 1
    if t is list:
        return _written(value, ["l", *[to_tree(v, flags, d, budget, places, _done) for v in value]], _done)
    if t is tuple:
        return ["t", *[to_tree(v, flags, d, budget, places, _done) for v in value]]
    if t is dict:
        out = ["d"]
        for k, v in value.items():
            out.append(to_tree(k, flags, d, budget, places, _done))
            out.append(to_tree(v, flags, d, budget, places, _done))
        return _written(value, out, _done)
    if t is set:
        return _written(value, ["s", *[to_tree(v, flags, d, budget, places, _done) for v in value]], _done)
    if t is frozenset:
        return ["f", *[to_tree(v, flags, d, budget, places, _done) for v in value]]
    if t is bytes:
        return ["b", base64.b64encode(value).decode("ascii")]
    if t is bytearray:
        return _written(value, ["B", base64.b64encode(bytes(value)).decode("ascii")], _done)
    if t is complex:
        return ["c", to_tree(value.real, flags, d, budget, places, _done), to_tree(value.imag, flags, d, budget, places, _done)]
    if places is not None and (t is _LIST_ITERATOR or t in _VIEW_TAGS):
        live = _live_over_arguments(value, t, places)
        if live is not None:
            return live
    if t in ITERATOR_TYPES:
        return ["i", *[to_tree(v, flags, d, budget, places, _done) for v in _drawn(value, budget)]]
    stdlib_value = _stdlib_value(t)
    if stdlib_value is not None:
        return [stdlib_value[0], *[to_tree(v, flags, d, budget, places, _done) for v in stdlib_value[1](value)]]
    if t in _VIEW_TAGS:  # a dict's keys, values or items, rebuilt as a view of a dict of their own
        return [_VIEW_TAGS[t], *[to_tree(v, flags, d, budget, places, _done) for v in value]]
    for base, convert in _CONVERT:
        if convert is None:
            continue
        try:
            plain = convert(value)
        except TypeError:
            continue  # not really an instance of this base: the slot refused it
        overrides = _steering_overrides(t, base)
        if overrides and flags is not None:
            flags.append(("non_plain_return", f"a {_type_name(t)} (subclass of {base.__name__}) overriding "
                                              f"{', '.join(overrides[:6])}"))
        return to_tree(plain, flags, _depth, budget, places, _done)
    name = _type_name(t)
    own_class = getattr(t, "__module__", "") not in ("builtins",) and not _is_stdlib_class(t)
    machinery = getattr(t, "__name__", "") in _MACHINERY_TYPE_NAMES and getattr(t, "__module__", "") == "builtins"
    raise NotPlain(f"a {name}", suspicious=own_class or machinery)


_LIST_ITERATOR = type(iter([]))


def _live_over_arguments(value, t, places: dict) -> list | None:
    """A list's iterator or a dict's view over a container of the arguments, as a reference the other
    side makes live again over its own object (["@i", position, path...], ["@K"/"@V"/"@E", path...]):
    what it yields or shows follows later changes there, as in one process. None for any other."""
    if t is _LIST_ITERATOR:
        reduced = value.__reduce__()  # (iter, (the list,), position) while it has items left
        if len(reduced) == 3 and type(reduced[2]) is int:
            where = places.get(id(reduced[1][0]))
            if where is not None and where[0] is reduced[1][0]:
                return ["@i", reduced[2], *where[1]]
        return None
    tag = _VIEW_TAGS[t]
    probe = object()  # the arguments' dict whose view this is: the one where a key added shows in it
    for container, path in list(places.values()):
        if type(container) is not dict:
            continue
        container[probe] = probe
        try:
            shows = ((probe, probe) if tag == "E" else probe) in value
        finally:
            del container[probe]
        if shows:
            return ["@" + tag, *path]
    return None


def _written(container, tree: list, done: dict) -> list:
    """`tree`, once `container` (a list, dict, set or bytearray) is numbered as written (to_tree's "#")."""
    done[id(container)] = (container, len(done))
    return tree


# Containers whose identity a test can see (it changes one and looks at another): a value holding one of
# the containers of a call's arguments crosses as a reference to it (to_tree's `places`).
SHARED_TYPES = frozenset({list, dict, set, bytearray, collections.deque})
_HOLDERS = SHARED_TYPES | {tuple}  # what places looks into (a tuple holds places, and is none)


def roots(args: tuple, kwargs: dict) -> dict:
    """A call's arguments as places and resolver take them: {position or keyword: value}."""
    return {**dict(enumerate(args)), **kwargs}


def places(roots: dict) -> dict:
    """Every container of SHARED_TYPES reachable from `roots` ({first step: value}) through lists,
    tuples, deques and dict values: id -> (the container, its path: the first step, then an index or a
    dict key as plain data each), the first path found for each (breadth first, so the shortest). Each
    container is looked into once, and at most MAX_NODES items in all."""
    found: dict = {}
    looked: set = set()  # ids of what was looked into (all held by `roots` meanwhile)
    budget = MAX_NODES
    todo = collections.deque((value, [step]) for step, value in roots.items())
    while todo and budget > 0:
        value, path = todo.popleft()
        if id(value) in looked:
            continue
        looked.add(id(value))
        t = _type(value)
        if t in SHARED_TYPES:
            found[id(value)] = (value, path)
        if len(path) > MAX_DEPTH or t not in _HOLDERS or t is set or t is bytearray:
            continue  # (an argument that holds nothing, or nothing with a place)
        budget -= len(value)
        if t is dict:
            for k, v in value.items():
                key = _key_that_finds(value, k, v) if _type(v) in _HOLDERS else None
                if key is not None:
                    todo.append((v, path + [key]))
        else:
            todo.extend((v, path + [i]) for i, v in enumerate(value) if _type(v) in _HOLDERS)
    return found


def _key_that_finds(mapping: dict, key, value):
    """`key` as plain data, where crossed and rebuilt it finds `value` in `mapping` (a NaN in it does
    not); None otherwise."""
    try:
        tree = to_tree(key)
        again = from_tree(loads(dumps(tree)))
        if dict.__contains__(mapping, again) and dict.__getitem__(mapping, again) is value:
            return tree
    except Exception:  # a key that is no plain data, or whose comparison raises
        pass
    return None


def resolver(roots: dict):
    """What a reference node names (from_tree's `resolve`): the object at its path from `roots` (the
    tests' own arguments), a container of SHARED_TYPES (or a subclass: a test's defaultdict); ValueError
    where the path leads nowhere. Each step is taken by the base type's own lookup, so no method of a
    subclass runs (a defaultdict's __missing__ would add the key)."""
    def resolve(path: list):
        if not path or len(path) > MAX_DEPTH + 1 or type(path[0]) not in (int, str) or path[0] not in roots:
            raise ValueError("a reference to no argument")
        value = roots[path[0]]
        for step in path[1:]:
            key = from_tree(step)
            try:
                base = next((b for b in _STEPPED if isinstance(value, b)), None)
                if base is None or (base is not dict and type(key) is not int):
                    raise ValueError("a reference through a value that holds no place")
                if base is dict and not dict.__contains__(value, key):
                    raise KeyError(key)
                value = base.__getitem__(value, key)
            except (IndexError, KeyError, TypeError):
                raise ValueError("a reference to a place that is not there") from None
        if not isinstance(value, tuple(SHARED_TYPES)):
            raise ValueError("a reference to a value that is not a container")
        return value
    return resolve


_STEPPED = (dict, list, tuple, collections.deque)  # what a path steps into: by key, else by position


# The standard library's value types that cross, by tag: (module, class name, its value's parts as plain
# data, the value made again from them). Exactly these classes (a subclass does not cross: its methods
# are its author's); the harness makes each anew from plain parts, as it makes a list.
_STDLIB_VALUES = {
    "Q": ("fractions", "Fraction", lambda v: (v.numerator, v.denominator), lambda m, n, d: m.Fraction(n, d)),
    "D": ("decimal", "Decimal", lambda v: (str(v),), lambda m, text: m.Decimal(text)),
    "Y": ("datetime", "date", lambda v: (v.isoformat(),), lambda m, text: m.date.fromisoformat(text)),
    "W": ("datetime", "datetime", lambda v: (_zoned(v).isoformat(), v.fold, v.tzname()),
          lambda m, text, fold, zone: _in_zone(m, m.datetime.fromisoformat(text), fold, zone)),
    "H": ("datetime", "time", lambda v: (_zoned(v).isoformat(), v.fold, v.tzname()),
          lambda m, text, fold, zone: _in_zone(m, m.time.fromisoformat(text), fold, zone)),
    "S": ("datetime", "timedelta", lambda v: (v.days, v.seconds, v.microseconds),
          lambda m, days, seconds, micro: m.timedelta(days, seconds, micro)),
    "R": ("builtins", "range", lambda v: (v.start, v.stop, v.step),
          lambda m, start, stop, step: range(start, stop, step)),
    "q": ("collections", "deque", lambda v: (v.maxlen, *v), lambda m, maxlen, *items: m.deque(items, maxlen)),
}
_VARARGS = 0x04  # a code object's flag: the function takes *args


def _takes(make, count: int) -> bool:
    """Whether a make function of _STDLIB_VALUES takes `count` parts (after the module): as many as it
    names, or at least that many where it takes *parts (a deque's items)."""
    code = make.__code__
    named = code.co_argcount - 1
    return count == named or (bool(code.co_flags & _VARARGS) and count >= named)


def _stdlib_value(t) -> tuple | None:
    """(tag, parts of a value) where `t` is one of _STDLIB_VALUES' classes, as its module (already loaded,
    or no value of it could exist here) defines it; None otherwise."""
    for tag, (module_name, name, parts, _) in _STDLIB_VALUES.items():
        module = builtins_module if module_name == "builtins" else sys.modules.get(module_name)
        if module is not None and getattr(module, name, None) is t:
            return tag, parts
    return None


def _zoned(value):
    """A datetime or time whose zone is none or a fixed offset (which its text carries); NotPlain for
    any other zone (a class with methods of its own)."""
    zone = value.tzinfo
    if zone is not None and type(zone) is not sys.modules["datetime"].timezone:
        raise NotPlain(f"a {_type_name(type(value))} in a {_type_name(type(zone))} zone")
    return value


def _in_zone(datetime_module, value, fold: int, zone: str | None):
    """A datetime or time made from its text, with the fold and the zone's name its text does not carry."""
    value = value.replace(fold=fold)
    if value.tzinfo is not None and zone is not None:
        value = value.replace(tzinfo=datetime_module.timezone(value.utcoffset(), zone))
    return value


def _drawn(iterator, budget: list) -> list:
    """The items an iterator gives, at most the budget's; what drawing one raises is Raised."""
    items = []
    draw = iterator.__next__
    while True:
        if len(items) > budget[0]:
            raise NotPlain(f"more than {MAX_NODES} values")
        try:
            items.append(draw())
        except StopIteration:
            return items
        except Exception as exc:
            raise Raised(exc) from None


def _type_name(t) -> str:
    try:
        return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__
    except Exception:  # a metaclass may make even this misbehave
        return "object"


# --- harness side: tree -> value ---------------------------------------------------------------

def from_tree(tree, _depth: int = 0, _budget: list | None = None, resolve=None, _done: list | None = None):
    """Rebuilds exact builtin values from a JSON tree; ValueError for anything else. `resolve`: what a
    reference node (["@", ...], to_tree's `places`) stands for, where this side holds such places.
    A "#" node is a container rebuilt earlier in the same tree (to_tree's numbering, kept in `_done`)."""
    if _done is None:
        _done = []
    budget = _budget if _budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"more than {MAX_NODES} values")
    if _depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    t = type(tree)
    if tree is None or t is bool or t is int or t is float or t is str:
        return tree
    if t is not list or not tree or type(tree[0]) is not str:
        raise ValueError(f"malformed value node of type {t.__name__}")
    tag, items = tree[0], tree[1:]
    d = _depth + 1
    if tag == "@":
        if resolve is None:
            raise ValueError("a reference to a place where none can be")
        return resolve(items)
    if tag in ("@i", "@K", "@V", "@E"):  # live over a container of the arguments (_live_over_arguments)
        if resolve is None:
            raise ValueError("a reference to a place where none can be")
        if tag == "@i":
            if not items or type(items[0]) is not int or items[0] < 0:
                raise ValueError("an iterator node without a position")
            seq = resolve(items[1:])
            if not isinstance(seq, list):
                raise ValueError("an iterator node over what is not a list")
            iterator = list.__iter__(seq)
            iterator.__setstate__(items[0])
            return iterator
        mapping = resolve(items)
        if not isinstance(mapping, dict):
            raise ValueError("a view node over what is not a dict")
        return {"@K": dict.keys, "@V": dict.values, "@E": dict.items}[tag](mapping)
    if tag == "#":
        if len(items) != 1 or type(items[0]) is not int or not 0 <= items[0] < len(_done):
            raise ValueError("a reference to no container written before it")
        return _done[items[0]]
    if tag == "l":
        return _rebuilt([from_tree(v, d, budget, resolve, _done) for v in items], _done)
    if tag == "t":
        return tuple(from_tree(v, d, budget, resolve, _done) for v in items)
    if tag == "i":
        return iter([from_tree(v, d, budget, resolve, _done) for v in items])
    if tag == "V":
        return dict(enumerate(from_tree(v, d, budget, resolve, _done) for v in items)).values()
    if tag in ("K", "E"):
        values = [from_tree(v, d, budget, resolve, _done) for v in items]
        try:
            if tag == "K":
                return dict.fromkeys(values).keys()
            if not all(type(v) is tuple and len(v) == 2 for v in values):
                raise ValueError("an items node holding other than pairs")
            return dict(values).items()
        except TypeError as exc:
            raise ValueError(f"unhashable key: {exc}") from None
    if tag in ("s", "f", "d"):
        values = [from_tree(v, d, budget, resolve, _done) for v in items]
        try:
            if tag == "d":
                if len(values) % 2:
                    raise ValueError("dict node with an odd number of items")
                return _rebuilt(dict(zip(values[0::2], values[1::2])), _done)
            return _rebuilt(set(values), _done) if tag == "s" else frozenset(values)
        except TypeError as exc:
            raise ValueError(f"unhashable key: {exc}") from None
    if len(items) == 1 and type(items[0]) is str:
        text = items[0]
        if tag == "I":
            return int(text, 16)
        if tag == "F" and text in ("nan", "inf", "-inf"):
            return float(text)
        if tag in ("b", "B"):
            raw = base64.b64decode(text.encode("ascii"), validate=True)
            return raw if tag == "b" else _rebuilt(bytearray(raw), _done)
        if tag == "u":
            try:
                return base64.b64decode(text.encode("ascii"), validate=True).decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise ValueError("a string node that is not UTF-8") from None
    if tag in _STDLIB_VALUES and _takes(_STDLIB_VALUES[tag][3], len(items)):
        module_name, _, _, make = _STDLIB_VALUES[tag]
        parts = [from_tree(v, d, budget, resolve, _done) for v in items]
        try:  # each class checks its parts itself (a range of strings is a TypeError)
            return make(importlib.import_module(module_name), *parts)
        except (ValueError, TypeError, ArithmeticError) as exc:  # decimal's InvalidOperation, a zero denominator
            raise ValueError(f"a value node tagged {tag!r} that makes no value: {type(exc).__name__}") from None
    if tag == "c" and len(items) == 2:
        re, im = (from_tree(v, d, budget, resolve, _done) for v in items)
        if type(re) is float and type(im) is float:
            return complex(re, im)
    raise ValueError(f"malformed value node tagged {tag!r}")


def _rebuilt(container, done: list):
    """`container`, numbered as rebuilt (from_tree's "#": the order to_tree numbered them in)."""
    done.append(container)
    return container


# Every call crosses the wall twice, each way as one message: json's C encoder and scanner are made once
# and called directly, without json.dumps' and json.loads' Python layers around them (which rebuild the
# encoder per message and sniff the encoding), about 3 us of a call's 30 on each side.
# No check for cycles: every message is a tree to_tree built (or plain fields around one), so it has none.
def _not_json(value):
    raise TypeError(f"a {type(value).__name__} is not JSON")


_C_ENCODER = json.encoder.c_make_encoder
_ENCODE = (_C_ENCODER(None, _not_json, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False)
           if _C_ENCODER is not None else None)
_SCAN = json.scanner.make_scanner(json.JSONDecoder())


def dumps(obj) -> bytes:
    """ASCII JSON, compact, refusing NaN and infinities (ValueError) and anything not JSON (TypeError)."""
    if _ENCODE is None:  # an interpreter built without json's C accelerator
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return "".join(_ENCODE(obj, 0)).encode()


def loads(data: bytes):
    """JSON from the other side of the wall, one UTF-8 value and nothing after it (what dumps writes);
    ValueError for anything else, however deep."""
    try:
        text = data.decode("utf-8")
        value, end = _SCAN(text, 0)
    except StopIteration:
        raise ValueError("not JSON: no value at the start") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:  # bad JSON, bad UTF-8, an int literal past the digit limit
        raise ValueError(f"not JSON: {exc}") from None
    if end != len(text):
        raise ValueError(f"not JSON: data after the value, at character {end}")
    return value
