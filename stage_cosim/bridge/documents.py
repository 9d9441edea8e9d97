"""JSON and YAML a client sends, parsed within limits: size, expansion, depth, JSON's own types.

A request carries documents as text (``model_config``, ``cluster_description``,
``settings_json``). Parsed without limits, a few hundred bytes of YAML aliases ("billion
laughs") expand to a request of many megabytes — or a long text aliased a few thousand times
does, with few values — and deep nesting ends in a RecursionError. Here every document is
refused, as a UserError naming its field, when

* its text is longer than ``max_bytes``;
* it holds more than ``max_values`` values, or more than ``max_request_bytes`` of text, once
  aliases are expanded (both counted from the parser's events, which share an anchored node
  instead of copying it: nothing is expanded to count);
* it nests deeper than ``max_depth``;
* it holds what JSON cannot: an integer over ``MAX_INT_DIGITS`` digits (Python refuses to print
  one), a date, binary data, a set, a key that is not text;

and the resolved request as a whole is refused when its canonical JSON exceeds
``max_request_bytes`` (:func:`check_request_size`, which counts without writing it and stops at
the limit), naming its largest field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from stage_cosim.errors import UserError

MAX_INT_DIGITS = 4300            # Python's own limit for int <-> text (sys.int_info.default_max_str_digits)
MAX_INT_BITS = int(MAX_INT_DIGITS * 3.3219280948873626)     # log2(10): the same limit in bits


@dataclass(frozen=True)
class DocumentLimits:
    max_bytes: int = 256 << 10            # one document's text
    max_values: int = 50_000              # scalars and collections, aliases expanded
    max_depth: int = 32                   # nesting of mappings and lists
    max_text_chars: int = 1024            # a request's other text fields (names, choices)
    max_request_bytes: int = 256 << 10    # the resolved request, as canonical JSON (and a
    #                                       document's text with its aliases expanded)


def _too_big(field: str, what: str, limit: int, unit: str) -> UserError:
    return UserError(field, f"{what} more than {limit:,} {unit} (this server's limit)")


def check_text(text: str, field: str, limits: DocumentLimits, document: bool = True) -> None:
    limit = limits.max_bytes if document else limits.max_text_chars
    if len(text) > limit:                  # characters ≤ bytes: a cheap first look
        raise _too_big(field, f"is {len(text):,} characters long:", limit, "bytes" if document else "characters")
    if document and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise _too_big(field, "is", limit, "bytes")


def measure(value: Any, field: str, limits: DocumentLimits) -> None:
    """Refuse a parsed value with too many values, too deep a nesting, or anything JSON cannot
    hold (iterative: no recursion; shared nodes are visited once per reference, which the
    value limit bounds)."""
    count = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > limits.max_values:
            raise _too_big(field, "holds", limits.max_values, "values")
        if isinstance(item, (dict, list, tuple)):
            if depth > limits.max_depth:
                raise _too_big(field, "nests", limits.max_depth, "levels")
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):      # JSON keys are text; mixed keys cannot be sorted
                        raise UserError(field, f"has the key {_show(key)}, which is not text (quote it)")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, int) and not isinstance(item, bool):
            if item.bit_length() > MAX_INT_BITS:
                raise UserError(field, f"holds an integer of more than {MAX_INT_DIGITS:,} digits")
        elif not isinstance(item, (str, float, bool)) and item is not None:
            raise UserError(field, f"holds a {type(item).__name__} value, which JSON cannot hold (quote it)")


def _show(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."


def _unreadable(field: str, exc: ValueError) -> UserError:
    """A value the parser could not build: an integer over Python's digit limit, a bad date."""
    text = str(exc)
    if "integer string conversion" in text:
        return UserError(field, f"holds an integer of more than {MAX_INT_DIGITS:,} digits")
    first = text.strip().splitlines()[0][:200] if text.strip() else exc.__class__.__name__
    return UserError(field, f"holds a value that cannot be read ({first})")


def load_json(text: str, field: str, limits: DocumentLimits) -> Any:
    check_text(text, field, limits)
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_big(field, "nests", limits.max_depth, "levels") from None
    except json.JSONDecodeError as exc:
        raise UserError(field, f"is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except ValueError as exc:              # e.g. more digits than Python turns into an int
        raise _unreadable(field, exc) from None
    measure(value, field, limits)
    return value


def load_yaml(text: str, field: str, limits: DocumentLimits) -> Any:
    """One YAML (or JSON) document, with the safe loader, after its events passed the limits."""
    import yaml

    check_text(text, field, limits)
    loader = yaml12_loader()
    try:
        _check_events(yaml.parse(text, Loader=loader), field, limits)
        value = yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        raise UserError(field, f"is not valid JSON or YAML ({exc.__class__.__name__})") from None
    except RecursionError:
        raise _too_big(field, "nests", limits.max_depth, "levels") from None
    except (ValueError, OverflowError) as exc:   # an int over Python's digit limit, a bad date
        raise _unreadable(field, ValueError(str(exc))) from None
    measure(value, field, limits)          # bounded: the events passed the value limit
    return value


INT_TAG, FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# YAML 1.2 core schema: decimal, 0o octal, 0x hexadecimal integers; decimal floats with an
# optional exponent, .inf and .nan. No sexagesimal (``1:1:1``), no underscores, no 1.1 octal.
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", re.ASCII)
_FLOAT_12 = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", re.ASCII)


def _int_12(loader: Any, node: Any) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)                # leading zeros are decimal in 1.2 (1.1 read them as octal)


@lru_cache(maxsize=1)
def yaml12_loader() -> type:
    """The safe loader (C parser when present) with YAML 1.2 core-schema numbers.

    YAML 1.1's resolver reads ``1:1:1:…`` as a base-60 integer, whose construction costs time
    quadratic in its length (seconds for a 256 KB document) before any limit can look at the
    value; with the 1.2 grammar such a scalar is a plain string, refused later for its type."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    loader = type("Yaml12SafeLoader", (base,), {})
    loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (INT_TAG, FLOAT_TAG)]
        for first, resolvers in base.yaml_implicit_resolvers.items()}
    loader.add_implicit_resolver(INT_TAG, _INT_12, list("-+0123456789"))
    loader.add_implicit_resolver(FLOAT_TAG, _FLOAT_12, list("-+0123456789."))
    loader.add_constructor(INT_TAG, _int_12)
    return loader


def _check_events(events: Any, field: str, limits: DocumentLimits) -> None:
    """Count values, text and depth as if every alias were expanded, from the event stream.

    Text is each scalar's characters plus one (a separator); JSON of the same document is
    longer (quotes, colons), so a document refused here would be refused as a request too.
    """
    import yaml

    anchors: dict[str, tuple[int, int, int]] = {}    # anchor -> (values, depth, text) of its node
    # open collections: [anchor, values so far, depth below, text so far]
    stack: list[list[Any]] = [[None, 0, 0, 0]]
    values_total = text_total = 0

    def add(values: int, depth: int, text: int) -> None:
        nonlocal values_total, text_total
        values_total += values
        text_total += text
        if values_total > limits.max_values:
            raise _too_big(field, "holds", limits.max_values, "values (aliases expanded)")
        if text_total > limits.max_request_bytes:
            raise _too_big(field, "expands to", limits.max_request_bytes, "bytes of text once its aliases are expanded")
        if len(stack) - 1 + depth > limits.max_depth:
            raise _too_big(field, "nests", limits.max_depth, "levels")
        top = stack[-1]
        top[1] += values
        top[2] = max(top[2], depth)
        top[3] += text

    for event in events:
        if isinstance(event, yaml.ScalarEvent):
            size = len(event.value) + 1
            add(1, 0, size)
            if event.anchor:
                anchors[event.anchor] = (1, 0, size)
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in anchors:        # unknown, or its own ancestor (a cycle)
                raise UserError(field, f"alias *{event.anchor} refers to no finished anchor (recursive aliases "
                                       "are not accepted)")
            add(*anchors[event.anchor])
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            add(1, 1, 2)
            stack.append([event.anchor, 0, 0, 0])
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, values, depth, text = stack.pop()
            stack[-1][1] += values
            stack[-1][2] = max(stack[-1][2], depth + 1)
            stack[-1][3] += text
            if anchor:
                anchors[anchor] = (values + 1, depth + 1, text + 2)


# -- the resolved request ----------------------------------------------------------------------------

_ENCODE = json.encoder.encode_basestring_ascii      # what json.dumps writes for a string (ensure_ascii)


def json_size(value: Any, limit: int) -> int:
    """Bytes of ``value``'s canonical JSON (``codec.dumps``), counted without writing it.

    Stops once past ``limit`` (the answer is then some number above it): a value that shares
    one long text thousands of times (YAML aliases) costs at most ``limit`` bytes of counting,
    never its expansion."""
    size = 0
    stack = [value]
    while stack and size <= limit:
        item = stack.pop()
        if isinstance(item, str):
            size += len(_ENCODE(item))
        elif isinstance(item, dict):
            size += 2 + max(0, len(item) - 1) + sum(len(_ENCODE(str(k))) + 1 for k in item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            size += 2 + max(0, len(item) - 1)
            stack.extend(item)
        elif item is None or isinstance(item, bool):
            size += 4 if item in (None, True) else 5
        elif isinstance(item, int):
            size += len(str(item)) if item.bit_length() <= MAX_INT_BITS else limit + 1
        elif isinstance(item, float):
            size += len(json.dumps(item))
        else:
            raise TypeError(f"{type(item).__name__} is not JSON")
    return size


def check_request_size(req: Mapping[str, Any], limits: DocumentLimits,
                       names: Mapping[str, str] | None = None) -> None:
    """The resolved request's canonical JSON must fit ``max_request_bytes``; names the largest
    field (``names``: the field a request key came from, e.g. cluster <- cluster_description)."""
    limit = limits.max_request_bytes
    sizes: dict[str, int] = {}
    total = 2 + max(0, len(req) - 1)
    for key, value in req.items():
        sizes[key] = len(_ENCODE(str(key))) + 1 + json_size(value, limit)
        total += sizes[key]
        if total > limit:
            break
    if total <= limit:
        return
    for key, value in req.items():      # the largest field, each counted up to the limit at most
        if key not in sizes:
            sizes[key] = len(_ENCODE(str(key))) + 1 + json_size(value, limit)
    largest = max(sizes, key=sizes.__getitem__)
    raise UserError((names or {}).get(largest, largest),
                    f"makes the request more than {limit:,} bytes of JSON (this server's limit)")
