"""The service on Ray Serve: a local single-node Ray, two replicas, requests over HTTP."""
from __future__ import annotations

import shutil
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from dbs_fast.errors import DBSError  # noqa: E402
from dbs_fast.serving.deploy import application, build  # noqa: E402
from dbs_fast.serving.service import ServiceOptions  # noqa: E402


@pytest.mark.integration
def test_ray_serve_replicas_answer_requests(exported):
    import tempfile

    from test_service import free_port

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")          # Ray's socket paths must stay short
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, _temp_dir=tmp)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        opts = ServiceOptions(model=str(exported["gpt2"]), max_rows=24, threads=1)
        serve.run(application(opts, replicas=2, cpus=1), name="dbs-fast", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:                        # replicas load the model after they start
            h = httpx.get(url + "/health", timeout=30)
            if h.status_code == 200:
                break
            assert time.time() - t0 < 180, h.text
            time.sleep(0.5)
        body = {"context": "It is", "keywords": "colony,enemy", "seed": 2, "beams": 2, "candidates": 3, "chunk": 4,
                "max_new_tokens": 16}
        answers = [_post_when_loaded(url + "/v1/generate", body) for _ in range(4)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert len({a.json()["generated"] for a in answers}) == 1          # same seed: same text on any replica
        bad = _post_when_loaded(url + "/v1/generate", {**body, "beams": 0})   # the other replica may still load
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "beams"
        assert serve.status().applications["dbs-fast"].deployments["dbs-fast"].replica_states.get("RUNNING") == 2
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _post_when_loaded(url, body, wait=180):
    """A replica answers 503 while its model loads (/health may already be 200 on the other one):
    a client retries that, as the 503 asks."""
    t0 = time.time()
    while True:
        r = httpx.post(url, json=body, timeout=120)
        if r.status_code != 503 or time.time() - t0 > wait:
            return r
        time.sleep(0.5)


def test_the_ray_cli_builder_checks_its_arguments():
    with pytest.raises(DBSError, match="unknown option"):
        build({"replicas": "2", "modle": "x"})
    with pytest.raises(DBSError, match="ray-replicas"):
        application(ServiceOptions(), replicas=0)


def test_a_cuda_replica_reserves_a_gpu():
    """Ray shows an actor only the GPUs it reserved: a `--provider cuda` replica reserves one (or
    the fraction asked), a CPU replica none; GPUs without CUDA are refused."""
    def actor(app):
        return app._bound_deployment.ray_actor_options

    assert actor(application(ServiceOptions(), 2)) == {"num_cpus": 1.0}
    assert actor(application(ServiceOptions(provider="cuda"), 2)) == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert actor(build({"replicas": "2", "provider": "cuda", "gpus": "0.5"}))["num_gpus"] == 0.5
    with pytest.raises(DBSError, match="ray-gpus"):
        application(ServiceOptions(), 1, gpus=1.0)
