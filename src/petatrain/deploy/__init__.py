"""Kubernetes through KubeRay: `ray.io/v1` manifests from a job config and its plan, and their
offline validation (the CRDs' schemas vendored from a named KubeRay release, built-in kinds with
kubernetes-validate, and the operator's own rules)."""
