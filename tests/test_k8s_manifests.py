"""The Kubernetes manifests of ``deploy/``: schema-valid, and wired the way a fault-tolerant job needs."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33.0"
"""A recent Kubernetes release bundled with kubernetes-validate; the manifests use nothing newer."""

BUILTIN_KINDS = {"Service", "Job", "Secret", "ConfigMap"}
SECRET_ID = "AKIA-TEST-ID-7f3a"
SECRET_KEY = "test-secret-key-9c1e"


def _load_render() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_render", ROOT / "deploy" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render_mod = _load_render()
render = render_mod.render


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    """A small plan file; the manifests carry it verbatim."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "pipedream-ft-plan", "version": 1, "workers": 4, "stages": []}))
    return path


def value_sets(plan: Path) -> dict[str, dict[str, Any]]:
    return {
        "defaults": {},
        "cpu": {"replicas": 4, "gpus_per_pod": 0, "nproc_per_node": 2, "cpu": "500m", "memory": "2Gi",
                "plan_file": str(plan), "steps": 50},
        "gpu8": {"replicas": 2, "gpus_per_pod": 8, "image": "registry.example.com/ml/pipedream-ft:1.2.3",
                 "job_name": "digits-8gpu", "namespace": "training", "max_restarts": 5},
        "minio": {"s3_endpoint": "http://minio.minio.svc:9000", "bucket": "ckpts", "prefix": "/runs/a/",
                  "create_secret": True, "aws_access_key_id": SECRET_ID, "aws_secret_access_key": SECRET_KEY,
                  "plan_file": str(plan), "secret_name": "minio-creds"},
        "elastic": {"replicas": 3, "min_nodes": 2, "max_nodes": 4, "checkpoint_url": "file:///mnt/ckpt"},
    }


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


def container_of(pod_template: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any]
    (container,) = pod_template["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def expand(text: str, env: dict[str, dict[str, Any]]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command arguments from plain ``value`` variables."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env[m.group(1)]["value"] if "value" in env.get(m.group(1), {}) else m.group(0), text)


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


# ------------------------------------------------------------------------------------------ schemas


def test_bundled_schema_version_exists() -> None:
    assert K8S_VERSION in kubernetes_validate.utils.all_versions()


@pytest.mark.parametrize("case", ["defaults", "cpu", "gpu8", "minio", "elastic"])
def test_every_builtin_document_is_schema_valid(case: str, plan_file: Path) -> None:
    docs = render(value_sets(plan_file)[case])
    kinds = [d["kind"] for d in docs]
    assert set(kinds) <= BUILTIN_KINDS and {"Service", "Job"} <= set(kinds)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_catches_mistakes() -> None:
    """The validator is strict: an unknown field or a wrong type in the Job is rejected."""
    job = one(render(), "Job")
    job["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    job = one(render(), "Job")
    job["spec"]["completions"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_rendered_yaml_reloads_to_the_same_documents(plan_file: Path) -> None:
    docs = render(value_sets(plan_file)["minio"])
    assert list(yaml.safe_load_all(render_mod.dump(docs))) == docs


# ---------------------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("case", ["defaults", "cpu", "gpu8", "minio", "elastic"])
def test_headless_service_selects_the_job_pods(case: str, plan_file: Path) -> None:
    values = value_sets(plan_file)[case]
    docs = render(values)
    svc, job = one(docs, "Service"), one(docs, "Job")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    selector = svc["spec"]["selector"]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= pod_labels.items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [29400]
    assert job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["metadata"]["namespace"] == job["metadata"]["namespace"] == values.get("namespace", "default")


@pytest.mark.parametrize("case", ["defaults", "cpu", "gpu8", "minio", "elastic"])
def test_rendezvous_points_at_pod_zero_of_the_service(case: str, plan_file: Path) -> None:
    docs = render(value_sets(plan_file)[case])
    svc, job = one(docs, "Service"), one(docs, "Job")
    container = container_of(job["spec"]["template"])
    env = env_of(container)
    assert container["command"] == ["python", "-m", "torch.distributed.run"]
    args = [expand(a, env) for a in container["args"]]
    name, service = job["metadata"]["name"], svc["metadata"]["name"]
    # Indexed Job pods are named JOB-INDEX and, with subdomain SERVICE, resolve as JOB-INDEX.SERVICE
    assert flag(args, "rdzv-endpoint") == f"{name}-0.{service}:29400"
    assert flag(args, "rdzv-backend") == "c10d"
    assert flag(args, "rdzv-id") == name
    assert {"containerPort": 29400, "name": "rdzv", "protocol": "TCP"} in container["ports"]


def test_job_size_and_torchrun_flags() -> None:
    job = one(render({"replicas": 3, "min_nodes": 2, "max_nodes": 5, "gpus_per_pod": 4, "max_restarts": 7,
                      "steps": 123}), "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 3
    container = container_of(spec["template"])
    args = [expand(a, env_of(container)) for a in container["args"]]
    assert flag(args, "nnodes") == "2:5"
    assert flag(args, "nproc-per-node") == "4"
    assert flag(args, "max-restarts") == "7"
    script_at = args.index("examples/train_digits.py")
    assert args[script_at + 1:] == ["--plan", "/config/plan.json", "--ckpt",
                                    "s3://pipedream-ft/checkpoints/pipedream-ft", "--steps", "123"]
    assert all(a.startswith("--") for a in args[:script_at])  # torchrun's flags come before the script


def test_script_and_its_arguments_can_be_swapped() -> None:
    job = one(render({"script": "my_train.py", "script_args": "--data /data --epochs 3"}), "Job")
    args = container_of(job["spec"]["template"])["args"]
    assert args[args.index("my_train.py"):] == ["my_train.py", "--data", "/data", "--epochs", "3"]


def test_failed_pods_are_recreated() -> None:
    job = one(render({"backoff_limit": 9}), "Job")
    spec = job["spec"]
    assert spec["backoffLimit"] == 9
    # Never: a failed pod is replaced by the Job controller with the same index (and DNS name)
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] == 60


def test_credentials_come_from_the_secret_only(plan_file: Path) -> None:
    docs = render(value_sets(plan_file)["minio"])
    secret, job = one(docs, "Secret"), one(docs, "Job")
    assert secret["metadata"]["name"] == "minio-creds"
    job_key = secret["stringData"].pop("PIPEDREAM_FT_SECRET")
    assert re.fullmatch(r"[0-9a-f]{64}", job_key), "create_secret without job_secret makes a random key"
    assert secret["stringData"] == {"AWS_ACCESS_KEY_ID": SECRET_ID, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    secret["stringData"]["PIPEDREAM_FT_SECRET"] = job_key
    env = env_of(container_of(job["spec"]["template"]))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "PIPEDREAM_FT_SECRET"):
        assert "value" not in env[key]
        assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "minio-creds", "key": key}}
        assert key in secret["stringData"]
    text = json.dumps([d for d in docs if d["kind"] != "Secret"])
    assert SECRET_ID not in text and SECRET_KEY not in text and job_key not in text
    assert env["AWS_ENDPOINT_URL"] == {"name": "AWS_ENDPOINT_URL", "value": "http://minio.minio.svc:9000"}
    assert env["CHECKPOINT_URL"]["value"] == "s3://ckpts/runs/a"


def test_no_secret_and_no_endpoint_by_default() -> None:
    docs = render()
    assert not by_kind(docs, "Secret")
    env = env_of(container_of(one(docs, "Job")["spec"]["template"]))
    assert "AWS_ENDPOINT_URL" not in env
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "pipedream-ft-s3"


def test_liveness_probe_watches_the_health_file() -> None:
    job = one(render({"health_file": "/var/run/pdft/health", "health_stale_minutes": 3,
                      "liveness_initial_delay_s": 600}), "Job")
    container = container_of(job["spec"]["template"])
    path = env_of(container)["PIPEDREAM_FT_HEALTH_FILE"]["value"]
    assert path == "/var/run/pdft/health"
    probe = container["livenessProbe"]
    assert probe["exec"]["command"] == ["sh", "-c", f"find {path} -mmin -3 | grep -q ."]
    assert probe["initialDelaySeconds"] == 600
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 60


def test_default_liveness_probe_matches_env() -> None:
    container = container_of(one(render(), "Job")["spec"]["template"])
    path = env_of(container)["PIPEDREAM_FT_HEALTH_FILE"]["value"]
    assert path == "/tmp/pipedream-ft-health"
    assert path in container["livenessProbe"]["exec"]["command"][-1]
    assert container["livenessProbe"]["initialDelaySeconds"] >= 120


@pytest.mark.parametrize("gpus", [0, 1, 8])
def test_gpu_resources(gpus: int) -> None:
    container = container_of(one(render({"gpus_per_pod": gpus}), "Job")["spec"]["template"])
    resources = container["resources"]
    assert resources["requests"]["cpu"] == "2" and resources["requests"]["memory"] == "4Gi"
    if gpus:
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert resources["requests"]["nvidia.com/gpu"] == gpus
    else:
        assert "nvidia.com/gpu" not in resources["limits"]
        assert "nvidia.com/gpu" not in resources["requests"]
    args = container["args"]
    assert flag(args, "nproc-per-node") == str(gpus or 1)


def test_env_and_plan_config_map(plan_file: Path) -> None:
    docs = render({"plan_file": str(plan_file), "omp_num_threads": 4})
    cm, job = one(docs, "ConfigMap"), one(docs, "Job")
    assert json.loads(cm["data"]["plan.json"]) == json.loads(plan_file.read_text())
    pod = job["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    (mount,) = [m for m in container_of(job["spec"]["template"])["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == "/config"
    env = env_of(container_of(job["spec"]["template"]))
    assert env["OMP_NUM_THREADS"]["value"] == "4"
    assert all(isinstance(e.get("value", ""), str) for e in env.values())
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Job"]  # dependencies first


def test_without_a_plan_file_the_config_map_is_left_to_the_user() -> None:
    docs = render()
    assert not by_kind(docs, "ConfigMap")
    volumes = one(docs, "Job")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "plan", "configMap": {"name": "pipedream-ft-plan"}} in volumes


# ------------------------------------------------------------------------------------- PyTorchJob


def check_pytorchjob(doc: dict[str, Any]) -> None:
    """Structural checks of a Kubeflow PyTorchJob (a CRD, so no bundled schema covers it)."""
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    meta = doc["metadata"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63
    spec = doc["spec"]
    assert set(spec) <= {"elasticPolicy", "nprocPerNode", "pytorchReplicaSpecs", "runPolicy"}
    ep = spec["elasticPolicy"]
    assert set(ep) <= {"minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId",
                       "rdzvConf", "standalone", "nProcPerNode", "maxRestarts", "metrics"}
    assert ep["rdzvBackend"] == "c10d"
    for key in ("minReplicas", "maxReplicas", "maxRestarts"):
        assert isinstance(ep[key], int) and not isinstance(ep[key], bool)
    assert 1 <= ep["minReplicas"] <= ep["maxReplicas"] and ep["maxRestarts"] >= 0
    assert isinstance(spec["nprocPerNode"], str) and int(spec["nprocPerNode"]) >= 1
    assert isinstance(spec["runPolicy"]["backoffLimit"], int) and spec["runPolicy"]["backoffLimit"] >= 0
    replica_specs = spec["pytorchReplicaSpecs"]
    assert set(replica_specs) == {"Worker"}  # elastic jobs have workers only
    worker = replica_specs["Worker"]
    assert isinstance(worker["replicas"], int) and ep["minReplicas"] <= worker["replicas"] <= ep["maxReplicas"]
    assert worker["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
    containers = worker["template"]["spec"]["containers"]
    assert "pytorch" in [c["name"] for c in containers]  # the operator injects its settings there
    (main,) = [c for c in containers if c["name"] == "pytorch"]
    assert any(p["name"] == "pytorchjob-port" for p in main["ports"])


def test_pytorchjob_alternative(plan_file: Path) -> None:
    values = {"workload": "pytorchjob", "replicas": 3, "min_nodes": 2, "max_nodes": 4, "gpus_per_pod": 8,
              "max_restarts": 5, "plan_file": str(plan_file), "s3_endpoint": "https://s3.example.com",
              "create_secret": True, "aws_access_key_id": SECRET_ID, "aws_secret_access_key": SECRET_KEY}
    docs = render(values)
    assert [d["kind"] for d in docs] == ["Secret", "ConfigMap", "PyTorchJob"]
    for doc in docs[:2]:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    ptj = one(docs, "PyTorchJob")
    check_pytorchjob(ptj)
    assert ptj["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 4,
                                            "maxRestarts": 5}
    assert ptj["spec"]["nprocPerNode"] == "8"
    worker = ptj["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 3
    # the embedded pod template is a core PodTemplateSpec: validate it as one
    template = worker["template"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
                                  "template": template}, K8S_VERSION, strict=True)
    container = container_of(template)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = env_of(container)
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "AWS_SECRET_ACCESS_KEY"
    assert SECRET_KEY not in json.dumps(ptj)
    assert env["PIPEDREAM_FT_HEALTH_FILE"]["value"] in container["livenessProbe"]["exec"]["command"][-1]
    assert container["args"][0] == "examples/train_digits.py"  # torchrun settings come from PET_* variables


@pytest.mark.parametrize("bad", [
    lambda d: d["spec"]["elasticPolicy"].update(minReplicas=5),
    lambda d: d["spec"]["elasticPolicy"].update(rdzvBackend="etcd-v3"),
    lambda d: d["spec"]["elasticPolicy"].update(maxRestarts="3"),
    lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(name="x"),
    lambda d: d["spec"]["pytorchReplicaSpecs"].update(Master={}),
])
def test_pytorchjob_checks_reject_broken_documents(bad: Any) -> None:
    doc = one(render({"workload": "pytorchjob"}), "PyTorchJob")
    check_pytorchjob(doc)
    bad(doc)
    with pytest.raises(AssertionError):
        check_pytorchjob(doc)


# ------------------------------------------------------------------------------------------ bad values


BAD_VALUES = [
    ({"replicas": 0}, "replicas must be >= 1, got 0"),
    ({"min_nodes": 3, "max_nodes": 2}, "min_nodes must be <= max_nodes, got 3 > 2"),
    ({"min_nodes": 0}, "min_nodes must be >= 1, got 0"),
    ({"replicas": 5, "max_nodes": 4}, "replicas must be <= max_nodes, got 5 > 4"),
    ({"replicas": 2, "min_nodes": 3}, "replicas must be >= min_nodes, got 2 < 3"),
    ({"job_name": "Bad_Name"}, "job_name must be a DNS-1123 label"),
    ({"job_name": "-lead"}, "job_name must be a DNS-1123 label"),
    ({"job_name": "a" * 64}, "job_name must be a DNS-1123 label"),
    ({"job_name": "a" * 62, "replicas": 10}, "job_name is too long for 10 replicas"),
    ({"image": ""}, "image must be a non-empty image reference"),
    ({"checkpoint_url": "bucket/prefix"}, "checkpoint_url must be a URL with a scheme"),
    ({"checkpoint_url": "", "bucket": ""}, "checkpoint_url must be a URL with a scheme"),
    ({"gpus_per_pod": -1}, "gpus_per_pod must be >= 0, got -1"),
    ({"replicas": "four"}, "replicas must be an integer, got 'four'"),
    ({"replicas": True}, "replicas must be an integer"),
    ({"s3_endpoint": "minio:9000"}, "s3_endpoint must be empty or an http:// or https:// URL"),
    ({"memory": "lots"}, "memory must be a Kubernetes quantity"),
    ({"create_secret": True}, "aws_access_key_id must be set when create_secret is true"),
    ({"health_file": "tmp/x; rm -rf /"}, "health_file must be an absolute path"),
    ({"workload": "statefulset"}, "workload must be job or pytorchjob"),
    ({"replica": 2}, "unknown value 'replica'"),
    ({"plan_file": "/nonexistent/plan.json"}, "plan_file '/nonexistent/plan.json' is not a readable JSON file"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES)
def test_bad_values_raise_value_error_naming_the_value(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        render(values)


def test_values_file_defaults_render() -> None:
    defaults = render_mod.default_values()
    assert defaults["replicas"] >= 1 and defaults["min_nodes"] is None
    resolved = render_mod.resolve_values()
    assert resolved["min_nodes"] == resolved["max_nodes"] == defaults["replicas"]


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_writes_the_documents(tmp_path: Path, plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump({"replicas": 4, "gpus_per_pod": 2, "job_name": "from-file"}))
    out = tmp_path / "out.yaml"
    argv = ["-f", str(values_file), "--set", "image=registry.example.com/a/b:1.0", "--set", "replicas=3",
            "--set", f"plan_file={plan_file}", "--set", "script_args=--plan /config/plan.json --steps 7",
            "-o", str(out)]
    assert render_mod.main(argv) == 0
    assert capsys.readouterr().err == ""
    docs = list(yaml.safe_load_all(out.read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Job"]
    job = one(docs, "Job")
    assert job["metadata"]["name"] == "from-file"
    assert job["spec"]["completions"] == 3
    container = container_of(job["spec"]["template"])
    assert container["image"] == "registry.example.com/a/b:1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["args"][-3:] == ["/config/plan.json", "--steps", "7"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_cli_keeps_string_values_verbatim(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--set", "create_secret=true", "--set", "aws_access_key_id=yes", "--set", "aws_secret_access_key=0123"]
    assert render_mod.main(argv) == 0
    secret = one(list(yaml.safe_load_all(capsys.readouterr().out)), "Secret")
    assert secret["stringData"].pop("PIPEDREAM_FT_SECRET")
    assert secret["stringData"] == {"AWS_ACCESS_KEY_ID": "yes", "AWS_SECRET_ACCESS_KEY": "0123"}


def test_the_jobs_key_comes_from_the_values_or_the_environment_and_every_pod_reads_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    key = "k" * 40
    assert render_mod.main(["--set", "create_secret=true", "--set", f"job_secret={key}"],
                           environ={"AWS_ACCESS_KEY_ID": SECRET_ID, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert one(docs, "Secret")["stringData"]["PIPEDREAM_FT_SECRET"] == key
    env = env_of(container_of(one(docs, "Job")["spec"]["template"]))
    assert env["PIPEDREAM_FT_SECRET"]["valueFrom"] == {"secretKeyRef": {"name": "pipedream-ft-s3",
                                                                         "key": "PIPEDREAM_FT_SECRET"}}
    environ = {"AWS_ACCESS_KEY_ID": SECRET_ID, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "PIPEDREAM_FT_SECRET": key}
    assert render_mod.main(["--set", "create_secret=true"], environ=environ) == 0
    assert one(list(yaml.safe_load_all(capsys.readouterr().out)), "Secret")["stringData"]["PIPEDREAM_FT_SECRET"] == key
    assert render_mod.main(["--set", "job_secret=short"]) == 2
    assert "job_secret must be empty or at least 16 characters, got 5" in capsys.readouterr().err


def test_cli_takes_credentials_from_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"AWS_ACCESS_KEY_ID": SECRET_ID, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    assert render_mod.main(["--set", "create_secret=true"], environ=env) == 0
    secret = one(list(yaml.safe_load_all(capsys.readouterr().out)), "Secret")
    assert secret["stringData"]["AWS_SECRET_ACCESS_KEY"] == SECRET_KEY


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "replicas=0"], "replicas must be >= 1, got 0"),
    (["--set", "min_nodes=3", "--set", "max_nodes=2"], "min_nodes must be <= max_nodes"),
    (["--set", "job_name=Bad_Name"], "job_name must be a DNS-1123 label"),
    (["--set", "image="], "image must be a non-empty image reference"),
    (["--set", "checkpoint_url=bucket/prefix"], "checkpoint_url must be a URL with a scheme"),
    (["--set", "gpus_per_pod=-1"], "gpus_per_pod must be >= 0, got -1"),
    (["--set", "replicas"], "expected KEY=VALUE"),
    (["--set", "nope=1"], "unknown value 'nope'"),
    (["--bogus"], "unrecognized arguments"),
])
def test_cli_errors_are_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.yaml"
    assert render_mod.main([*argv, "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("render.py: error: ") and message in lines[0]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_values_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    assert render_mod.main(["-f", str(bad), "-o", str(tmp_path / "out.yaml")]) == 2
    assert "must hold a mapping" in capsys.readouterr().err
    assert not (tmp_path / "out.yaml").exists()


def test_cli_as_a_script(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "out.yaml"
    ok = subprocess.run([sys.executable, str(ROOT / "deploy" / "render.py"), "--set", "replicas=2", "-o", str(out)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert [d["kind"] for d in yaml.safe_load_all(out.read_text())] == ["Service", "Job"]
    bad = subprocess.run([sys.executable, str(ROOT / "deploy" / "render.py"), "--set", "replicas=0", "-o",
                          str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "render.py: error: replicas must be >= 1, got 0"
    assert not (tmp_path / "bad.yaml").exists()
