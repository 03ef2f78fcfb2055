"""Kueue manifests for the pool's jobs (validated offline, as deploy/ is) and the controller driven by a fake
of its one small interface, deciding what the local pool's policy decides."""

from __future__ import annotations

import json

import pytest
import yaml

from pipedream_ft.pool.errors import PoolError
from pipedream_ft.pool.policy import make_policy
from pipedream_ft.pool.service.k8s import (ELASTIC_ANNOTATION, QUEUE_LABEL, ClusterJob, Controller, K8sJobSpec,
                                           KubernetesApi, load_jobs, manifests, render)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.timeout(120)
K8S_VERSION = "1.33.0"


def _spec(name="digits", **kw):
    d = dict(name=name, image="registry/pipedream-ft:1.0", command=("-m", "pipedream_ft_examples.train_digits", "--plan", "p.json"),
             min_workers=1, max_workers=4, steps=400, profile="digits", checkpoint_url=f"s3://bucket/{name}")
    return K8sJobSpec(**{**d, **kw})


def test_rendered_jobs_are_suspended_elastic_kueue_jobs_and_schema_valid(tmp_path):
    docs = manifests([_spec(), _spec("gpt", gpus_per_worker=1, min_workers=2, max_workers=2)], queue="team-a")
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 2 and len([d for d in docs if d["kind"] == "Service"]) == 2
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for j in jobs:
        assert j["spec"]["suspend"] is True
        assert j["metadata"]["labels"][QUEUE_LABEL] == "team-a"
        assert j["metadata"]["annotations"][ELASTIC_ANNOTATION] == "true"
        cmd = j["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[0] == "torchrun" and "--rdzv-backend=c10d" in cmd and cmd[-2:] == ["--ckpt", f"s3://bucket/{j['metadata']['name']}"]
    assert jobs[1]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    jobset = manifests([_spec()], kind="jobset")[1]
    assert jobset["kind"] == "JobSet" and jobset["spec"]["suspend"] is True
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
                                  "spec": jobset["spec"]["replicatedJobs"][0]["template"]["spec"]}, K8S_VERSION,
                                 strict=True)
    assert list(yaml.safe_load_all(render([_spec()]))) == manifests([_spec()])
    (tmp_path / "jobs.json").write_text(json.dumps([{**_spec().__dict__, "command": list(_spec().command)}]))
    assert load_jobs(tmp_path / "jobs.json") == [_spec()]
    with pytest.raises(PoolError, match="min_workers 3 <= max_workers 2"):
        _spec(min_workers=3, max_workers=2)


class FakeApi:
    """The cluster as a dict; records every patch."""

    def __init__(self, jobs):
        self.jobs = {j.name: j for j in jobs}
        self.patches = []

    def list_jobs(self, namespace, selector):
        assert selector == f"{QUEUE_LABEL}=pipedream-pool"
        return list(self.jobs.values())

    def set_parallelism(self, namespace, name, workers):
        self.patches.append((name, "parallelism", workers))
        self.jobs[name] = ClusterJob(**{**self.jobs[name].__dict__, "parallelism": workers})

    def set_suspended(self, namespace, name, suspended):
        self.patches.append((name, "suspend", suspended))
        self.jobs[name] = ClusterJob(**{**self.jobs[name].__dict__, "suspended": suspended})


def _cluster_job(name, lo, hi, parallelism, suspended, created, steps=400):
    ann = {ELASTIC_ANNOTATION: "true", "pipedream-pool/min-workers": str(lo), "pipedream-pool/max-workers": str(hi),
           "pipedream-pool/steps": str(steps)}
    return ClusterJob(name, ann, parallelism, suspended, created)


CURVE = {1: 1.0, 2: 1.9, 3: 2.7, 4: 3.4}


@pytest.mark.parametrize("policy", ["elastic-fifo", "fifo", "goodput"])
def test_the_controller_patches_what_the_policy_decides(policy):
    api = FakeApi([_cluster_job("a", 1, 4, 4, False, 0.0), _cluster_job("b", 1, 2, 2, True, 10.0)])
    ctl = Controller(api, devices=4, throughput={"a": CURVE, "b": CURVE}, policy=policy)
    views = ctl.views(api.list_jobs("default", f"{QUEUE_LABEL}=pipedream-pool"), 20.0)
    want = make_policy(policy).allocate(20.0, views, 4)  # what the local pool would decide on the same views
    got = ctl.reconcile(20.0)
    assert got == {k: v for k, v in want.items() if v}
    for name in ("a", "b"):
        n = got.get(name, 0)
        if n:
            assert api.jobs[name].parallelism == n and not api.jobs[name].suspended
        else:
            assert api.jobs[name].suspended
    if policy == "elastic-fifo":  # a shrinks so that b is admitted
        assert got["a"] < 4 and got["b"] >= 1 and ("a", "parallelism", got["a"]) in api.patches
    assert ctl.reconcile(21.0) == got and len(api.patches) == len(set(api.patches))  # nothing more to patch


def test_the_kubernetes_client_adapter_patches_parallelism_and_suspend():
    calls = []

    class Batch:
        def patch_namespaced_job(self, name, namespace, body):
            calls.append((name, namespace, body))

    api = KubernetesApi(Batch())
    api.set_parallelism("ns", "a", 3)
    api.set_suspended("ns", "a", True)
    assert calls == [("a", "ns", {"spec": {"parallelism": 3}}), ("a", "ns", {"spec": {"suspend": True}})]
