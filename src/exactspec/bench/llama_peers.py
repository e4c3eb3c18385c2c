"""llama.cpp as a benchmark peer, on the target's own GGUF file and the same prompt token ids:

- ``llamacpp``: plain decoding through llama-cpp-python (``Llama.generate``), the KV cache reset
  before each generation (no prompt cache);
- ``llama_server``: llama.cpp's own server, ``llama-server`` (``make peers`` builds it from the
  llama.cpp sources vendored in the pinned llama-cpp-python sdist), started on 127.0.0.1 once
  per configuration and stopped at the end; each prompt goes to ``/completion`` with
  ``cache_prompt: false`` and ``ignore_eos``, streamed, and its ``timings`` are read. Its
  speculation (``--spec-type``) drafts greedily and accepts while the target's sample equals the
  draft (`common_sampler_sample_and_accept_n`): exact at every temperature.

llama-server's ``ngram-mod`` keeps one n-gram table for the server's whole life (made once in
`server-context.cpp`, shared by every slot and request, filled from each prompt and each reply),
so a request drafts from the replies to earlier ones: in a benchmark that sends the same prompt
at T = 0 and T = 0.8, and again in each pass, it replays text it has seen (HumanEval's first 10
problems at T = 0: 38.4 tok/s on a server that had seen none of them, 59.0 on one that had, plain
29.0; `scripts/ngram_mod_memory.py`). exactspec's lookup sees only the row's own prompt and reply,
so a configuration with that memory (`remembers`) gets a fresh server for every request: what it
measures is a prompt seen for the first time. Starting one is not timed; a one-token request on a
prompt shorter than ngram-mod's match length (which adds nothing to the table) warms it first.

A server configuration is a `RunSpec` with method "llama_server": draft None (plain), a
llama.cpp draft spec ("llamacpp:NAME_OR_PATH", ``--spec-type draft-simple`` with
``--spec-draft-n-max γ``), an n-gram type ("ngram-mod", "ngram-simple", "ngram-cache":
``--spec-type TYPE``, llama.cpp's own lengths), or
"llamacpp:...+ngram-mod" (both types). Sampling is plain temperature sampling in every peer
(top-k 0, top-p 1, min-p 0, no penalties) unless the bench sets top-k / top-p; threads are the
bench's torch threads, for the target and the draft alike.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from exactspec.processes import LoggedProcess

NGRAM_MOD = "ngram-mod"
NGRAM_TYPES = (NGRAM_MOD, "ngram-simple", "ngram-cache")  # llama-server's own n-gram drafts
SERVER_ENV = "EXACTSPEC_LLAMA_SERVER"
SERVER_HINT = ("llama.cpp's llama-server is not built: run `make peers` (about 10 min on 2 cores), "
               f"or set {SERVER_ENV} to its path; the bench runs the other methods without it")
SERVER_CONTEXT = 4096
# speculation types whose state may outlive a request (module docstring; ngram-cache keeps a
# dynamic cache, ngram-simple is given the same fresh server so that every n-gram row is alike)
MEMORY_TYPES = NGRAM_TYPES
WARM_PROMPT_TOKENS = 8  # a fresh server's warm-up prompt: under ngram-mod's match length (24)
_START_TIMEOUT = 600.0  # seconds for a server to load its models


def find_llama_server() -> Path | None:
    """$EXACTSPEC_LLAMA_SERVER, else llama-server beside this Python (`make peers` puts it in
    the virtual environment's bin), else on PATH; None when there is none."""
    named = os.environ.get(SERVER_ENV)
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"{SERVER_ENV}={named!r} is not an executable file")
        return path
    beside = Path(sys.executable).parent / "llama-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("llama-server")
    return Path(found) if found else None


def server_arguments(draft: str | None, gamma: int | None, draft_gguf: Path | None) -> list[str]:
    """The speculation arguments of one server configuration (see the module docstring)."""
    if draft is None:
        return []
    types, args = [], []
    for part in draft.split("+"):
        if part in NGRAM_TYPES:
            types.append(part)
        else:
            types.append("draft-simple")
            args += ["-md", str(draft_gguf), "--spec-draft-n-max", str(gamma)]
    return ["--spec-type", ",".join(types), *args]


def remembers(draft: str | None) -> bool:
    """Whether a server configuration drafts from what earlier requests saw (`MEMORY_TYPES`)."""
    return any(part in MEMORY_TYPES for part in (draft or "").split("+"))


def sampling_fields(temperature: float, top_k: int | None, top_p: float | None) -> dict:
    """The sampling of a /completion request: plain temperature sampling (greedy at T = 0)."""
    return {"temperature": temperature, "top_k": top_k or 0, "top_p": 1.0 if top_p is None else top_p,
            "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One running llama-server (its stderr kept in a temporary log, named in any error)."""

    def __init__(self, binary: Path, target_gguf: Path, threads: int, extra: list[str]):
        self.port = _free_port()
        command = [str(binary), "-m", str(target_gguf), "--host", "127.0.0.1",
                   "--port", str(self.port), "-c", str(SERVER_CONTEXT), "-np", "1",
                   "-t", str(threads), "-tb", str(threads), "--no-webui", *extra]
        if "-md" in extra:
            command += ["-td", str(threads), "-tbd", str(threads)]
        self.process = LoggedProcess(command, "exactspec-llama-server-")
        self._wait_ready()

    def _error(self, what: str) -> RuntimeError:
        return RuntimeError(f"llama-server {what} (log {self.process.log.name}: {self.process.tail()})")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.proc.poll() is not None:
                raise self._error(f"exited with status {self.process.proc.returncode} while starting")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            time.sleep(0.5)
        error = self._error(f"was not ready after {_START_TIMEOUT:.0f} s")  # before the log goes
        self.stop()
        raise error

    def complete(self, prompt: list[int], max_new_tokens: int, seed: int, sampling: dict,
                 schema: dict | None = None, eos: bool = False, cache_prompt: bool = False):
        """(tokens, wall seconds, seconds to the first token, timings) of one streamed request;
        with a JSON `schema`, constrained to it and ending at EOS (its own grammar,
        `json_schema`); eos: ending at EOS without one. cache_prompt: the server resumes its
        slot's KV cache where the prompt begins as the previous request's did."""
        constrained = ({"json_schema": schema} if schema is not None else {} if eos
                       else {"ignore_eos": True})
        body = json.dumps({"prompt": prompt, "n_predict": max_new_tokens, "cache_prompt": cache_prompt,
                           "stream": True, "return_tokens": True, "seed": seed, **constrained,
                           **sampling})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise self._error(f"answered {response.status}: {response.read()[:200]!r}")
        tokens, first, timings = [], None, {}
        for line in response:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[len(b"data: "):])
            if chunk.get("tokens") and first is None:
                first = time.perf_counter() - start
            tokens += chunk.get("tokens") or []
            if chunk.get("stop"):
                timings = chunk.get("timings", {})
                break
        return tokens, time.perf_counter() - start, first, timings

    def warm(self, prompt: list[int]) -> None:
        """One greedy token after the first WARM_PROMPT_TOKENS of prompt: a prompt shorter than
        ngram-mod's match length, so a server that remembers requests learns nothing from it."""
        self.complete(prompt[:WARM_PROMPT_TOKENS], 1, 0, sampling_fields(0.0, None, None))

    def stop(self) -> None:
        self.process.stop()


class LlamaPeers:
    """The llama.cpp peers of one benchmark: llama-cpp-python on the target's GGUF (loaded on
    first use) and one llama-server per configuration (started on first use); `close` stops
    them. target_gguf: the target's GGUF file; draft_ggufs: a llama.cpp draft spec → its file."""

    def __init__(self, target_gguf: Path, draft_ggufs: dict[str, Path], threads: int,
                 top_k: int | None, top_p: float | None, server: Path | None):
        self.target_gguf, self.draft_ggufs, self.threads = target_gguf, draft_ggufs, threads
        self.top_k, self.top_p, self.server = top_k, top_p, server
        self.llama = None
        self.servers: dict[tuple, LlamaServer] = {}

    def run(self, spec, input_ids, seed: int, max_new_tokens: int, constraint=None):
        """One generation of `spec`; a `constraint` (a JSON schema or object) is followed by
        llama.cpp's own grammar from the same schema, and the generation ends at EOS."""
        from exactspec.bench.results import RunResult

        prompt = input_ids[0].tolist()
        sampling = sampling_fields(spec.temperature, self.top_k, self.top_p)
        schema = None if constraint is None else constraint.schema()
        if constraint is not None and schema is None:
            raise ValueError(f"llama.cpp's rows follow JSON schemas only, got a {constraint.kind} "
                             f"constraint")
        if spec.method == "llamacpp":
            tokens, wall, first = self.plain(prompt, max_new_tokens, seed, sampling, schema)
            return RunResult(tokens, wall, first, first_tokens=1)
        server = self._server(spec, prompt)
        tokens, wall, first, timings = server.complete(prompt, max_new_tokens, seed, sampling, schema)
        if remembers(spec.draft):  # the next request meets a server that has seen nothing
            self.servers.pop((spec.draft, spec.gamma)).stop()
        stats = {"drafted_tokens": timings.get("draft_n", 0),
                 "accepted_drafts": timings.get("draft_n_accepted", 0),
                 "decode_seconds": timings.get("predicted_ms", 0) / 1e3,
                 "prefill_seconds": timings.get("prompt_ms", 0) / 1e3}
        return RunResult(tokens, wall, first, first_tokens=1, peer_stats=stats)

    def plain(self, prompt: list[int], max_new_tokens: int, seed: int, sampling: dict,
              schema: dict | None = None, stop=(), prompt_cache: bool = False) -> tuple[list[int], float, float | None]:
        """(tokens, wall seconds, seconds to the first token) of llama-cpp-python's plain
        decoding (`sampling_fields`); with a `schema`, under its grammar
        (`LlamaGrammar.from_json_schema`, made before the clock starts) and until EOS. It also
        ends after a token in `stop`. prompt_cache: the KV cache is kept, and llama-cpp-python
        evaluates only what follows the prefix the prompt shares with the previous generation."""
        from exactspec.drafters.llamacpp import import_llama_cpp

        llama_cpp = import_llama_cpp()
        if self.llama is None:
            # flash attention as llama.cpp's default ("auto") sets it for exactspec's contexts
            # and llama-server's on this CPU; llama-cpp-python's own default is off, whose other
            # sums break near-ties elsewhere: the greedy texts differ
            self.llama = llama_cpp.Llama(
                str(self.target_gguf), n_ctx=SERVER_CONTEXT, n_threads=self.threads,
                n_threads_batch=self.threads, flash_attn=True, verbose=False)
        grammar = None if schema is None else llama_cpp.LlamaGrammar.from_json_schema(
            json.dumps(schema), verbose=False)
        if not prompt_cache:
            self.llama.reset()  # every generation evaluates its whole prompt
        self.llama.set_seed(seed)
        tokens, first = [], None
        start = time.perf_counter()
        for token in self.llama.generate(prompt, top_k=sampling["top_k"], top_p=sampling["top_p"],
                                         min_p=0.0, temp=sampling["temperature"], repeat_penalty=1.0,
                                         grammar=grammar):
            if first is None:
                first = time.perf_counter() - start
            tokens.append(token)
            ended = token in stop or (grammar is not None and
                                      llama_cpp.llama_vocab_is_eog(self.llama._model.vocab, token))
            if len(tokens) == max_new_tokens or ended:
                break
        return tokens, time.perf_counter() - start, first

    def _server(self, spec, prompt: list[int]) -> LlamaServer:
        key = (spec.draft, spec.gamma)
        if key not in self.servers:
            if self.server is None:
                raise RuntimeError(SERVER_HINT)
            model_draft = next((self.draft_ggufs[d] for d in (spec.draft or "").split("+")
                                if d in self.draft_ggufs), None)
            server = LlamaServer(self.server, self.target_gguf, self.threads,
                                 server_arguments(spec.draft, spec.gamma, model_draft))
            self.servers[key] = server
            if remembers(spec.draft):
                server.warm(prompt)
        return self.servers[key]

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
        self.llama = None
