"""The LLMDeployment operator (``kvpilot.operator``).

Pure parts, called directly by tests and ``kvpilot render``: :mod:`.crd` (the CRD's defaults and
admission rules), :mod:`.render` (CR -> Kubernetes objects), :mod:`.status` (CR status from its
workload). Cluster-facing parts: :mod:`.apply` (create-then-merge-patch with field manager
``kvpilot``) and :mod:`.handlers` (the kopf handlers). This file imports none of them, so
``kvpilot render`` does not load kopf.
"""
