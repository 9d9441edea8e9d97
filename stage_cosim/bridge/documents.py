"""JSON and YAML a client sends, parsed within limits: size, values after alias expansion, depth.

A request carries documents as text (``model_config``, ``cluster_description``,
``settings_json``). Parsed without limits, a few hundred bytes of YAML aliases ("billion
laughs") expand to a request of many megabytes, and deep nesting ends in a RecursionError. Here
every document is refused, as a UserError naming its field, when

* its text is longer than ``max_bytes``;
* it holds more than ``max_values`` values once aliases are expanded (counted from the parser's
  events, which share an anchored node instead of copying it: nothing is expanded to count);
* it nests deeper than ``max_depth``;

and the resolved request as a whole is refused when its canonical JSON exceeds
``max_request_bytes`` (:func:`check_request_size`), naming its largest field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from stage_cosim.errors import UserError


@dataclass(frozen=True)
class DocumentLimits:
    max_bytes: int = 256 << 10            # one document's text
    max_values: int = 50_000              # scalars and collections, aliases expanded
    max_depth: int = 32                   # nesting of mappings and lists
    max_text_chars: int = 1024            # a request's other text fields (names, choices)
    max_request_bytes: int = 256 << 10    # the resolved request, as canonical JSON


def _too_big(field: str, what: str, limit: int, unit: str) -> UserError:
    return UserError(field, f"{what} more than {limit:,} {unit} (this server's limit)")


def check_text(text: str, field: str, limits: DocumentLimits, document: bool = True) -> None:
    limit = limits.max_bytes if document else limits.max_text_chars
    if len(text) > limit:                  # characters ≤ bytes: a cheap first look
        raise _too_big(field, f"is {len(text):,} characters long:", limit, "bytes" if document else "characters")
    if document and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise _too_big(field, "is", limit, "bytes")


def measure(value: Any, field: str, limits: DocumentLimits) -> None:
    """Refuse a parsed value with too many values or too deep a nesting (iterative: no recursion)."""
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
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def load_json(text: str, field: str, limits: DocumentLimits) -> Any:
    import json

    check_text(text, field, limits)
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_big(field, "nests", limits.max_depth, "levels") from None
    except json.JSONDecodeError as exc:
        raise UserError(field, f"is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    measure(value, field, limits)
    return value


def load_yaml(text: str, field: str, limits: DocumentLimits) -> Any:
    """One YAML (or JSON) document, with the safe loader, after its events passed the limits."""
    import yaml

    check_text(text, field, limits)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        _check_events(yaml.parse(text, Loader=loader), field, limits)
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        raise UserError(field, f"is not valid JSON or YAML ({exc.__class__.__name__})") from None


def _check_events(events: Any, field: str, limits: DocumentLimits) -> None:
    """Count values and depth as if every alias were expanded, from the event stream."""
    import yaml

    anchors: dict[str, tuple[int, int]] = {}         # anchor -> (values, depth) of its node
    # open collections: [anchor, values so far, depth below]
    stack: list[list[Any]] = [[None, 0, 0]]
    total = 0

    def add(values: int, depth: int) -> None:
        nonlocal total
        total += values
        if total > limits.max_values:
            raise _too_big(field, "holds", limits.max_values, "values (aliases expanded)")
        if len(stack) - 1 + depth > limits.max_depth:
            raise _too_big(field, "nests", limits.max_depth, "levels")
        top = stack[-1]
        top[1] += values
        top[2] = max(top[2], depth)

    for event in events:
        if isinstance(event, yaml.ScalarEvent):
            add(1, 0)
            if event.anchor:
                anchors[event.anchor] = (1, 0)
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in anchors:        # unknown, or its own ancestor (a cycle)
                raise UserError(field, f"alias *{event.anchor} refers to no finished anchor (recursive aliases "
                                       "are not accepted)")
            add(*anchors[event.anchor])
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            add(1, 1)
            stack.append([event.anchor, 0, 0])
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, values, depth = stack.pop()
            stack[-1][1] += values
            stack[-1][2] = max(stack[-1][2], depth + 1)
            if anchor:
                anchors[anchor] = (values + 1, depth + 1)


def check_request_size(req: Mapping[str, Any], limits: DocumentLimits) -> None:
    """The resolved request's canonical JSON must fit ``max_request_bytes``; names the largest field."""
    from stage_cosim.bridge.codec import dumps

    size = len(dumps(req).encode())
    if size > limits.max_request_bytes:
        largest = max(req, key=lambda k: len(dumps(req[k])))
        raise UserError(largest, f"makes the request {size:,} bytes of JSON; this server takes at most "
                                 f"{limits.max_request_bytes:,}")
