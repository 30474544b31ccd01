"""Validate objects against a CRD the way the API server does, for tests.

Order as in kube-apiserver: structural defaulting, then the OpenAPI v3 schema (converted to JSON
Schema draft 4, the dialect OpenAPI 3.0 builds on; unknown fields rejected as with kubectl's
default strict field validation), then every ``x-kubernetes-validations`` CEL rule evaluated with
cel-python, with ``self`` typed by the schema (``type: number`` is a CEL double even when the
JSON says ``3``). Not emulated: CEL cost budgets, ``oldSelf`` transition rules, formats.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_crd(plural: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / f"freetoken.io_{plural}.yaml").read_text())


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill absent properties that declare a default, recursively."""
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def to_json_schema(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes") and k not in (
        "nullable", "properties", "items", "additionalProperties", "anyOf", "default", "format", "description")}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v, strict) for k, v in schema["properties"].items()}
        if strict and not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"], strict)
    if "items" in schema:
        out["items"] = to_json_schema(schema["items"], strict)
    if "anyOf" in schema:
        out["anyOf"] = [to_json_schema(s, strict) for s in schema["anyOf"]]
    return out


def _typed(schema: dict[str, Any], value: Any) -> Any:
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        return {k: _typed(props.get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items") or {}, v) for v in value]
    return value


_ENV = celpy.Environment()


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations") or ():
        program = _ENV.program(_ENV.compile(rule["rule"]))
        ok = program.evaluate({"self": celpy.json_to_cel(_typed(schema, value))})
        if not ok:
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                errors += cel_errors(sub, value[name], f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def validate(crd: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the defaulted object, error messages); no errors means the API server would accept it."""
    schema = schema_of(crd)
    obj = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft4Validator(to_json_schema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
    if errors:
        return obj, errors
    return obj, cel_errors(schema, obj)
