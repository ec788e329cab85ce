"""The KubeRay manifests: rendered from serve_config.yaml and a hardware profile, committed without drift,
their embedded Serve config the rendered input, and every field KubeRay's RayService requires present and
typed as its CRD types it (ray.io/v1: rayStartParams map[string]string, min/maxReplicas int32, ...). Ray's
control plane stays closed: token authentication from a Secret, no port beyond those Ray and Serve need, and a
NetworkPolicy that lets only the Serve port in from outside the Ray pods."""
import pytest
import yaml

from cluster import render
from cluster.profiles import PROFILES, get_profile
from deployments.settings import ServeSettings

NAMES = sorted(PROFILES)


def documents(profile) -> tuple[dict, dict]:
    """The committed manifest's RayService and NetworkPolicy."""
    rayservice, policy = yaml.safe_load_all(render.manifest_path(profile).read_text())
    return rayservice, policy


@pytest.mark.parametrize("name", NAMES)
def test_committed_manifest_is_the_rendered_one(name):
    profile = get_profile(name)
    assert render.manifest_path(profile).read_text() == render.render(profile), \
        "cluster/kuberay is stale: run python -m cluster.render --all"


@pytest.mark.parametrize("name", NAMES)
def test_embedded_serve_config_is_serve_config_yaml_with_the_profile(name):
    profile = get_profile(name)
    manifest, _ = documents(profile)
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    base = render.load_serve_config()
    assert embedded == render.serve_config_for(base, profile)
    app = embedded["applications"][0]
    assert {k: v for k, v in app.items() if k != "args"} == {k: v for k, v in base["applications"][0].items()
                                                            if k != "args"}
    for key, value in base["applications"][0]["args"].items():       # every arg the profile does not set
        if key not in profile.serve_args():
            assert app["args"][key] == value, key
    assert embedded["proxy_location"] == "EveryNode"
    settings = ServeSettings.from_args(app["args"])                # the args are valid settings
    assert (settings.device, settings.sp, settings.rank_devices) == (profile.device, profile.sp, 1)
    assert settings.max_groups == profile.groups_per_node * profile.max_worker_nodes
    assert settings.rank_actor_options().get("num_gpus", 0) == (1 if profile.ray_resource == "GPU" else 0)
    assert settings.rank_actor_options().get("resources", {}) == ({} if profile.ray_resource == "GPU"
                                                                  else {profile.ray_resource: 1})


def _strings(mapping):
    return isinstance(mapping, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())


def _pod_template(template, where):
    containers = template["spec"]["containers"]
    assert isinstance(containers, list) and containers, where
    for c in containers:
        assert isinstance(c["name"], str) and isinstance(c["image"], str), where
        for kind in ("limits", "requests"):
            assert all(isinstance(v, str) for v in c["resources"][kind].values()), (where, kind)
    return containers


@pytest.mark.parametrize("name", NAMES)
def test_rayservice_has_what_kuberay_requires(name):
    profile = get_profile(name)
    m, _ = documents(profile)
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayService"
    assert isinstance(m["metadata"]["name"], str)
    spec = m["spec"]
    assert isinstance(spec["serveConfigV2"], str)
    cluster = spec["rayClusterConfig"]
    assert isinstance(cluster["rayVersion"], str) and isinstance(cluster["enableInTreeAutoscaling"], bool)
    head = cluster["headGroupSpec"]
    assert _strings(head["rayStartParams"])
    (head_container,) = _pod_template(head["template"], "head")
    assert profile.k8s_resource not in head_container["resources"]["limits"]        # no accelerators on the head
    assert head_container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    (workers,) = cluster["workerGroupSpecs"]
    assert isinstance(workers["groupName"], str) and _strings(workers["rayStartParams"])
    for key in ("replicas", "minReplicas", "maxReplicas"):
        assert isinstance(workers[key], int) and not isinstance(workers[key], bool), key
    assert 1 <= workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"] == profile.max_worker_nodes
    (worker,) = _pod_template(workers["template"], "worker")
    assert worker["resources"]["limits"][profile.k8s_resource] == str(profile.devices_per_node)
    volumes = {v["name"]: v for v in workers["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == render.MODEL_VOLUME_CLAIM
    mounts = {v["name"]: v["mountPath"] for v in worker["volumeMounts"]}
    assert mounts == {"models": "/models", "dshm": "/dev/shm"}
    app_args = yaml.safe_load(spec["serveConfigV2"])["applications"][0]["args"]
    assert app_args["model_path"].startswith("/models/")
    shm = int(volumes["dshm"]["emptyDir"]["sizeLimit"].removesuffix("Gi")) * 2 ** 30
    assert int(workers["rayStartParams"]["object-store-memory"]) < shm            # the store fits /dev/shm
    if profile.ray_resource == "NPU":                                             # Ray's NPU resource, by name
        assert workers["rayStartParams"]["resources"] == f'"{{\\"NPU\\": {profile.devices_per_node}}}"'


@pytest.mark.parametrize("name", NAMES)
def test_ray_runs_under_token_authentication_from_a_secret(name):
    profile = get_profile(name)
    m, _ = documents(profile)
    cluster = m["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "lingbot-ray-token"}
    assert "disabled" not in render.manifest_path(profile).read_text()
    for spec in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        (container,) = spec["template"]["spec"]["containers"]
        names = [e["name"] for e in container["env"]]
        assert "RAY_AUTH_MODE" not in names and "RAY_AUTH_TOKEN" not in names     # KubeRay sets both, from the Secret


@pytest.mark.parametrize("name", NAMES)
def test_the_clients_keys_come_from_a_secret_never_from_the_serve_config(name):
    """LINGBOT_API_KEYS from the Secret lingbot-api-keys (optional: no Secret, no keys) in every Ray container;
    serveConfigV2 (shown by the RayService, `serve config` and the dashboard) names no keys."""
    m, _ = documents(get_profile(name))
    cluster = m["spec"]["rayClusterConfig"]
    for spec in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        (container,) = spec["template"]["spec"]["containers"]
        (keys,) = [e for e in container["env"] if e["name"] == "LINGBOT_API_KEYS"]
        assert keys == {"name": "LINGBOT_API_KEYS", "valueFrom": {"secretKeyRef": {
            "name": "lingbot-api-keys", "key": "api_keys", "optional": True}}}
    assert "api_keys" not in yaml.safe_load(m["spec"]["serveConfigV2"])["applications"][0].get("args", {})


@pytest.mark.parametrize("name", NAMES)
def test_the_head_publishes_only_what_ray_and_serve_need(name):
    m, _ = documents(get_profile(name))
    cluster = m["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    (container,) = head["template"]["spec"]["containers"]
    # the workers join through GCS, the KubeRay operator deploys through the dashboard; no Ray Client port
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"gcs-server": 6379, "dashboard": 8265,
                                                                           "serve": 8000}
    (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert worker["ports"] == [{"containerPort": 8000, "name": "serve"}]


@pytest.mark.parametrize("name", NAMES)
def test_a_network_policy_lets_only_the_serve_port_in_from_outside(name):
    profile = get_profile(name)
    m, policy = documents(profile)
    cluster = m["spec"]["rayClusterConfig"]
    labels = policy["spec"]["podSelector"]["matchLabels"]
    for spec in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):      # it selects every Ray pod
        assert spec["template"]["metadata"]["labels"].items() >= labels.items()
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, serve, operator = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": labels}}]}             # the Ray pods: every port
    assert serve == {"ports": [{"protocol": "TCP", "port": 8000}]}                 # anyone: the Serve port only
    assert operator == {"from": [{"namespaceSelector": {},
                                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}],
                        "ports": [{"protocol": "TCP", "port": 8265}]}          # the operator: the dashboard only


def test_groups_per_node():
    assert get_profile("h200-sp4").groups_per_node == 2 and get_profile("h200-sp8").groups_per_node == 1
    assert get_profile("ascend910-sp8").groups_per_node == 1


def test_render_command(tmp_path, capsys):
    assert render.main(["--profile", "h200-sp4"]) == 0
    out = capsys.readouterr().out
    assert out == render.render(get_profile("h200-sp4"))
    assert render.main(["--profile", "h200-sp8", "-o", str(tmp_path / "m.yaml")]) == 0
    assert (tmp_path / "m.yaml").read_text() == render.render(get_profile("h200-sp8"))
    with pytest.raises(SystemExit):
        render.main(["--profile", "a100-sp3"])


@pytest.mark.parametrize("name", NAMES)
def test_every_ray_pod_runs_as_the_images_non_root_user_without_privileges(name):
    m, _ = documents(get_profile(name))
    cluster = m["spec"]["rayClusterConfig"]
    for spec in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        pod = spec["template"]["spec"]
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100,
                                          "fsGroup": 100, "seccompProfile": {"type": "RuntimeDefault"}}
        (container,) = pod["containers"]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert "&id" not in render.manifest_path(get_profile(name)).read_text()     # no YAML anchors between pods
