"""Render the Kubernetes manifests of a pipedream-ft training job from ``deploy/k8s/``.

Example (from the repository root)::

    python deploy/render.py --set image=registry.example.com/pipedream-ft:1.0 --set replicas=4 \\
        --set gpus_per_pod=8 --set plan_file=digits.plan.json -o job.yaml
    kubectl apply -f job.yaml

Values come from ``deploy/k8s/values.yaml``, then each ``-f FILE`` in order, then each ``--set KEY=VALUE``.
The templates are plain YAML with ``${name}`` placeholders (:class:`string.Template`); every placeholder is a
whole YAML value and is replaced by the JSON form of a checked value, so no value can change the structure
of a document. The few optional parts (GPU limits, the S3 endpoint, the ConfigMap, the Secret) are added in
Python. Errors are one line on stderr starting with ``render.py: error:`` and exit status 2; no output file
is written then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import string
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

import yaml

__all__ = ["ValuesError", "TEMPLATES", "default_values", "resolve_values", "render", "dump", "main"]

TEMPLATES = Path(__file__).resolve().parent / "k8s"
"""The folder of the templates and of ``values.yaml``."""

APP = "pipedream-ft"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$")
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/-]+$")


class ValuesError(ValueError):
    """A value is missing, of the wrong type or out of range; the message names it."""


# ----------------------------------------------------------------------------------------------- values


def default_values() -> dict[str, Any]:
    """The defaults from ``deploy/k8s/values.yaml``."""
    data = yaml.safe_load((TEMPLATES / "values.yaml").read_text())
    assert isinstance(data, dict)
    return data


_INT_KEYS = ("replicas", "gpus_per_pod", "steps", "max_restarts", "backoff_limit", "rdzv_port", "omp_num_threads",
             "health_stale_minutes", "liveness_initial_delay_s", "termination_grace_s")
_OPTIONAL_INT_KEYS = ("min_nodes", "max_nodes", "nproc_per_node")
_QUANTITY_KEYS = ("cpu", "memory", "shm_size")
_BOOL_KEYS = ("create_secret",)
_LIST_KEYS = ("script_args",)


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9]+", value.strip()):
            return int(value)
        raise ValuesError(f"{key} must be an integer, got {value!r}")
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValuesError(message)


def resolve_values(values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Merge ``values`` over the defaults, check every value and fill in the derived ones.

    Raises :class:`ValuesError` (a ``ValueError``) naming the first bad value, e.g.
    ``replicas must be >= 1, got 0``.
    """
    v = default_values()
    for key, value in (values or {}).items():
        _check(key in v, f"unknown value {key!r} (the known ones are in deploy/k8s/values.yaml)")
        v[key] = value

    for key in _INT_KEYS:
        v[key] = _int(key, v[key])
    for key in _OPTIONAL_INT_KEYS:
        v[key] = None if v[key] in (None, "") else _int(key, v[key])
    for key in _BOOL_KEYS:
        _check(isinstance(v[key], bool), f"{key} must be true or false, got {v[key]!r}")
    for key in _QUANTITY_KEYS:
        text = str(v[key]).strip() if isinstance(v[key], (str, int, float)) and not isinstance(v[key], bool) else ""
        _check(bool(_QUANTITY.match(text)),
               f"{key} must be a Kubernetes quantity such as 2, 500m or 4Gi, got {v[key]!r}")
        v[key] = text
    for key in _LIST_KEYS:
        if isinstance(v[key], str):
            v[key] = shlex.split(v[key])
        _check(isinstance(v[key], list), f"{key} must be a list of strings, got {v[key]!r}")
        v[key] = [str(a) for a in v[key]]
    for key, value in v.items():
        if key not in (*_INT_KEYS, *_OPTIONAL_INT_KEYS, *_QUANTITY_KEYS, *_BOOL_KEYS, *_LIST_KEYS):
            _check(value is None or isinstance(value, str), f"{key} must be a string, got {value!r}")
            v[key] = (value or "").strip()

    # sizes
    n = v["replicas"]
    _check(n >= 1, f"replicas must be >= 1, got {n}")
    explicit = v["min_nodes"] is not None and v["max_nodes"] is not None
    v["min_nodes"] = n if v["min_nodes"] is None else v["min_nodes"]
    v["max_nodes"] = n if v["max_nodes"] is None else v["max_nodes"]
    lo, hi = v["min_nodes"], v["max_nodes"]
    _check(lo >= 1, f"min_nodes must be >= 1, got {lo}")
    _check(not explicit or lo <= hi, f"min_nodes must be <= max_nodes, got {lo} > {hi}")
    _check(n >= lo, f"replicas must be >= min_nodes, got {n} < {lo}")
    _check(n <= hi, f"replicas must be <= max_nodes, got {n} > {hi}")
    _check(v["gpus_per_pod"] >= 0, f"gpus_per_pod must be >= 0, got {v['gpus_per_pod']}")
    if v["nproc_per_node"] is None:
        v["nproc_per_node"] = v["gpus_per_pod"] or 1
    _check(v["nproc_per_node"] >= 1, f"nproc_per_node must be >= 1, got {v['nproc_per_node']}")
    for key in ("steps", "omp_num_threads", "health_stale_minutes"):
        _check(v[key] >= 1, f"{key} must be >= 1, got {v[key]}")
    for key in ("max_restarts", "backoff_limit", "liveness_initial_delay_s", "termination_grace_s"):
        _check(v[key] >= 0, f"{key} must be >= 0, got {v[key]}")
    _check(1 <= v["rdzv_port"] <= 65535, f"rdzv_port must be in [1, 65535], got {v['rdzv_port']}")

    # names
    name = v["job_name"]
    _check(len(name) <= 63 and bool(_DNS_LABEL.match(name)),
           f"job_name must be a DNS-1123 label (lowercase letters, digits and '-', starting and ending with a "
           f"letter or digit, at most 63 characters), got {name!r}")
    longest = f"{name}-{n - 1}"
    _check(len(longest) <= 63, f"job_name is too long for {n} replicas: pod hostname {longest!r} exceeds 63 characters")
    _check(len(v["namespace"]) <= 63 and bool(_DNS_LABEL.match(v["namespace"])),
           f"namespace must be a DNS-1123 label, got {v['namespace']!r}")
    _check(len(v["secret_name"]) <= 253 and bool(_DNS_SUBDOMAIN.match(v["secret_name"])),
           f"secret_name must be a DNS-1123 subdomain, got {v['secret_name']!r}")
    _check(bool(v["image"]) and not re.search(r"\s", v["image"]),
           f"image must be a non-empty image reference, got {v['image']!r}")
    _check(v["image_pull_policy"] in ("Always", "IfNotPresent", "Never"),
           f"image_pull_policy must be Always, IfNotPresent or Never, got {v['image_pull_policy']!r}")
    _check(v["workload"] in ("job", "pytorchjob"), f"workload must be job or pytorchjob, got {v['workload']!r}")
    _check(bool(v["script"]), "script must be a non-empty path, got ''")

    # storage
    if not v["checkpoint_url"] and v["bucket"]:
        prefix = v["prefix"].strip("/")
        v["checkpoint_url"] = f"s3://{v['bucket']}/{prefix}" if prefix else f"s3://{v['bucket']}"
    _check(bool(_URL.match(v["checkpoint_url"])),
           f"checkpoint_url must be a URL with a scheme such as s3://bucket/prefix, got {v['checkpoint_url']!r}")
    _check(not v["s3_endpoint"] or bool(re.match(r"^https?://\S+$", v["s3_endpoint"])),
           f"s3_endpoint must be empty or an http:// or https:// URL, got {v['s3_endpoint']!r}")
    if v["create_secret"]:
        for key in ("aws_access_key_id", "aws_secret_access_key"):
            _check(bool(v[key]), f"{key} must be set when create_secret is true")
    _check(not v["job_secret"] or len(v["job_secret"]) >= 16,
           f"job_secret must be empty or at least 16 characters, got {len(v['job_secret'])}")
    if v["create_secret"] and not v["job_secret"]:
        v["job_secret"] = secrets.token_hex(32)

    # health probe (its path goes into a shell command, so keep it plain)
    _check(bool(_SAFE_PATH.match(v["health_file"])),
           f"health_file must be an absolute path of letters, digits, '.', '_', '-' and '/', got {v['health_file']!r}")

    # plan
    v["plan_json"] = None
    if v["plan_file"]:
        try:
            text = Path(v["plan_file"]).read_text()
            plan = json.loads(text)
        except (OSError, ValueError) as exc:
            raise ValuesError(f"plan_file {v['plan_file']!r} is not a readable JSON file: {exc}") from None
        _check(isinstance(plan, dict), f"plan_file {v['plan_file']!r} must hold a JSON object")
        v["plan_json"] = text
    return v


# --------------------------------------------------------------------------------------------- rendering


def _template(name: str, mapping: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Substitute the JSON form of each value into ``deploy/k8s/NAME`` and parse the YAML documents."""
    text = string.Template((TEMPLATES / name).read_text()).substitute(
        {k: json.dumps(val) for k, val in mapping.items()})
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _torchrun_args(v: Mapping[str, Any]) -> list[str]:
    """torchrun flags, then the script and its arguments; ``$(VAR)`` is expanded by Kubernetes from ``env``."""
    flags: list[str] = []
    if v["workload"] == "job":  # with a PyTorchJob the operator passes these as PET_* variables
        flags = [
            f"--nnodes={v['min_nodes']}:{v['max_nodes']}",
            f"--nproc-per-node={v['nproc_per_node']}",
            f"--max-restarts={v['max_restarts']}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=$(JOB_NAME)-0.$(SERVICE):{v['rdzv_port']}",
            "--rdzv-id=$(JOB_NAME)",
        ]
    return [*flags, v["script"], *v["script_args"]]


def _pod_template(v: Mapping[str, Any], mapping: Mapping[str, Any]) -> dict[str, Any]:
    (pod,) = _template("pod.yaml", mapping)
    spec = pod["spec"]
    (container,) = spec["containers"]
    container["args"] = _torchrun_args(v)
    if v["s3_endpoint"]:
        container["env"].append({"name": "AWS_ENDPOINT_URL", "value": v["s3_endpoint"]})
    if v["gpus_per_pod"] > 0:
        container["resources"]["limits"]["nvidia.com/gpu"] = v["gpus_per_pod"]
        container["resources"]["requests"]["nvidia.com/gpu"] = v["gpus_per_pod"]
    if v["workload"] == "job":
        spec["subdomain"] = mapping["service"]  # hostname JOB-INDEX, DNS name JOB-INDEX.SERVICE
        spec["restartPolicy"] = "Never"  # podFailurePolicy needs it; the Job recreates a failed pod
    else:
        container["env"] = [e for e in container["env"] if e["name"] != "SERVICE"]
        container["ports"][0]["name"] = "pytorchjob-port"  # where the operator looks for the rendezvous port
        spec["restartPolicy"] = "OnFailure"
    return pod


def render(values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The manifest documents for ``values`` (merged over ``deploy/k8s/values.yaml``), in apply order.

    ``workload: job`` gives [Secret], [ConfigMap], Service, Job; ``workload: pytorchjob`` gives [Secret],
    [ConfigMap], PyTorchJob. The Secret comes only with ``create_secret: true``, the ConfigMap only with a
    ``plan_file``. Raises :class:`ValuesError` (a ``ValueError``) naming the first bad value.
    """
    v = resolve_values(values)
    name = v["job_name"]
    mapping: dict[str, Any] = {
        key: v[key] for key in (
            "job_name", "namespace", "image", "image_pull_policy", "replicas", "min_nodes", "max_nodes",
            "cpu", "memory", "shm_size", "checkpoint_url", "secret_name", "max_restarts", "backoff_limit",
            "rdzv_port", "health_file", "liveness_initial_delay_s", "termination_grace_s",
            "aws_access_key_id", "aws_secret_access_key", "job_secret")
    }
    mapping.update(
        service=name,
        labels={"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": name},
        container_name="trainer" if v["workload"] == "job" else "pytorch",  # the operator requires "pytorch"
        plan_configmap=f"{name}-plan",
        plan_json=v["plan_json"] or "",
        steps_str=str(v["steps"]),
        omp_num_threads_str=str(v["omp_num_threads"]),
        nproc_per_node_str=str(v["nproc_per_node"]),
        probe_command=f"find {v['health_file']} -mmin -{v['health_stale_minutes']} | grep -q .",
    )
    docs: list[dict[str, Any]] = []
    if v["create_secret"]:
        docs += _template("secret.yaml", mapping)
    if v["plan_json"] is not None:
        docs += _template("configmap.yaml", mapping)
    pod = _pod_template(v, mapping)
    if v["workload"] == "job":
        docs += _template("service.yaml", mapping)
        (job,) = _template("job.yaml", mapping)
        job["spec"]["template"] = pod
    else:
        (job,) = _template("pytorchjob.yaml", mapping)
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"] = pod
    docs.append(job)
    return docs


def dump(docs: Sequence[Mapping[str, Any]]) -> str:
    """The documents as one multi-document YAML text."""
    header = "# Rendered by deploy/render.py; edit the values, not this file.\n"
    body: str = yaml.safe_dump_all(list(docs), sort_keys=False, default_flow_style=False, width=120)
    return header + body


# ---------------------------------------------------------------------------------------------------- CLI


class CliError(Exception):
    """A user error: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="render.py", description="Render the Kubernetes manifests of a pipedream-ft training job.")
    p.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                   help="YAML file of values over deploy/k8s/values.yaml (repeatable; later files win)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="one value, parsed as YAML (repeatable; wins over -f)")
    p.add_argument("-o", "--output", default="-", metavar="OUT", help="output file (default: stdout)")
    return p


def _parse_set(item: str, defaults: Mapping[str, Any]) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise CliError(f"bad --set {item!r}: expected KEY=VALUE")
    if key not in defaults:
        raise CliError(f"bad --set {item!r}: unknown value {key!r}")
    default = defaults[key]
    if key in _LIST_KEYS or (isinstance(default, str) and key not in _QUANTITY_KEYS):
        return key, text  # keep strings verbatim: YAML would turn `yes` or `0123` into something else
    try:
        return key, yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return key, text


def _load_values_file(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CliError(f"cannot read values file {path!r}: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CliError(f"values file {path!r} must hold a mapping of KEY: VALUE")
    return data


def _write(path: str, text: str) -> None:
    """Write atomically: the file appears complete or not at all."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".", prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0, or 2 after a one-line error on stderr)."""
    env = os.environ if environ is None else environ
    try:
        args = _parser().parse_args(argv)
        defaults = default_values()
        values: dict[str, Any] = {}
        for path in args.values:
            values.update(_load_values_file(path))
        values.update(_parse_set(item, defaults) for item in args.sets)
        if values.get("create_secret"):  # credentials from the environment keep them out of shell history
            for key in ("aws_access_key_id", "aws_secret_access_key"):
                if not values.get(key) and env.get(key.upper()):
                    values[key] = env[key.upper()]
            if not values.get("job_secret") and env.get("PIPEDREAM_FT_SECRET"):
                values["job_secret"] = env["PIPEDREAM_FT_SECRET"]
        text = dump(render(values))
        if args.output == "-":
            sys.stdout.write(text)
        else:
            try:
                _write(args.output, text)
            except OSError as exc:
                raise CliError(f"cannot write {args.output!r}: {exc.strerror or exc}") from None
    except (CliError, ValuesError) as exc:
        print(f"render.py: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
