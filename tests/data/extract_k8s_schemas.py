"""Regenerate tests/data/k8s-schemas-v1.30.json from the `kubernetes-validate` wheel (PyPI).

    pip install kubernetes-validate==1.37.0 && python tests/data/extract_k8s_schemas.py

Keeps only the built-in kinds the chart renders and the definitions they reference (the
"local-strict" flavour: unknown keys are errors, as kubeconform --strict does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate

VERSION = "v1.30.0"
KINDS = {
    "v1/ConfigMap": "configmap-v1.json",
    "v1/PersistentVolumeClaim": "persistentvolumeclaim-v1.json",
    "v1/Secret": "secret-v1.json",
    "v1/Service": "service-v1.json",
    "v1/ServiceAccount": "serviceaccount-v1.json",
    "networking.k8s.io/v1/Ingress": "ingress-networking-v1.json",
    "networking.k8s.io/v1/NetworkPolicy": "networkpolicy-networking-v1.json",
    "policy/v1/PodDisruptionBudget": "poddisruptionbudget-policy-v1.json",
}


def _refs(node: Any, found: set[str]) -> Any:
    """Rewrite refs to the bundle-local `#/$defs/...` and collect their names."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and "#/$defs/" in v:
                name = v.split("#/$defs/", 1)[1]
                found.add(name)
                out[k] = "#/$defs/" + name
            elif k == "description":
                continue  # prose is most of the bytes and none of the checks
            else:
                out[k] = _refs(v, found)
        return out
    if isinstance(node, list):
        return [_refs(v, found) for v in node]
    return node


def main() -> None:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    src = root / f"{VERSION}-local-strict"
    all_defs = json.loads((src / "_definitions.json").read_text())["$defs"]
    found: set[str] = set()
    kinds = {k: _refs(json.loads((src / f).read_text()), found) for k, f in KINDS.items()}
    defs: dict[str, Any] = {}
    todo = set(found)
    while todo:
        name = todo.pop()
        more: set[str] = set()
        defs[name] = _refs(all_defs[name], more)
        todo |= more - defs.keys()
    bundle = {
        "source": f"kubernetes-validate {kubernetes_validate.__version__}, "
        f"kubernetes-json-schema/{VERSION}-local-strict (Apache-2.0)",
        "kinds": kinds,
        "$defs": dict(sorted(defs.items())),
    }
    out = Path(__file__).with_name(f"k8s-schemas-{VERSION.rsplit('.', 1)[0]}.json")
    out.write_text(json.dumps(bundle, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    print(out, out.stat().st_size, "bytes,", len(defs), "definitions")


if __name__ == "__main__":
    main()
