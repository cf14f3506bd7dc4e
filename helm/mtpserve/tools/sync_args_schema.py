"""Bring `serve.args` in values.schema.json in step with ClusterConfig (cluster/config.py).

    python helm/mtpserve/tools/sync_args_schema.py

Fields already in the schema keep their hand-written entry; new fields get one derived from the
pydantic JSON schema (types, bounds, enums; nested models closed with additionalProperties:
false; an Optional model, which pydantic writes as anyOf [{$ref}, {type: null}], becomes one
object schema with type ["object", "null"]; a dict field keeps the type of its values); fields
gone from ClusterConfig are dropped, also inside nested models. tests/test_helm_chart.py checks
the result.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from mtpserve.cluster.config import ClusterConfig

SCHEMA = Path(__file__).resolve().parents[1] / "values.schema.json"
KEEP = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "minLength", "pattern", "items")


def _plain(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A pydantic field schema as a closed, ref-free JSON schema."""
    if "$ref" in node:
        return _plain(defs[node["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in node:
        subs = [_plain(s, defs) for s in node["anyOf"]]
        nullable = any(s.get("type") == "null" for s in subs)
        rest = [s for s in subs if s.get("type") != "null"]
        if len(rest) == 1:
            out = dict(rest[0])
            if nullable:
                t = out.get("type")
                if isinstance(t, str):
                    out["type"] = [t, "null"]
                elif "enum" in out:
                    out["enum"] = [*out["enum"], None]
            return out
        return {"anyOf": subs}
    if "properties" in node:  # a model; `type` may already be ["object", "null"] (Optional)
        return {
            "type": node.get("type", "object"),
            "additionalProperties": False,
            "properties": {k: _plain(v, defs) for k, v in node["properties"].items()},
        }
    if "const" in node:
        return {"enum": [node["const"]]}
    out = {k: v for k, v in node.items() if k in KEEP}
    if isinstance(node.get("additionalProperties"), dict):  # a dict field: type its values
        out["additionalProperties"] = _plain(node["additionalProperties"], defs)
    return out


def _sync(model: type[BaseModel], node: dict[str, Any], fresh: dict[str, Any],
          defs: dict[str, Any]) -> None:
    props = node.setdefault("properties", {})
    for name in list(props):
        if name not in model.model_fields:
            del props[name]
    for name, field in model.model_fields.items():
        want = fresh["properties"][name]  # already plain: closed, ref-free, Optional folded
        sub = getattr(field.annotation, "__args__", (field.annotation,))
        nested = [t for t in sub if isinstance(t, type) and issubclass(t, BaseModel)]
        if name not in props or (nested and "properties" not in props[name]):
            # New, or a nested model written in a shape we cannot merge into (e.g. an anyOf):
            # take the derived entry whole, keeping a hand-written description.
            old = props.get(name, {})
            props[name] = dict(want)
            if "description" in old:
                props[name]["description"] = old["description"]
            continue
        if nested:
            _sync(nested[0], props[name], want, defs)
    node["additionalProperties"] = False


def synced(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of the chart's values schema with `serve.args` in step with ClusterConfig."""
    schema = copy.deepcopy(schema)
    pyd = ClusterConfig.model_json_schema()
    defs = pyd.get("$defs", {})
    args = schema["properties"]["serve"]["properties"]["args"]
    _sync(ClusterConfig, args, _plain({k: v for k, v in pyd.items() if k != "$defs"}, defs), defs)
    return schema


def main() -> None:
    schema = synced(json.loads(SCHEMA.read_text()))
    SCHEMA.write_text(json.dumps(schema, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
