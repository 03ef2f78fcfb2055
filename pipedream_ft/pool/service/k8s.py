"""Beyond one machine: the pool's policy as an external controller for Kueue.

:func:`render` writes each job as a suspended batch ``Job`` (or a ``JobSet``) in a Kueue ``LocalQueue``, with
Kueue's elastic-job annotation (``kueue.x-k8s.io/elastic-job: "true"``, feature gate
``ElasticJobsViaWorkloadSlices``) and the pool's own annotations (elastic range, priority, minibatches, the
profile's name). Kueue admits by quota; it never grows a job by itself. :class:`Controller` does: every round
it lists the jobs, runs the same policy objects as the local pool on them, and patches ``spec.parallelism``
(resize) or ``spec.suspend`` (preempt) through :class:`KubeApi`, one small interface over the ``kubernetes``
client (:class:`KubernetesApi`); the tests drive it with a fake.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from ..errors import PoolError
from ..job import JobView
from ..policy import check_allocation, make_policy

__all__ = ["ClusterJob", "Controller", "K8sJobSpec", "KubeApi", "KubernetesApi", "load_jobs", "manifests", "render",
           "ELASTIC_ANNOTATION", "QUEUE_LABEL"]

ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PREFIX = "pipedream-pool/"


@dataclass(frozen=True)
class K8sJobSpec:
    """One job to render: its image and command (run by ``torchrun`` in each worker pod)."""

    name: str
    image: str
    command: tuple[str, ...]
    min_workers: int
    max_workers: int
    steps: int
    profile: str
    checkpoint_url: str
    workers: int | None = None
    priority: int = 0
    gpus_per_worker: int = 0
    cpu: str = "1"
    memory: str = "2Gi"

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c == "-" for c in self.name) or self.name != self.name.lower():
            raise PoolError(f"k8s job name {self.name!r}: lower-case letters, digits and '-' only")
        if not 1 <= self.min_workers <= self.max_workers:
            raise PoolError(f"k8s job {self.name}: need 1 <= min_workers {self.min_workers} <= max_workers "
                            f"{self.max_workers}")
        if self.steps < 1:
            raise PoolError(f"k8s job {self.name}: steps must be >= 1, got {self.steps}")


def load_jobs(path: Path) -> list[K8sJobSpec]:
    """Jobs from a JSON list of objects with :class:`K8sJobSpec`'s fields."""
    try:
        data = json.loads(Path(path).read_text())
        return [K8sJobSpec(**{**d, "command": tuple(d["command"])}) for d in data]
    except OSError as exc:
        raise PoolError(f"{path}: {exc.strerror}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise PoolError(f"{path}: not a JSON list of jobs: {exc}") from None


def _job_template(j: K8sJobSpec, namespace: str) -> dict[str, Any]:
    workers = j.workers or j.max_workers
    rdzv = f"{j.name}-rdzv.{namespace}.svc:29400"
    resources: dict[str, Any] = {"requests": {"cpu": j.cpu, "memory": j.memory}, "limits": {"memory": j.memory}}
    if j.gpus_per_worker:
        resources["limits"]["nvidia.com/gpu"] = j.gpus_per_worker
        resources["requests"]["nvidia.com/gpu"] = j.gpus_per_worker
    return {
        "parallelism": workers,
        "completions": None,
        "backoffLimit": 6,
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": "pipedream-ft", "pipedream-pool/job": j.name}},
            "spec": {
                "restartPolicy": "OnFailure",
                "terminationGracePeriodSeconds": 120,  # SIGTERM: the emergency checkpoint
                "containers": [{
                    "name": "worker",
                    "image": j.image,
                    "command": ["torchrun", f"--nnodes={j.min_workers}:{j.max_workers}", "--nproc-per-node=1",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", f"--rdzv-id={j.name}",
                                "--max-restarts=100", *j.command, "--ckpt", j.checkpoint_url],
                    "env": [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
                            {"name": "OMP_NUM_THREADS", "value": "1"}],
                    "ports": [{"containerPort": 29400, "name": "rdzv"}],
                    "resources": resources,
                }],
            },
        },
    }


def manifests(jobs: Sequence[K8sJobSpec], *, queue: str = "pipedream-pool", namespace: str = "default",
              kind: str = "job") -> list[dict[str, Any]]:
    """The documents: per job a headless rendezvous Service and a suspended Job (or JobSet)."""
    if kind not in ("job", "jobset"):
        raise PoolError(f"kind {kind!r}: expected job or jobset")
    docs: list[dict[str, Any]] = []
    for j in jobs:
        annotations = {ELASTIC_ANNOTATION: "true", PREFIX + "min-workers": str(j.min_workers),
                       PREFIX + "max-workers": str(j.max_workers), PREFIX + "workers": str(j.workers or j.max_workers),
                       PREFIX + "priority": str(j.priority), PREFIX + "steps": str(j.steps),
                       PREFIX + "profile": j.profile}
        labels = {QUEUE_LABEL: queue, "app.kubernetes.io/managed-by": "pipedream-pool"}
        meta = {"name": j.name, "namespace": namespace, "labels": labels, "annotations": annotations}
        docs.append({"apiVersion": "v1", "kind": "Service",
                     "metadata": {"name": f"{j.name}-rdzv", "namespace": namespace},
                     "spec": {"clusterIP": "None", "selector": {"pipedream-pool/job": j.name},
                              "ports": [{"name": "rdzv", "port": 29400, "targetPort": 29400}],
                              "publishNotReadyAddresses": True}})
        spec = {k: v for k, v in _job_template(j, namespace).items() if v is not None}
        if kind == "job":
            docs.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {"suspend": True, **spec}})
        else:
            docs.append({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta,
                         "spec": {"suspend": True, "replicatedJobs": [{"name": "workers", "replicas": 1,
                                                                       "template": {"spec": spec}}]}})
    return docs


def render(jobs: Sequence[K8sJobSpec], **kw: Any) -> str:
    import yaml

    return yaml.safe_dump_all(manifests(jobs, **kw), sort_keys=False)


# -- the controller --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterJob:
    """What the controller reads of one job in the cluster."""

    name: str
    annotations: Mapping[str, str]
    parallelism: int
    suspended: bool
    created: float
    finished: bool = False
    progress: int = 0
    attained: float = 0.0
    since: float = 0.0


class KubeApi(Protocol):
    """The controller's only access to the cluster."""

    def list_jobs(self, namespace: str, selector: str) -> list[ClusterJob]: ...

    def set_parallelism(self, namespace: str, name: str, workers: int) -> None: ...

    def set_suspended(self, namespace: str, name: str, suspended: bool) -> None: ...


class KubernetesApi:
    """:class:`KubeApi` over the ``kubernetes`` client's ``BatchV1Api`` (not run against a live cluster here)."""

    def __init__(self, batch: Any = None) -> None:
        if batch is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            batch = client.BatchV1Api()
        self.batch = batch

    def list_jobs(self, namespace: str, selector: str) -> list[ClusterJob]:
        out = []
        for j in self.batch.list_namespaced_job(namespace, label_selector=selector).items:
            ann = dict(j.metadata.annotations or {})
            done = any(c.type in ("Complete", "Failed") and c.status == "True" for c in (j.status.conditions or []))
            out.append(ClusterJob(j.metadata.name, ann, int(j.spec.parallelism or 0), bool(j.spec.suspend),
                                  j.metadata.creation_timestamp.timestamp(), done,
                                  int(ann.get(PREFIX + "progress", "0"))))
        return out

    def set_parallelism(self, namespace: str, name: str, workers: int) -> None:
        self.batch.patch_namespaced_job(name, namespace, {"spec": {"parallelism": workers}})

    def set_suspended(self, namespace: str, name: str, suspended: bool) -> None:
        self.batch.patch_namespaced_job(name, namespace, {"spec": {"suspend": suspended}})


@dataclass
class Controller:
    """Runs ``policy`` on the queue's jobs and patches their sizes: ``throughput[name]`` is each job's curve
    ({workers: minibatches/s}, from :class:`~pipedream_ft.pool.throughput.ThroughputModel` on its profile)."""

    api: KubeApi
    devices: int
    throughput: Mapping[str, Mapping[int, float]]
    policy: str = "elastic-fifo"
    namespace: str = "default"
    queue: str = "pipedream-pool"
    policy_options: Mapping[str, Any] = field(default_factory=dict)

    def views(self, jobs: Sequence[ClusterJob], now: float) -> list[JobView]:
        out = []
        for j in jobs:
            if j.finished:
                continue
            a = j.annotations
            lo, hi = int(a[PREFIX + "min-workers"]), int(a[PREFIX + "max-workers"])
            steps = int(a[PREFIX + "steps"])
            curve = {n: r for n, r in self.throughput[j.name].items() if lo <= n <= min(hi, self.devices)}
            alloc = 0 if j.suspended else j.parallelism
            out.append(JobView(j.name, j.created, int(a.get(PREFIX + "workers", hi)), lo, hi,
                               int(a.get(PREFIX + "priority", "0")), alloc, j.since or j.created, j.attained,
                               float(max(steps - j.progress, 1)), float(steps), alloc > 0 or j.progress > 0, curve))
        return out

    def reconcile(self, now: float) -> dict[str, int]:
        """One round: the policy's decision, and the patches that make the cluster match it."""
        jobs = self.api.list_jobs(self.namespace, f"{QUEUE_LABEL}={self.queue}")
        views = self.views(jobs, now)
        want = check_allocation(self.policy, make_policy(self.policy, **self.policy_options).allocate(
            now, views, self.devices), views, self.devices)
        by_name = {j.name: j for j in jobs}
        for v in views:
            n, j = want.get(v.name, 0), by_name[v.name]
            if n == 0:
                if not j.suspended:
                    self.api.set_suspended(self.namespace, v.name, True)  # preempted: Kueue evicts it
                continue
            if j.parallelism != n:
                self.api.set_parallelism(self.namespace, v.name, n)  # Kueue's elastic jobs resize the workload
            if j.suspended:
                self.api.set_suspended(self.namespace, v.name, False)  # Kueue still admits it by quota
        return want
