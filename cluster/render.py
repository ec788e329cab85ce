"""Render the KubeRay RayService manifest of a hardware profile from serve_config.yaml.

    python -m cluster.render --profile h200-sp4                 # the manifest on stdout
    python -m cluster.render --profile ascend910-sp8 -o x.yaml
    python -m cluster.render --all                              # rewrite cluster/kuberay/*.yaml

The manifest's serveConfigV2 is serve_config.yaml with the profile's app args (preset, model path, device,
sp, devices per rank, capacity), so the cluster never runs a config that drifted from the repository's.

Ray's control plane stays closed: the cluster runs under Ray's token authentication (KubeRay's `authOptions`,
the token from the Kubernetes Secret RAY_TOKEN_SECRET, which the deployer creates: cluster/README.md), the
head publishes only the ports Ray itself needs (GCS for the workers, the dashboard for the KubeRay operator,
which deploys serveConfigV2 through it) and Serve's, and a NetworkPolicy, the manifest's second document,
admits from outside the Ray pods only the Serve port (and the dashboard from the KubeRay operator).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import yaml

from deployments.local import cluster_env, lingbot_app

from .profiles import PROFILES, HardwareProfile, get_profile

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "serve_config.yaml"
KUBERAY_DIR = Path(__file__).resolve().parent / "kuberay"
SERVE_PORT = 8000
DASHBOARD_PORT = 8265
GCS_PORT = 6379
MODEL_VOLUME_CLAIM = "lingbot-models"
RAY_TOKEN_SECRET = "lingbot-ray-token"      # data key auth_token (KubeRay's name for it); cluster/README.md
API_KEYS_SECRET = "lingbot-api-keys"        # data key api_keys: the clients' keys, comma-separated (optional)
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}     # the KubeRay Helm chart's operator pod


def load_serve_config(path: Path = SERVE_CONFIG) -> dict:
    return yaml.safe_load(Path(path).read_text())


def serve_config_for(base: dict, profile: HardwareProfile) -> dict:
    """`base` (a Serve config) with the profile's args on the lingbot app, and a proxy on every node."""
    config = copy.deepcopy(base)
    lingbot_app(config).setdefault("args", {}).update(profile.serve_args())
    config["proxy_location"] = "EveryNode"
    config["http_options"] = {**config.get("http_options", {}), "host": "0.0.0.0", "port": SERVE_PORT}
    return config


def _container(name: str, profile: HardwareProfile, cpus: int, memory_gi: int, devices: int, env: dict) -> dict:
    limits = {"cpu": str(cpus), "memory": f"{memory_gi}Gi"}
    if devices:
        limits[profile.k8s_resource] = str(devices)
    container = {
        "name": name, "image": profile.image,
        "resources": {"limits": dict(limits), "requests": dict(limits)},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        # the proxy's WebSocket handshake limit and its door, the autoscaler's metric pushes (deployments/local.py)
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                *({"name": k, "value": v} for k, v in env.items()),
                # the clients' API keys from a Secret, not in serveConfigV2 (which the RayService, `serve config`
                # and the dashboard show); no Secret: no keys, as without api_keys
                {"name": "LINGBOT_API_KEYS", "valueFrom": {"secretKeyRef": {"name": API_KEYS_SECRET,
                                                                            "key": "api_keys", "optional": True}}}],
        "ports": [{"containerPort": SERVE_PORT, "name": "serve"}],
    }
    if name == "ray-head":
        # KubeRay's head Service publishes these: the workers join through GCS, the operator deploys through the
        # dashboard (by these names); no Ray Client port (10001): nothing here uses it
        ports = {"gcs-server": GCS_PORT, "dashboard": DASHBOARD_PORT, "serve": SERVE_PORT}
        container["ports"] = [{"containerPort": port, "name": label} for label, port in ports.items()]
    return container


def pod_labels(profile: HardwareProfile) -> dict:
    """What every Ray pod of the profile's RayService carries (the NetworkPolicy selects by it)."""
    return {"app.kubernetes.io/name": "lingbot-serve", "app.kubernetes.io/instance": f"lingbot-{profile.name}"}


# The image's user `ray` (uid 1000, group users 100; cluster/Dockerfile), never root; no privilege escalation,
# no Linux capabilities, the runtime's default seccomp profile. Devices reach the containers through the device
# plugins (nvidia.com/gpu, huawei.com/Ascend910), which need none of these.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod(container: dict, profile: HardwareProfile) -> dict:
    container = {**container, "securityContext": copy.deepcopy(CONTAINER_SECURITY)}
    return {"metadata": {"labels": pod_labels(profile)}, "spec": {
        "securityContext": copy.deepcopy(POD_SECURITY), "containers": [container], "volumes": [
            {"name": "models", "persistentVolumeClaim": {"claimName": MODEL_VOLUME_CLAIM, "readOnly": True}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{profile.shm_gi}Gi"}}]}}


def rayservice(serve_config: dict, profile: HardwareProfile) -> dict:
    """The RayService: a head pod without accelerators (GCS, dashboard, a proxy, the ingress) and one worker
    group of accelerator nodes, scaled by Ray's autoscaler between 1 and max_worker_nodes."""
    env = cluster_env(lingbot_app(serve_config).get("args"))     # every node's proxy: the door of these settings
    head = _container("ray-head", profile, cpus=8, memory_gi=32, devices=0, env=env)
    head["readinessProbe"] = {"httpGet": {"path": "/readyz", "port": SERVE_PORT}, "periodSeconds": 10,
                              "failureThreshold": 360}       # the first group loads 14B and warms up: minutes
    worker = _container("ray-worker", profile, profile.node_cpus, profile.node_memory_gi, profile.devices_per_node,
                        env)
    worker_params = {"object-store-memory": str(int(profile.shm_gi * 0.8 * 2 ** 30))}
    if profile.ray_resource != "GPU":       # GPUs are detected from the pod's limits; other devices are named
        # KubeRay passes the value to `ray start --resources` as is: a JSON object inside a quoted string
        worker_params["resources"] = json.dumps(json.dumps({profile.ray_resource: profile.devices_per_node}))
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": f"lingbot-{profile.name}", "labels": {"app": "lingbot-serve"}},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": "2.60.0",
                # KubeRay (1.6 or newer) sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the Secret on every Ray
                # container, the autoscaler's too, and authenticates its own calls to the dashboard
                "authOptions": {"mode": "token", "secretName": RAY_TOKEN_SECRET},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"idleTimeoutSeconds": 600, "upscalingMode": "Default"},
                "headGroupSpec": {
                    "serviceType": "ClusterIP",
                    # no accelerators on the head: ranks (and their muxers, packed with them) land on workers
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "1",
                                       "object-store-memory": str(8 * 2 ** 30)},
                    "template": _pod(head, profile),
                },
                "workerGroupSpecs": [{
                    "groupName": f"{profile.device}-workers",
                    "replicas": 1, "minReplicas": 1, "maxReplicas": profile.max_worker_nodes,
                    "rayStartParams": worker_params,
                    "template": _pod(worker, profile),
                }],
            },
        },
    }


def network_policy(profile: HardwareProfile) -> dict:
    """Ingress to the RayService's pods: from each other on every port (GCS, raylets, object transfer, workers),
    from anywhere on the Serve port only (the proxies: WebSockets, the page, /healthz, /readyz), and from the
    KubeRay operator on the dashboard's port. Metrics (8080) and the dashboard for people stay inside: reach them
    through `kubectl port-forward`, or add a rule for your Prometheus (cluster/README.md)."""
    own = {"podSelector": {"matchLabels": pod_labels(profile)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"lingbot-{profile.name}-ray", "labels": {"app": "lingbot-serve"}},
        "spec": {
            "podSelector": {"matchLabels": pod_labels(profile)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own]},
                {"ports": [{"protocol": "TCP", "port": SERVE_PORT}]},
                {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}],
                 "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]},
            ],
        },
    }


class _Literal(str):
    """A string YAML writes as a | block (the embedded serve config stays readable)."""


def _literal(dumper, value):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")


yaml.SafeDumper.add_representer(_Literal, _literal)


def render(profile: HardwareProfile, serve_config_path: Path = SERVE_CONFIG) -> str:
    manifest = rayservice(serve_config_for(load_serve_config(serve_config_path), profile), profile)
    manifest["spec"]["serveConfigV2"] = _Literal(manifest["spec"]["serveConfigV2"])
    header = (f"# Generated by `python -m cluster.render --profile {profile.name}` from serve_config.yaml: edit\n"
              f"# those (or cluster/profiles.py) and re-render, never this file. {profile.description}.\n")
    return (header + yaml.safe_dump(manifest, sort_keys=False) + "---\n"
            + yaml.safe_dump(network_policy(profile), sort_keys=False))


def manifest_path(profile: HardwareProfile) -> Path:
    return KUBERAY_DIR / f"rayservice-{profile.name}.yaml"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.render", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), help="hardware profile to render")
    parser.add_argument("--serve-config", default=str(SERVE_CONFIG), help="the Serve config to embed")
    parser.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    parser.add_argument("--all", action="store_true", help=f"write every profile to {KUBERAY_DIR}")
    args = parser.parse_args(argv)
    if args.all:
        for profile in PROFILES.values():
            manifest_path(profile).write_text(render(profile, Path(args.serve_config)))
            print(f"wrote {manifest_path(profile)}")
        return 0
    if args.profile is None:
        parser.error("give --profile NAME or --all")
    text = render(get_profile(args.profile), Path(args.serve_config))
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
