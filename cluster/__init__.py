"""Cluster launch: hardware profiles, the KubeRay manifests rendered from serve_config.yaml, the Grafana
dashboard (see cluster/README.md)."""
