"""Replicas under Ray Serve: a local Ray (loopback, 2 CPUs, no dashboard), two replicas of the server
on a tiny model behind Ray's proxy, concurrent requests through the one endpoint.

Skipped only when Ray is not installed (the optional extra specdec[ray]; `make test` installs it).
"""

import asyncio
import json
import os
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.server.app import ServerSettings
from test_server import SETTINGS, free_port, greedy


# Loopback only: Ray turns 127.0.0.1 into the machine's address unless told (before it is imported)
# that this is no cluster.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="Ray Serve is the optional extra: pip install 'specdec[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'specdec[ray]'")

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def engine(tiny_folder):
    from specdec import Engine

    return Engine.load(str(tiny_folder), dtype="float32")


@pytest.fixture(scope="module")
def endpoint(tiny_folder, tmp_path_factory):
    from specdec.server.ray_app import APP_NAME, application

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address=HOST, log_to_driver=False,
             configure_logging=False, _temp_dir=str(tmp_path_factory.mktemp("ray-tmp")))
    try:
        port = free_port()
        serve.start(http_options={"host": HOST, "port": port})
        settings = ServerSettings(model=str(tiny_folder), **SETTINGS)
        # Session affinity on: requests without X-Session-Id are still spread (hashed per request).
        serve.run(application(settings, replicas=2, replica_cpus=0.5, session_affinity=True), name=APP_NAME,
                  route_prefix="/")
        yield f"http://{HOST}:{port}"
        serve.shutdown()
        with pytest.raises(httpx.TransportError):  # the proxy is gone
            httpx.get(f"http://{HOST}:{port}/health", timeout=5)
    finally:
        ray.shutdown()


def samples(url: str, name: str, labels: str = "") -> dict[str, float]:
    """replica -> value of specdec:`name` with these labels besides replica and model_name (label
    text, e.g. ',finished_reason="length"'), from /metrics."""
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            rest = {k: v for k, v in sample.labels.items() if k not in ("replica", "model_name")}
            if sample.name == f"specdec:{name}" and rest == wanted:
                out[sample.labels["replica"]] = sample.value
    return out


def finished(url: str) -> dict[str, float]:
    return samples(url, "request_success_total", ',finished_reason="length"')


def finished_when(url: str, total: float, timeout: float = 15.0) -> dict[str, float]:
    """`finished` once its sum reaches `total`: another replica's counters reach the hub within its push
    period (ray_app.PUSH_S)."""
    deadline = time.time() + timeout
    while sum((now := finished(url)).values()) < total and time.time() < deadline:
        time.sleep(0.5)
    return now


def test_two_replicas_answer_concurrent_streams_unmixed(endpoint, engine):
    prompts = [f"{i} apples, {i} pears; {i} apples, {i}" for i in range(12)]
    lengths = [8 + (i % 4) * 3 for i in range(12)]
    refs = [greedy(engine, p, n).text for p, n in zip(prompts, lengths)]
    before = finished(endpoint)

    async def one(http, prompt, n):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        text = ""
        async with http.stream("POST", endpoint + "/v1/completions", json=body) as res:
            assert res.status_code == 200
            async for line in res.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, p, n) for p, n in zip(prompts, lengths)))

    assert asyncio.run(main()) == refs  # every stream is its own request's greedy text, none mixed up
    after = finished_when(endpoint, sum(before.values()) + len(prompts))
    assert len(after) == 2  # both replicas report, each under its own label
    served = {r: after[r] - before.get(r, 0) for r in after}
    assert sum(served.values()) == len(prompts)
    assert all(n > 0 for n in served.values()), served  # Ray's router spread them


def test_chat_and_errors_pass_through_the_proxy(endpoint, engine):
    res = httpx.post(endpoint + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "abc abc"}], "max_tokens": 6, "temperature": 0})
    assert res.status_code == 200
    ref = greedy(engine, "<user>abc abc|<assistant>", 6).text
    assert res.json()["choices"][0]["message"]["content"] == ref
    bad = httpx.post(endpoint + "/v1/completions", json={"model": "nope", "prompt": "a"}, timeout=60)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


def test_session_header_sticks_to_one_replica(endpoint):
    time.sleep(3)  # both replicas' earlier requests in the hub (PUSH_S)
    before = finished(endpoint)
    for turn in range(4):
        res = httpx.post(endpoint + "/v1/completions", headers={"X-Session-Id": "conversation-7"}, timeout=60,
                         json={"prompt": f"turn {turn}: abc abc", "max_tokens": 4, "temperature": 0})
        assert res.status_code == 200
    after = finished_when(endpoint, sum(before.values()) + 4)
    served = sorted(after[r] - before.get(r, 0) for r in after)
    assert served == [0, 4]  # all four turns on one replica


def test_metrics_label_every_replica_and_health_is_checked(endpoint):
    text = httpx.get(endpoint + "/metrics", timeout=30).text
    replicas = set(re.findall(r'specdec:replica_info\{replica="([^"]+)"', text))
    assert len(replicas) == 2
    assert text.count("# TYPE specdec:spec_decode_num_accepted_tokens_total counter") == 1  # one family
    drafted = samples(endpoint, "spec_decode_num_draft_tokens_total")
    assert set(drafted) == replicas and sum(drafted.values()) > 0  # the ngram drafter ran on the replicas
    status = serve.status().applications["specdec"].deployments["SpecdecServer"]
    assert status.status == "HEALTHY" and status.replica_states.get("RUNNING") == 2


def test_cli_rejects_bad_replica_bounds_in_one_line(capsys):
    from specdec.cli import main as cli_main

    for argv, expect in ((["--replicas", "2", "--min-replicas", "3"],
                          "need 0 <= --min-replicas (3) <= --replicas (2)"),
                         (["--min-replicas", "1"], "need --replicas N (Ray Serve)"),
                         (["--replicas", "1", "--target-ongoing-requests", "0"],
                          "--target-ongoing-requests must be > 0")):
        assert cli_main(["serve", *argv]) == 2  # before Ray starts or a model loads
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_replica_bounds_become_ray_serve_options():
    from specdec.server.ray_app import build, deployment_options

    settings = ServerSettings(max_batch=8, max_queue=4)
    fixed = deployment_options(3, settings=settings)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 12  # a replica's batch + queue; Ray's router holds the rest
    scaled = deployment_options(2, min_replicas=1, max_replicas=4, target_ongoing_requests=6, settings=settings)
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                            "target_ongoing_requests": 6}
    assert deployment_options(2, min_replicas=0, max_replicas=2, settings=settings)[
        "autoscaling_config"]["target_ongoing_requests"] == 8  # default: a full batch
    with pytest.raises(ValueError):
        deployment_options(2, min_replicas=3, settings=settings)
    sticky = deployment_options(2, session_affinity=True, settings=settings)
    assert sticky["request_router_config"].request_router_class.endswith("ConsistentHashRouter")
    # `serve run specdec.server.ray_app:build name=value ...` parses `specdec serve`'s options.
    app = build({"replicas": "2", "drafter": "suffix", "session-affinity": "true", "max-batch": "4"})
    assert app._bound_deployment._deployment_config.num_replicas == 2
    # Each replica sizes its default context for its part of the free memory (they may share a node).
    assert app._bound_deployment.init_args[0].memory_share == ServerSettings().memory_share / 2
    assert build({"session-affinity": "false"})._bound_deployment._deployment_config.num_replicas == 1
