"""The deployment files, checked without Docker or a cluster: compose.yaml, the Dockerfile and k8s/*.yaml.

What these catch: a service whose `environment:` silently replaces the shared block (YAML merge
keys are shallow), a gRPC service without a healthcheck or readiness probe that really asks
grpc.health.v1, a checkpoint volume mounted somewhere other than the image's CRUCIBLE_HOME, a
command naming a module that does not exist, and an image that would not install the package.
The compose healthcheck commands are run for real against a grpc.health.v1 server.
"""
from __future__ import annotations

import ast
import fnmatch
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S = ROOT / "k8s"

# Every Crucible service must be told where Kafka, ClickHouse and the OTLP collector are.
SHARED_KEYS = ("CRUCIBLE_KAFKA_BOOTSTRAP", "CRUCIBLE_CLICKHOUSE_URL", "CRUCIBLE_OTEL_ENDPOINT")
# Service module -> the Settings field holding its gRPC port (the reward-aggregator serves no gRPC).
GRPC_PORT_FIELDS = {
    "control": "control_grpc_port",
    "generator": "generator_grpc_port",
    "sandbox_executor": "sandbox_grpc_port",
    "verifier": "verifier_grpc_port",
    "learner": "learner_grpc_port",
}
NO_GRPC = {"reward_aggregator", "evaluator"}
# Services that share checkpoints: the learner writes CRUCIBLE_HOME/runs/<run_id>/checkpoints and
# publishes file:// URIs the generators load.
CHECKPOINT_SHARERS = ("learner", "generator")
MODULE_PREFIX = "crucible.services."


# --- helpers ---------------------------------------------------------------------------------------

def grpc_ports() -> dict[str, int]:
    from crucible.shared.settings import Settings

    fields = Settings.model_fields
    return {module: fields[field].default for module, field in GRPC_PORT_FIELDS.items()}


def service_module(command) -> str | None:
    """'learner' for ["python", "-m", "crucible.services.learner", ...]; None for anything else."""
    if isinstance(command, str):
        command = shlex.split(command)
    if not command:
        return None
    for i, arg in enumerate(command[:-1]):
        if arg == "-m" and command[i + 1].startswith(MODULE_PREFIX):
            return command[i + 1][len(MODULE_PREFIX):]
    return None


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word != "ENV":
            continue
        tokens = shlex.split(rest)
        if tokens and "=" not in tokens[0]:  # legacy `ENV KEY value with spaces`
            env[tokens[0]] = " ".join(tokens[1:])
            continue
        for token in tokens:
            key, _, value = token.partition("=")
            env[key] = value
    return env


def image_crucible_home() -> str:
    env = dockerfile_env()
    assert "CRUCIBLE_HOME" in env, "the Dockerfile must set CRUCIBLE_HOME (where checkpoints go)"
    home = env["CRUCIBLE_HOME"]
    assert home.startswith("/") and "$" not in home, f"CRUCIBLE_HOME must be a literal absolute path, not {home!r}"
    return home.rstrip("/")


def image_user() -> str:
    users = [rest for word, rest in dockerfile_instructions() if word == "USER"]
    assert users, "the Dockerfile must not run the services as root (no USER)"
    return users[-1].split(":")[0]


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_services() -> dict[str, tuple[str, dict]]:
    """compose service name -> (module, definition), for the Crucible services only."""
    out = {}
    for name, svc in compose()["services"].items():
        module = service_module(svc.get("command"))
        if module is not None:
            out[name] = (module, svc)
    return out


def compose_env(svc: dict) -> dict[str, str | None]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", "KEY"]
        return {k: v or None for k, _, v in (item.partition("=") for item in env)}
    return {k: (None if v is None else str(v)) for k, v in env.items()}


def compose_mounts(svc: dict) -> dict[str, str]:
    """target path -> source (volume name or host path)."""
    out = {}
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            parts = v.split(":")
            if len(parts) == 1:
                out[parts[0].rstrip("/")] = ""
            else:
                out[parts[1].rstrip("/")] = parts[0]
        else:
            out[str(v["target"]).rstrip("/")] = v.get("source", "")
    return out


def k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def k8s_config_maps() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc.get("data") or {} for _, doc in k8s_docs() if doc["kind"] == "ConfigMap"}


PART_OF = "app.kubernetes.io/part-of"
WORKLOADS = ("Deployment", "StatefulSet")


def k8s_containers() -> list[tuple[str, dict, dict]]:
    """(module, container, pod spec) for every container of every workload running a Crucible service."""
    out = []
    for _, doc in k8s_docs():
        if doc["kind"] not in WORKLOADS or doc["metadata"]["labels"].get(PART_OF) == "crucible-observability":
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in pod["containers"]:
            module = service_module(container.get("command", []) + container.get("args", []))
            assert module is not None, f"{doc['kind']} {doc['metadata']['name']}: no `python -m crucible.services.<name>`"
            out.append((module, container, pod))
    return out


def k8s_env(container: dict) -> dict[str, str | None]:
    config_maps = k8s_config_maps()
    env: dict[str, str | None] = {}
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            assert name in config_maps, f"envFrom names ConfigMap {name!r}, which k8s/ does not define"
            env.update({source.get("prefix", "") + k: v for k, v in config_maps[name].items()})
    for item in container.get("env") or []:
        env[item["name"]] = item.get("value")
    return env


# --- the image -------------------------------------------------------------------------------------

def setup_py_folders() -> dict[str, str]:
    """setup.py's FOLDERS (package -> folder), read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no FOLDERS mapping")


def copied_sources() -> set[str]:
    sources = set()
    for word, rest in dockerfile_instructions():
        if word not in ("COPY", "ADD"):
            continue
        tokens = [t for t in shlex.split(rest) if not t.startswith("--")]
        sources.update(t.rstrip("/") or "." for t in tokens[:-1])
    return sources


def dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines()] if DOCKERIGNORE.exists() else []
    ignored = False
    for pattern in patterns:
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = Path(path).parts
        hit = any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))
        if hit:
            ignored = not negate
    return ignored


def test_dockerfile_copies_and_installs_every_folder_setup_py_maps():
    sources = copied_sources()
    needed = {"setup.py", "pyproject.toml"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    if 'readme = "README.md"' in pyproject:
        needed.add("README.md")  # the build reads it
    needed |= {folder.split("/")[0] for folder in setup_py_folders().values()}
    for path in sorted(needed):
        assert (ROOT / path).exists(), f"{path} is named by setup.py/pyproject.toml but missing from the tree"
        assert "." in sources or path in sources, f"the Dockerfile does not COPY {path} (copies {sorted(sources)})"
        assert not dockerignored(path), f".dockerignore excludes {path}, which the image build needs"
    installs = [rest for word, rest in dockerfile_instructions() if word == "RUN" and "pip install" in rest]
    assert any(re.search(r"pip install\b[^&;]*\s\.(\s|$)", rest) for rest in installs), \
        "no `pip install ... .` of the package in the Dockerfile"


def test_dockerfile_sets_home_and_crucible_home_for_its_user():
    env = dockerfile_env()
    home = image_crucible_home()
    assert env.get("HOME", "").startswith("/"), "the Dockerfile must set HOME (uid 10001 has no passwd home otherwise)"
    user = image_user()
    assert user not in ("0", "root"), "the services must not run as root"
    # The image creates CRUCIBLE_HOME owned by the service user, so a fresh named volume mounted
    # there starts writable (Docker copies the directory's ownership into it).
    runs = " ".join(rest for word, rest in dockerfile_instructions() if word == "RUN")
    assert home in runs and user in runs, f"no RUN creating {home} for uid {user}"


# --- compose ---------------------------------------------------------------------------------------

def test_compose_runs_every_service_with_an_existing_module():
    services = compose_services()
    modules = {module for module, _ in services.values()}
    for name, (module, _) in services.items():
        assert (ROOT / "services" / module / "__main__.py").is_file(), \
            f"compose service {name} runs crucible.services.{module}, which has no services/{module}/__main__.py"
    in_tree = {p.parent.name for p in (ROOT / "services").glob("*/__main__.py")}
    assert in_tree <= modules, f"services without a compose service: {sorted(in_tree - modules)}"


def test_compose_every_service_gets_the_shared_environment():
    for name, (_, svc) in compose_services().items():
        env = compose_env(svc)
        missing = [k for k in SHARED_KEYS if k not in env]
        assert not missing, f"compose service {name}: environment lacks {missing} (a merge that replaced the shared block?)"


def test_compose_grpc_services_have_grpc_health_healthchecks():
    ports = grpc_ports()
    for name, (module, svc) in compose_services().items():
        if module in NO_GRPC:
            continue
        assert module in ports, f"compose service {name}: unknown gRPC port for {module}"
        check = svc.get("healthcheck")
        assert check and not check.get("disable"), f"compose service {name} serves gRPC but has no healthcheck"
        text = " ".join(check["test"]) if isinstance(check["test"], list) else check["test"]
        assert "grpc_health.v1" in text and "Check" in text, f"compose service {name}: healthcheck does not query grpc.health.v1"
        assert str(ports[module]) in text, f"compose service {name}: healthcheck does not name port {ports[module]}"


def test_compose_dependencies_wait_for_healthy_infrastructure():
    services = compose()["services"]
    for name, (_, svc) in compose_services().items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for infra in ("kafka", "clickhouse"):
            assert infra in deps, f"compose service {name} does not depend on {infra}"
        for dep, spec in deps.items():
            assert dep in services, f"compose service {name} depends on unknown service {dep}"
            if spec.get("condition") == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck"


def test_compose_checkpoint_volume_is_mounted_at_the_image_crucible_home():
    home = image_crucible_home()
    named_volumes = set((compose().get("volumes") or {}).keys())
    by_module = {module: (name, svc) for name, (module, svc) in compose_services().items()}
    sources = set()
    for module in CHECKPOINT_SHARERS:
        name, svc = by_module[module]
        effective_home = compose_env(svc).get("CRUCIBLE_HOME") or home
        mounts = compose_mounts(svc)
        assert effective_home == home, f"compose service {name} overrides CRUCIBLE_HOME to {effective_home}"
        assert home in mounts, f"compose service {name}: no volume at CRUCIBLE_HOME {home} (mounts: {sorted(mounts)})"
        assert mounts[home] in named_volumes, f"compose service {name}: {home} is not a named volume"
        sources.add(mounts[home])
    assert len(sources) == 1, f"learner and generator mount different checkpoint volumes: {sources}"


class _HealthServer:
    def __init__(self):
        import grpc
        from concurrent import futures
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self.pb = health_pb2
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def set(self, serving: bool):
        status = self.pb.HealthCheckResponse.SERVING if serving else self.pb.HealthCheckResponse.NOT_SERVING
        self.servicer.set("", status)


@pytest.fixture(scope="module")
def health_server():
    server = _HealthServer()
    yield server
    server.server.stop(0)


def _run_healthcheck(test, port_in_file: int, port_here: int, cwd: Path) -> int:
    if isinstance(test, str):
        argv = ["sh", "-c", test]
    elif test[0] == "CMD":
        argv = list(test[1:])
    elif test[0] == "CMD-SHELL":
        argv = ["sh", "-c", test[1]]
    else:
        raise AssertionError(f"unexpected healthcheck form {test[0]!r}")
    argv = [a.replace(str(port_in_file), str(port_here)) for a in argv]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, timeout=60).returncode


def test_compose_healthchecks_pass_on_serving_and_fail_otherwise(health_server, tmp_path):
    """Runs each distinct gRPC healthcheck command (with `python` from this environment) against a
    real grpc.health.v1 server: it must exit 0 when SERVING, non-zero when NOT_SERVING or nothing listens."""
    ports = grpc_ports()
    seen = set()
    for name, (module, svc) in sorted(compose_services().items()):
        if module in NO_GRPC:
            continue
        test = svc["healthcheck"]["test"]
        key = repr([a.replace(str(ports[module]), "PORT") for a in (test if isinstance(test, list) else [test])])
        if key in seen:
            continue
        seen.add(key)
        health_server.set(True)
        assert _run_healthcheck(test, ports[module], health_server.port, tmp_path) == 0, \
            f"compose service {name}: healthcheck fails against a SERVING grpc.health.v1 server"
        health_server.set(False)
        assert _run_healthcheck(test, ports[module], health_server.port, tmp_path) != 0, \
            f"compose service {name}: healthcheck passes against a NOT_SERVING server"
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        assert _run_healthcheck(test, ports[module], free, tmp_path) != 0, \
            f"compose service {name}: healthcheck passes with no server"
    assert seen, "no gRPC healthchecks found in compose.yaml"


# --- k8s -------------------------------------------------------------------------------------------

def test_k8s_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert present <= listed, f"k8s manifests not in kustomization.yaml: {sorted(present - listed)}"


def test_k8s_every_service_has_a_deployment_with_an_existing_module():
    modules = set()
    for module, container, _ in k8s_containers():
        assert (ROOT / "services" / module / "__main__.py").is_file(), \
            f"k8s container {container['name']} runs crucible.services.{module}, which does not exist"
        modules.add(module)
    in_tree = {p.parent.name for p in (ROOT / "services").glob("*/__main__.py")}
    assert in_tree <= modules, f"services without a k8s Deployment: {sorted(in_tree - modules)}"


def test_k8s_every_container_gets_the_shared_environment():
    for module, container, _ in k8s_containers():
        env = k8s_env(container)
        missing = [k for k in SHARED_KEYS if not env.get(k)]
        assert not missing, f"k8s container {container['name']}: environment lacks {missing}"


def test_k8s_grpc_deployments_have_grpc_readiness_probes():
    ports = grpc_ports()
    for module, container, _ in k8s_containers():
        if module in NO_GRPC:
            continue
        port = ports[module]
        declared = {p["containerPort"] for p in container.get("ports") or []}
        assert port in declared, f"k8s container {container['name']} does not declare containerPort {port}"
        probe = container.get("readinessProbe") or {}
        assert probe.get("grpc", {}).get("port") == port, \
            f"k8s container {container['name']}: readinessProbe is not a grpc probe on {port}: {probe}"
        if "startupProbe" in container:
            assert container["startupProbe"].get("grpc", {}).get("port") == port, \
                f"k8s container {container['name']}: startupProbe is not a grpc probe on {port}"
        # gRPC health goes NOT_SERVING while the broker or the store is down (readiness): a liveness probe
        # asking it would restart every pod through an outage, so liveness asks only that the port serves.
        if "livenessProbe" in container:
            assert container["livenessProbe"].get("tcpSocket", {}).get("port") == port, \
                f"k8s container {container['name']}: livenessProbe is not a TCP probe on {port}"


def test_k8s_checkpoint_volume_is_mounted_at_the_image_crucible_home():
    home = image_crucible_home()
    claims = set()
    by_module = {module: (container, pod) for module, container, pod in k8s_containers()}
    for module in CHECKPOINT_SHARERS:
        container, pod = by_module[module]
        effective_home = (k8s_env(container).get("CRUCIBLE_HOME") or home).rstrip("/")
        assert effective_home == home, \
            f"k8s container {container['name']} sets CRUCIBLE_HOME={effective_home}, the image uses {home}"
        mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container.get("volumeMounts") or []}
        assert home in mounts, f"k8s container {container['name']}: nothing mounted at CRUCIBLE_HOME {home}"
        volume = next(v for v in pod.get("volumes") or [] if v["name"] == mounts[home])
        assert "persistentVolumeClaim" in volume, f"k8s container {container['name']}: {home} is not a PVC"
        claims.add(volume["persistentVolumeClaim"]["claimName"])
    assert len(claims) == 1, f"learner and generator mount different checkpoint claims: {claims}"


def test_k8s_learner_is_a_torchrun_group_whose_pods_find_each_other():
    """Pod i is node rank i of LEARNER_NODES, with LEARNER_GPUS_PER_NODE ranks and as many GPUs; the
    rendezvous address is pod 0 under a headless Service that publishes pods before they are ready;
    the pods start together; the gRPC Service reaches pod 0 (global rank 0) only."""
    docs = [doc for _, doc in k8s_docs()]
    learner = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "learner")
    spec = learner["spec"]
    container = spec["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"] and service_module(command) == "learner"
    flags = dict(a[2:].split("=", 1) for a in command if a.startswith("--"))
    env = {e["name"]: e for e in container["env"]}
    assert flags["nnodes"] == "$(LEARNER_NODES)" and env["LEARNER_NODES"]["value"] == str(spec["replicas"])
    assert flags["node-rank"] == "$(POD_INDEX)"
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert flags["nproc-per-node"] == "$(LEARNER_GPUS_PER_NODE)"
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == env["LEARNER_GPUS_PER_NODE"]["value"]
    assert spec["podManagementPolicy"] == "Parallel"
    host, port = flags["master-addr"], flags["master-port"]
    assert host == f"{learner['metadata']['name']}-0.{spec['serviceName']}"
    headless = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    front = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "learner")
    assert front["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "learner-0"


def test_k8s_pods_run_as_the_image_user():
    user = image_user()
    for module, container, pod in k8s_containers():
        run_as = (container.get("securityContext") or {}).get("runAsUser",
                                                               (pod.get("securityContext") or {}).get("runAsUser"))
        assert str(run_as) == user, f"k8s container {container['name']} runs as {run_as}, the image's user is {user}"


def test_k8s_grafana_and_prometheus_mount_what_dashboards_generates_and_scrape_every_service():
    generated = yaml.safe_load((ROOT / "dashboards" / "kustomization.yaml").read_text())
    assert "../dashboards" in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    maps = {}
    for m in generated["configMapGenerator"]:
        keys = []
        for f in m["files"]:
            key, _, source = f.rpartition("=") if "=" in f else (Path(f).name, "", f)
            assert (ROOT / "dashboards" / source).is_file(), f"{m['name']}: {source} does not exist"
            keys.append(key)
        maps[m["name"]] = keys
    mounted = {}
    for _, doc in k8s_docs():
        if doc["kind"] == "Deployment" and doc["metadata"]["labels"].get(PART_OF) == "crucible-observability":
            pod = doc["spec"]["template"]["spec"]
            volumes = {v["name"]: v.get("configMap", {}).get("name") for v in pod["volumes"]}
            for c in pod["containers"]:
                mounted.update({m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"] if volumes[m["name"]]})
    assert set(mounted.values()) == set(maps), (mounted, maps)
    # Grafana's provider reads the folder the dashboards are mounted at
    provider = yaml.safe_load((ROOT / "dashboards/provisioning/dashboards/crucible.yaml").read_text())
    assert mounted[provider["providers"][0]["options"]["path"]] == "grafana-dashboards"
    assert "prometheus.yml" in maps[mounted["/etc/prometheus"]]
    # Prometheus keeps the pods labelled part-of=crucible: every Crucible pod must carry the label
    scrape = yaml.safe_load((ROOT / "dashboards/prometheus-k8s.yml").read_text())["scrape_configs"][0]
    keep = next(r for r in scrape["relabel_configs"] if r.get("action") == "keep")
    assert keep["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_part_of"]
    for _, doc in k8s_docs():
        if doc["kind"] in WORKLOADS and doc["metadata"]["labels"].get(PART_OF) != "crucible-observability":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert labels.get(PART_OF) == keep["regex"], f"{doc['metadata']['name']}: pods not scraped"


# --- offline schema validation ---------------------------------------------------------------------

K8S_VERSION = "1.33"  # the oldest Kubernetes the manifests promise to run on


def test_k8s_every_manifest_is_valid_against_the_kubernetes_schema():
    """Each object, strictly (an unknown or misspelt field is an error), against the OpenAPI schema of
    its kind shipped in kubernetes-validate: no cluster needed. Custom resources (KEDA) have no schema
    there and are checked for what they point at instead."""
    kv = pytest.importorskip("kubernetes_validate")
    deployments = {doc["metadata"]["name"] for _, doc in k8s_docs() if doc["kind"] == "Deployment"}
    checked, problems = 0, []
    for name, doc in k8s_docs():
        if doc["kind"] == "Kustomization":
            continue
        if doc["apiVersion"].startswith("keda.sh/"):
            target = doc["spec"]["scaleTargetRef"]["name"]
            if target not in deployments:
                problems.append(f"{name}: ScaledObject scales {target!r}, which no Deployment is")
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
            checked += 1
        except kv.ValidationError as exc:
            problems.append(f"{name}: {doc['kind']}/{doc['metadata'].get('name')}: {exc.message} "
                            f"at {'.'.join(str(p) for p in exc.path)}")
    assert problems == [], "\n".join(problems)
    assert checked >= 20, checked


def test_kubernetes_validation_would_catch_a_misspelt_field():
    kv = pytest.importorskip("kubernetes_validate")
    deployment = next(doc for _, doc in k8s_docs() if doc["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


# The keys the Compose specification defines, at the top level and in a service (a misspelt key is
# silently ignored by some engines and refused by others).
COMPOSE_TOP = {"version", "name", "services", "networks", "volumes", "configs", "secrets", "include", "models"}
COMPOSE_SERVICE = {
    "annotations", "attach", "blkio_config", "build", "cap_add", "cap_drop", "cgroup", "cgroup_parent", "command",
    "configs", "container_name", "cpu_count", "cpu_percent", "cpu_period", "cpu_quota", "cpu_rt_period",
    "cpu_rt_runtime", "cpu_shares", "cpus", "cpuset", "credential_spec", "depends_on", "deploy", "develop",
    "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname", "entrypoint", "env_file",
    "environment", "expose", "extends", "external_links", "extra_hosts", "gpus", "group_add", "healthcheck",
    "hostname", "image", "init", "ipc", "isolation", "labels", "label_file", "links", "logging", "mac_address",
    "mem_limit", "mem_reservation", "mem_swappiness", "memswap_limit", "models", "network_mode", "networks",
    "oom_kill_disable", "oom_score_adj", "pid", "pids_limit", "platform", "ports", "post_start", "pre_stop",
    "privileged", "profiles", "provider", "pull_policy", "read_only", "restart", "runtime", "scale", "secrets",
    "security_opt", "shm_size", "stdin_open", "stop_grace_period", "stop_signal", "storage_opt", "sysctls",
    "tmpfs", "tty", "ulimits", "use_api_socket", "user", "userns_mode", "uts", "volumes", "volumes_from",
    "working_dir",
}
COMPOSE_HEALTHCHECK = {"test", "interval", "timeout", "retries", "start_period", "start_interval", "disable"}
COMPOSE_DEPENDS_ON = {"condition", "restart", "required"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def test_compose_uses_only_keys_the_compose_specification_defines():
    spec = compose()
    problems = [f"top-level {k!r}" for k in spec if k not in COMPOSE_TOP and not k.startswith("x-")]
    named_volumes = set(spec.get("volumes") or {})
    for name, svc in spec["services"].items():
        problems += [f"{name}: {k!r}" for k in svc if k not in COMPOSE_SERVICE and not k.startswith("x-")]
        if not ("image" in svc or "build" in svc):
            problems.append(f"{name}: neither image nor build")
        problems += [f"{name}: healthcheck {k!r}" for k in (svc.get("healthcheck") or {}) if k not in COMPOSE_HEALTHCHECK]
        depends = svc.get("depends_on") or {}
        for other, how in (depends.items() if isinstance(depends, dict) else ((d, {}) for d in depends)):
            if other not in spec["services"]:
                problems.append(f"{name}: depends on unknown service {other!r}")
            problems += [f"{name}: depends_on.{other} {k!r}" for k in how if k not in COMPOSE_DEPENDS_ON]
            if how.get("condition", "service_started") not in CONDITIONS:
                problems.append(f"{name}: depends_on.{other} condition {how['condition']!r}")
        for source in compose_mounts(svc).values():
            if source and not source.startswith((".", "/", "~", "$")) and source not in named_volumes:
                problems.append(f"{name}: mounts volume {source!r}, which `volumes:` does not declare")
        for port in svc.get("ports") or []:
            if not re.fullmatch(r"(\$\{[^}]+\}:|[\d.]+:)?\d+(:\d+)?(/(tcp|udp))?", str(port)):
                problems.append(f"{name}: port {port!r}")
    assert problems == [], problems
