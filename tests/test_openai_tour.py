"""scripts/openai_tour.py — every request field, with the official `openai` client — against
`exactspec serve` on the bundled SmolLM2 run as a command: every case comes back as it should."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.slow
def test_the_tour_on_the_bundled_model(capsys):
    from exactspec.models import BundledModelMissing
    from exactspec.models.loading import bundled_gguf_path

    try:
        bundled_gguf_path()
    except BundledModelMissing as err:
        pytest.skip(str(err))
    sys.path.insert(0, str(SCRIPTS))
    import openai_tour

    command = [sys.executable, "-m", "exactspec", "serve", "--target", "smollm2-135m-instruct",
               "--port", "0", "--model-name", "smollm2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        found = re.search(r"http://\S+:\d+", line)
        assert found, f"the server did not start: {line!r} (exit status {proc.poll()})"
        deadline = time.monotonic() + 300
        while httpx.get(found.group(0) + "/health").status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        status = openai_tour.main(["--base-url", found.group(0) + "/v1"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    done = re.search(r"(\d+)/\1 cases ok", out.err)  # every case, and the tour's 26 at least
    assert done and int(done.group(1)) >= 26, out.err
