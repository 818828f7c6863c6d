"""Kubernetes through KubeRay: `ray.io/v1` manifests from a job config and its plan, and their
offline validation (petatrain's own schemas of the KubeRay v1.7.0 API, or the cluster's CRDs when
given, built-in kinds with kubernetes-validate, and the operator's own rules)."""
