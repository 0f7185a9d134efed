"""The Kubernetes manifests in k8s/ parse, and the environment each of their pods would get
(the Job controller's JOB_COMPLETION_INDEX, the downward API's annotations filled in for
every pod) makes one group: N processes, ids 0..N-1, pod 0 the coordinator. Their restart
rules follow jaxdist's exit codes, and their training flags are real ones."""

import re
from pathlib import Path

import yaml

from jaxdist.cluster import failures
from jaxdist.cluster.environment import resolve
from jaxdist.train import config as config_lib

K8S = Path(__file__).resolve().parents[1] / "k8s"
RETRIED = set(failures.REQUEUE)  # and deaths by a signal: counted by default
NEVER = set(failures.CODES.values()) - RETRIED  # 1, 2, 74, 78, 79
INDEX = "batch.kubernetes.io/job-completion-index"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
UID, JOBSET_UID = "batch.kubernetes.io/controller-uid", "jobset.sigs.k8s.io/jobset-uid"


def documents(name: str) -> list[dict]:
    return list(yaml.safe_load_all((K8S / name).read_text()))


def the_container(pod: dict) -> dict:
    (container,) = [c for c in pod["containers"] if c["name"] == "train"]
    return container


def pod_env(container: dict, annotations: dict[str, str]) -> dict[str, str]:
    """The container's variables as the kubelet would set them for a pod with these
    annotations (JobSet and the Job controller label the pod the same way, and add their
    uids); ``$(NAME)`` refers to a variable listed before it."""
    env = {"JOB_COMPLETION_INDEX": annotations[INDEX]}  # the Job controller's, Indexed mode
    labels = annotations | {UID: "job-uid", JOBSET_UID: "jobset-uid"}
    fields = {f"metadata.annotations['{k}']": v for k, v in annotations.items()}
    fields |= {f"metadata.labels['{k}']": v for k, v in labels.items()}
    for entry in container.get("env", []):
        if "value" in entry:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(entry["value"]))
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{entry['name']}: the test does not know {path}"
            value = fields[path]
        env[entry["name"]] = value
    return env


def assert_one_group(pods: list[dict[str, str]], coordinator: str, run_id: str):
    """One group; and one run id, the same after a restart, so that a pod started again
    before the first checkpoint may reuse the run directory."""
    assert {env["JAXDIST_RUN_ID"] for env in pods} == {run_id}
    specs = [resolve(env) for env in pods]
    assert sorted(s.process_id for s in specs) == list(range(len(pods)))
    assert {(s.source, s.num_processes, s.coordinator) for s in specs} == {
        ("kubernetes", len(pods), coordinator)
    }
    assert specs[0].process_id == 0  # pod 0 (of job 0) runs the coordination service


def port_of(container: dict) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "coordinator"]
    return port


def codes(rules: list[dict], action: str) -> set[int]:
    return {c for r in rules if r["action"] == action for c in r["onExitCodes"]["values"]}


def check_pod(pod: dict, header: str, name: str):
    """Restarts resume: the run directory is on a shared volume; SIGTERM leaves time to
    save; the flags parse as the trainer's."""
    assert f"kubectl apply -f k8s/{name}" in header and "Not run on a cluster" in header
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy needs it
    assert pod["terminationGracePeriodSeconds"] >= 120
    container = the_container(pod)
    assert container["command"] == ["python", "-m", "jaxdist.train"]
    config = config_lib.parse_args(container["args"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [p for p in mounts if config.train.run_dir.startswith(p + "/")]
    assert "persistentVolumeClaim" in volumes[mounts[mount]]


def test_indexed_job_pods_form_one_group():
    service, job = documents("indexed-job.yaml")
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    assert (service["kind"], service["spec"]["clusterIP"]) == ("Service", "None")
    assert service["spec"]["selector"] == {"job-name": name}
    assert pod["subdomain"] == service["metadata"]["name"]
    assert spec["completionMode"] == "Indexed"
    n = spec["parallelism"]
    assert spec["completions"] == n and n > 1
    container = the_container(pod)
    pods = [pod_env(container, {INDEX: str(i)}) for i in range(n)]
    assert_one_group(pods, f"{name}-0.{pod['subdomain']}:{port_of(container)}", "job-uid")


def test_indexed_job_restarts_on_the_codes_that_can_succeed_again():
    header = (K8S / "indexed-job.yaml").read_text().split("apiVersion", 1)[0]
    _, job = documents("indexed-job.yaml")
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "Ignore"  # first: an evicted pod never fails the Job
    assert rules[0]["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert codes(rules, "FailJob") == NEVER
    assert codes(rules, "Count") == RETRIED
    assert job["spec"]["backoffLimit"] >= job["spec"]["parallelism"]  # a whole group, again
    check_pod(job["spec"]["template"]["spec"], header, "indexed-job.yaml")


def test_jobset_pods_form_one_group():
    (jobset,) = documents("jobset.yaml")
    name = jobset["metadata"]["name"]
    subdomain = jobset["spec"].get("network", {}).get("subdomain", name)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    container = the_container(job["template"]["spec"])
    pods = [
        pod_env(container, {JOB_INDEX: str(j), INDEX: str(i)})
        for j in range(replicated["replicas"])
        for i in range(job["parallelism"])
    ]
    assert len(pods) > job["parallelism"]  # several jobs, or the job index is never read
    hostname = f"{name}-{replicated['name']}-0-0"  # JobSet's: jobset-job-jobindex-podindex
    assert_one_group(pods, f"{hostname}.{subdomain}:{port_of(container)}", "jobset-uid")


def test_jobset_restarts_unless_the_failure_would_repeat():
    text = (K8S / "jobset.yaml").read_text()
    (jobset,) = documents("jobset.yaml")
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    (rule,) = policy["rules"]
    assert (rule["action"], rule["onJobFailureReasons"]) == ("FailJobSet", ["PodFailurePolicy"])
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0  # one failed pod restarts the whole set
    assert codes(job["podFailurePolicy"]["rules"], "FailJob") == NEVER
    check_pod(job["template"]["spec"], text.split("apiVersion", 1)[0], "jobset.yaml")
