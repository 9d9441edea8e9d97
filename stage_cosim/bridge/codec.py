"""Requests in the project's vocabulary <-> the ``Design`` message, and JSON text helpers.

The mapping is one to one: a request key is a ``Design`` field of the same name. Two keys need
a second field because protobuf cannot hold "a string or a mapping": ``model_config`` travels as
JSON text, and a ``cluster`` given as a mapping travels as ``cluster_description`` (JSON text).
JSON text, not ``google.protobuf.Struct``, because Struct turns every integer into a float and
the model and cluster readers insist on integers.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from stage_cosim.bridge.documents import DocumentLimits, check_text, load_json, load_yaml
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.errors import UserError

DESIGN_FIELDS = tuple(f.name for f in pb.Design.DESCRIPTOR.fields)
_DOCUMENTS = ("model_config", "cluster_description")      # text fields holding a whole document
_REPEATED = {f.name for f in pb.Design.DESCRIPTOR.fields if f.is_repeated}


def dumps(value: Any) -> str:
    """Canonical compact JSON (sorted keys): stable text for digests and for the wire."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def loads_object(text: str, field: str, limits: DocumentLimits | None = None) -> dict[str, Any]:
    """Parse JSON text that must be an object, within ``limits``; a UserError naming ``field`` otherwise."""
    if not text:
        return {}
    value = load_json(text, field, limits or DocumentLimits())
    if not isinstance(value, dict):
        raise UserError(field, "must be a JSON object")
    return value


def design_from_request(req: Mapping[str, Any]) -> pb.Design:
    """The ``Design`` for a request mapping (client side); unknown keys are refused."""
    design = pb.Design()
    for key, value in req.items():
        if value is None:
            continue
        if key == "model_config" and not isinstance(value, str):
            value = json.dumps(value)
        if key == "cluster" and isinstance(value, Mapping):
            key, value = "cluster_description", json.dumps(dict(value))
        if key not in DESIGN_FIELDS:
            raise UserError(key, "is not a request field")
        try:
            if key in _REPEATED:
                items = value.split(",") if isinstance(value, str) else list(value)
                getattr(design, key).extend(int(x) if key == "pp_layers" else str(x).strip() for x in items)
            else:
                setattr(design, key, value)
        except (TypeError, ValueError) as exc:
            raise UserError(key, f"has the wrong type: {exc}") from None
    return design


def request_from_design(design: pb.Design, limits: DocumentLimits | None = None) -> dict[str, Any]:
    """The request mapping a ``Design`` stands for (server side): only the fields that are set.

    A field set to an empty string is refused like any other bad value (unset it for the
    default); documents are parsed within ``limits``."""
    limits = limits or DocumentLimits()
    req: dict[str, Any] = {}
    for name in DESIGN_FIELDS:
        if name in _REPEATED:
            values = list(getattr(design, name))
            if values:
                req[name] = values
        elif design.HasField(name):
            req[name] = getattr(design, name)
        for text in (req.get(name) if name in _REPEATED else [req.get(name)]) or ():
            if isinstance(text, str):
                check_text(text, name, limits, document=name in _DOCUMENTS)
                if not text.strip():
                    raise UserError(name, "is empty (leave the field unset for the default)")
    if "model_config" in req:
        req["model_config"] = loads_object(req["model_config"], "model_config", limits)
    if "cluster_description" in req:
        if "cluster" in req:
            raise UserError("cluster", "give a preset or cluster_description, not both")
        req["cluster"] = _load_cluster(req.pop("cluster_description"), limits)
    return req


def _load_cluster(text: str, limits: DocumentLimits) -> dict[str, Any]:
    doc = load_yaml(text, "cluster_description", limits)       # JSON is YAML
    if not isinstance(doc, dict):
        raise UserError("cluster_description", "must be a mapping")
    return doc
