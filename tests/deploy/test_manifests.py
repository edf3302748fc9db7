"""The deployment files parse as what their consumers read (YAML, JSON), and hold the
pieces other files and tools rely on: Grafana panels with a query each on the dashboard's
datasource variable, Kubernetes objects that name each other consistently.

Environment (set by CMake): KVFERRY_DEPLOY_DIR.
"""
import glob
import json
import os

import pytest
import yaml

DEPLOY = os.environ.get("KVFERRY_DEPLOY_DIR", "")


def yaml_files():
    files = sorted(glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True) +
                   glob.glob(os.path.join(DEPLOY, "**", "*.yml"), recursive=True))
    assert files, f"no YAML under {DEPLOY!r}"
    return files


@pytest.mark.parametrize("path", yaml_files(), ids=os.path.basename)
def test_yaml_parses(path):
    with open(path) as f:
        documents = [d for d in yaml.safe_load_all(f) if d is not None]
    assert documents, f"{path} holds no document"


def load_dashboard():
    with open(os.path.join(DEPLOY, "grafana", "kvferry-dashboard.json")) as f:
        return json.load(f)


def test_dashboard_panels_have_unique_ids_and_a_query_each():
    dashboard = load_dashboard()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            # Every query follows the instance picker.
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])


def test_dashboard_panels_do_not_overlap():
    cells = set()
    for panel in load_dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))


# --- Kubernetes (deploy/k8s) -----------------------------------------------------------

def k8s_objects():
    objects = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, "k8s", "*.yaml"))):
        with open(path) as f:
            objects += [d for d in yaml.safe_load_all(f) if d is not None]
    assert objects, "no Kubernetes manifests"
    return objects


def the(kind, name=None):
    found = [o for o in k8s_objects()
             if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec():
    return the("Deployment")["spec"]["template"]["spec"]


def container(name):
    spec = pod_spec()
    found = [c for c in spec.get("containers", []) + spec.get("initContainers", [])
             if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def kvferryd_config():
    return the("ConfigMap", "kvferryd-config")["data"]["kvferryd.toml"]


def test_k8s_objects_have_kind_and_name():
    for o in k8s_objects():
        assert o.get("apiVersion") and o.get("kind") and o["metadata"].get("name"), o


def test_worker_and_kvferryd_share_one_gpu_through_one_claim():
    spec = pod_spec()
    claims = {c["name"]: c for c in spec["resourceClaims"]}
    used = set()
    for name in ("worker", "kvferryd"):
        resources = container(name)["resources"]
        # A device-plugin GPU count would give each container a GPU of its own.
        for section in ("limits", "requests"):
            assert not any("gpu" in k for k in resources.get(section, {})), (name, resources)
        assert len(resources["claims"]) == 1, name
        used.add((resources["claims"][0]["name"], resources["claims"][0]["request"]))
    assert len(used) == 1, f"the containers use different claims: {used}"
    claim_name, request = used.pop()
    template = the("ResourceClaimTemplate", claims[claim_name]["resourceClaimTemplateName"])
    requests = {r["name"]: r for r in template["spec"]["spec"]["devices"]["requests"]}
    assert requests[request]["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    assert requests[request]["exactly"].get("count", 1) == 1


def test_cuda_ipc_has_one_pid_namespace_one_shm_and_one_user():
    spec = pod_spec()
    assert spec["shareProcessNamespace"] is True
    shm = [v["name"] for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1
    for name in ("worker", "kvferryd"):
        mounts = {m["mountPath"]: m["name"] for m in container(name)["volumeMounts"]}
        assert mounts.get("/dev/shm") == shm[0], name
        assert "runAsUser" not in container(name).get("securityContext", {}), name
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001  # the image's user (Containerfile)


def test_kvferryd_probes_reach_the_daemon():
    c = container("kvferryd")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, probe
    for probe in ("startupProbe", "readinessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[0] == "kvferry" and command[-1] == "health", command
    assert c["livenessProbe"]["httpGet"]["port"] in ports
    assert c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"  # TLS is on (--tls_cert)
    assert any(a.startswith("--tls_cert=") for a in c["args"])


def test_kvferryd_stops_after_the_worker_within_the_grace_period():
    import tomllib
    c = container("kvferryd")
    assert c in pod_spec()["initContainers"] and c["restartPolicy"] == "Always"
    grace = tomllib.loads(kvferryd_config()).get("shutdown_grace_seconds", 10)
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    # The worker's drain, then kvferryd's preStop, its rpc grace and freeing the pools.
    assert pod_spec()["terminationGracePeriodSeconds"] >= 30 + pre_stop + grace + 15


def test_the_configmaps_config_and_the_args_start_through_the_entrypoint(fake):
    c = container("kvferryd")
    r = fake(*c["args"], config=kvferryd_config())
    assert r.returncode == 0, r.stderr
    assert r.served[1:] == c["args"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounted = {m["mountPath"] for m in c["volumeMounts"]}
    assert os.path.dirname(env["KVFERRY_CONFIG"]) in mounted


def test_scrape_annotations_and_podmonitor_point_at_the_metrics_port():
    deployment = the("Deployment")
    c = container("kvferryd")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert annotations["prometheus.io/scheme"] == "https"
    monitor = the("PodMonitor")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] in ports and endpoint["scheme"] == "https"
    # The rules and dashboard select job="kvferryd".
    assert {"targetLabel": "job", "replacement": "kvferryd"} in endpoint["relabelings"]


def test_prometheusrule_holds_the_rules_file():
    with open(os.path.join(DEPLOY, "prometheus", "kvferry-rules.yml")) as f:
        rules = yaml.safe_load(f)
    assert the("PrometheusRule")["spec"]["groups"] == rules["groups"]


def test_every_config_key_is_in_the_readmes_table():
    import subprocess
    daemon = os.environ.get("KVFERRY_DAEMON", "")
    r = subprocess.run([daemon, "--check-config=/dev/null"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    keys = [line.split(" = ")[0] for line in r.stdout.splitlines() if " = " in line]
    assert len(keys) > 10, r.stdout
    with open(os.path.join(os.path.dirname(DEPLOY), "README.md")) as f:
        table = [line for line in f if line.startswith("| `")]
    for key in keys:
        assert any(f"`{key}`" in line.split(" | ")[0] for line in table), \
            f"README's config table lacks `{key}`"
