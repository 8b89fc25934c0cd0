"""The LLMDeployment CRD as data: loading it, applying its defaults, validating a CR against it.

The CRD file in ``crds/`` is the single source of truth for field names, defaults and admission
rules. The API server applies those defaults and CEL rules before the operator ever sees a CR;
``kvpilot render`` reads CRs from files, so it has to do the same here. Doing it from the CRD
itself (instead of restating the defaults in Python) keeps the two from drifting apart.

Conventions follow Kubernetes' structural schemas
(https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/):
defaults are applied top-down, an object's own ``default`` first and then its properties'
defaults inside it; unknown fields are errors, as with ``kubectl apply --validate=strict``;
CEL rules (``x-kubernetes-validations``) are evaluated with ``self`` bound to the value at their
node, with the defaults already applied.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kvpilot import envs

logger = logging.getLogger(__name__)

GROUP = "serving.kvpilot.io"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_FILENAME = f"{GROUP}_{PLURAL}.yaml"

# Where the CRD lives when the package is installed from a checkout (editable or not).
_REPO_CRD = Path(__file__).resolve().parent.parent / "crds" / CRD_FILENAME
# Images and wheels set this, since crds/ is not part of the Python package.
CRD_PATH_ENV = "KVPILOT_CRD"


class InvalidLLMDeployment(ValueError):
    """A custom resource the API server would reject; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("invalid LLMDeployment:\n  " + "\n  ".join(self.errors))


def crd_path() -> Path:
    """Path of the CRD YAML: ``$KVPILOT_CRD`` if set, else ``crds/`` next to the package.

    Raises:
        FileNotFoundError: when neither exists.
    """
    path = envs.crd_path() or _REPO_CRD
    if not path.is_file():
        raise FileNotFoundError(f"LLMDeployment CRD not found at {path}; set ${CRD_PATH_ENV} to crds/{CRD_FILENAME}")
    return path


@functools.lru_cache(maxsize=4)
def _load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest as a dict (a fresh copy; callers may mutate it)."""
    return copy.deepcopy(_load(str(crd_path())))


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of version ``v1alpha1`` (a fresh copy)."""
    for version in load_crd()["spec"]["versions"]:
        if version["name"] == VERSION:
            return version["schema"]["openAPIV3Schema"]
    raise KeyError(f"CRD has no version {VERSION}")


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Return a copy of ``value`` with the schema's defaults filled in, as the API server does.

    Only absent keys are defaulted; explicit values (including ``null``) are kept.
    """
    value = copy.deepcopy(value)
    _default_in_place(value, schema)
    return value


def _default_in_place(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default_in_place(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in schema.get("properties", {}):
                    _default_in_place(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(item, schema["items"])


def to_json_schema(schema: dict[str, Any], root: bool = True) -> dict[str, Any]:
    """Translate a structural OpenAPI v3.0 schema into JSON Schema (draft 2020-12).

    OpenAPI 3.0's boolean ``exclusiveMinimum``/``exclusiveMaximum`` become numeric bounds,
    ``x-kubernetes-int-or-string`` becomes ``integer | string``, ``nullable`` admits ``null``, and
    every object that lists ``properties`` without ``x-kubernetes-preserve-unknown-fields``
    rejects unknown keys (strict field validation). ``metadata`` at the root is left open:
    the API server validates ObjectMeta itself.
    """
    out: dict[str, Any] = {}
    for key, val in schema.items():
        if key == "properties":
            out[key] = {
                name: ({"type": "object"} if root and name == "metadata" else to_json_schema(sub, root=False))
                for name, sub in val.items()
            }
        elif key == "items" and isinstance(val, dict):
            out[key] = to_json_schema(val, root=False)
        elif key == "additionalProperties" and isinstance(val, dict):
            out[key] = to_json_schema(val, root=False)
        elif key in ("exclusiveMinimum", "exclusiveMaximum", "nullable") or key.startswith("x-kubernetes-"):
            continue
        elif key == "format":
            continue  # the API server checks few formats; status timestamps are written by us
        else:
            out[key] = copy.deepcopy(val)
    if schema.get("exclusiveMinimum") is True and "minimum" in schema:
        out["exclusiveMinimum"] = out.pop("minimum")
    if schema.get("exclusiveMaximum") is True and "maximum" in schema:
        out["exclusiveMaximum"] = out.pop("maximum")
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    if schema.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = types + ["null"]
    return out


def _cel_errors(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Evaluate every ``x-kubernetes-validations`` rule under ``schema`` against ``value``."""
    import celpy  # imported lazily: only validation needs it

    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _compile_cel(rule["rule"])
        try:
            ok = bool(program.evaluate({"self": celpy.json_to_cel(value)}))
        except Exception as exc:  # a rule that cannot evaluate (e.g. missing field) rejects, as on the server
            logger.debug("CEL rule %r failed to evaluate at %s: %s", rule["rule"], path, exc)
            ok = False
        if not ok:
            errors.append(f"{path or '<root>'}: {rule.get('message', 'failed rule: ' + rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value and value[key] is not None:
                errors += _cel_errors(value[key], sub, f"{path}.{key}" if path else key)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and "properties" not in schema:
            for key, item in value.items():
                if item is not None:
                    errors += _cel_errors(item, extra, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(item, schema["items"], f"{path}[{i}]")
    return errors


@functools.lru_cache(maxsize=64)
def _compile_cel(rule: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def validate(cr: dict[str, Any]) -> None:
    """Check a (defaulted) LLMDeployment against the CRD's schema and CEL rules.

    Raises:
        InvalidLLMDeployment: listing every schema violation and failed CEL rule.
    """
    schema = openapi_schema()
    errors: list[str] = []
    if cr.get("apiVersion") != API_VERSION or cr.get("kind") != KIND:
        errors.append(f"apiVersion/kind must be {API_VERSION}/{KIND}, got {cr.get('apiVersion')}/{cr.get('kind')}")
    if not (cr.get("metadata") or {}).get("name"):
        errors.append("metadata.name is required")
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    for err in sorted(validator.iter_errors(cr), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "<root>"
        errors.append(f"{where}: {err.message}")
    if not errors:  # CEL rules assume a schema-valid object, as on the API server
        errors += _cel_errors(cr, schema, "")
    if errors:
        raise InvalidLLMDeployment(errors)


def normalize(cr: dict[str, Any]) -> dict[str, Any]:
    """Return the CR as the API server would store it: defaults applied, then validated.

    Raises:
        InvalidLLMDeployment: when the API server would reject the CR.
    """
    defaulted = apply_defaults(cr, openapi_schema())
    # status is written by controllers through the status subresource, never admitted with spec.
    validate({k: v for k, v in defaulted.items() if k != "status"})
    return defaulted
