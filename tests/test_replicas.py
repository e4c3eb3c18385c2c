"""`exactspec serve --replicas 2`: two Ray Serve replicas of the server behind one endpoint, on a
local Ray instance with 2 CPUs and no dashboard, driven by the `openai` client on loopback."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import make_tiny_llama, make_tiny_tokenizer



@pytest.fixture
def server(tmp_path):
    """The command running with 2 replicas of the tiny target: (process, URL)."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the 'ray' extra: "
                                            "pip install 'exactspec[ray]')")
    pytest.importorskip("openai", reason="the openai client is not installed")
    make_tiny_llama(0, num_layers=2).save_pretrained(tmp_path / "target")
    make_tiny_tokenizer().save_pretrained(tmp_path / "target")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "exactspec", "serve", "--replicas", "2", "--port", "0",
               "--target", str(tmp_path / "target"), "--draft", "ngram", "--model-name", "tiny"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=env, start_new_session=True)
    try:
        line = process.stdout.readline()  # printed once every replica has loaded its models
        match = re.search(r"listening on (http://\S+)", line)
        assert match, f"the server did not start: {line!r} (exit status {process.poll()})"
        yield process, match.group(1)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # only if the test failed before stopping it


def _wait_healthy(url: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url}/health never answered 200")


def test_two_replicas_answer_concurrent_requests_and_stop_cleanly(server):
    """Concurrent greedy requests reach both replicas (the x-exactspec-replica header names
    each), every replica gives the same greedy text, and SIGTERM stops Ray and the replicas."""
    import openai
    import psutil  # installed with Ray

    process, url = server
    _wait_healthy(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

    def ask(_):
        raw = client.completions.with_raw_response.create(model="tiny", prompt="w1 w2 w3",
                                                          max_tokens=6, temperature=0)
        return raw.headers["x-exactspec-replica"], raw.parse().choices[0].text

    replicas, texts = set(), set()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(5):  # the router spreads load at random: a few waves see both replicas
            for replica, text in pool.map(ask, range(8)):
                replicas.add(replica)
                texts.add(text)
            if len(replicas) == 2:
                break
    assert len(replicas) == 2, replicas
    assert len(texts) == 1  # greedy: one answer, whichever replica decoded it

    children = psutil.Process(process.pid).children(recursive=True)  # Ray's processes
    assert children
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) in (0, 143)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.name() for p in alive]


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "2", "--tp"], "--replicas 2 and --tp cannot be combined"),
    (["--replicas", "0"], "--replicas must be a positive integer, got 0"),
])
def test_bad_replica_options_are_refused(argv, message, capsys):
    from exactspec.cli.main import main

    assert main(["serve", "--target", "nowhere", *argv]) == 2
    assert message in capsys.readouterr().err
