"""The bad-input table (docs/reliability.md): one row per case, run through the CLI and through
the Python API.

CLI: a non-zero exit (2, or 130 for Ctrl-C), one line on stderr naming the option and the value
(progress lines such as "loaded ..." may come before it), no traceback, nothing printed to
stdout, and no file left behind (the folder the case writes into, and the model cache, are as
they were). API: a ValueError naming the parameter. Models are tiny folders, so every row runs in
well under a second.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import exactspec as es
from conftest import make_tiny_llama, make_tiny_tokenizer
from exactspec.cli import main
from exactspec.drafters import TLIDrafter
from exactspec.models import LoadedModel, load_model

pytestmark = pytest.mark.usefixtures("one_thread")

RELIABILITY = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


# --------------------------------------------------------------------------- fixtures


@dataclass
class Env:
    """Paths the table's rows use, and the tiny models as Python objects."""

    root: Path  # files the cases read; nothing may be added to it
    target: str  # a tiny model folder
    draft: str  # a compatible draft folder
    other: str  # a draft folder whose vocabulary differs ("v0" where the target has "w0")
    nan: str  # a target folder whose output layer has a NaN row
    bad_gguf: str  # starts with the GGUF magic, then garbage
    pair: tuple  # (target, draft) LoadedModel

    def fill(self, argv: list[str]) -> list[str]:
        return [arg.format(**vars(self)) for arg in argv]


def _save(folder: Path, seed: int, layers: int, prefix: str = "w", nan: bool = False) -> str:
    model = make_tiny_llama(seed, num_layers=layers)
    if nan:
        model.lm_head.weight.data[5] = math.nan  # NaN logits at every position
    model.save_pretrained(folder)
    make_tiny_tokenizer(prefix=prefix).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    root = tmp_path_factory.mktemp("bad-input")
    folders = {name: _save(root / name, seed, layers, prefix, nan) for name, seed, layers, prefix, nan
               in (("target", 0, 2, "w", False), ("draft", 1, 1, "w", False),
                   ("other", 1, 1, "v", False), ("nan", 0, 2, "w", True))}
    (root / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00garbage" * 50)
    (root / "not-json.jsonl").write_text("not json\n")
    (root / "no-prompt.jsonl").write_text('{"text": "w1"}\n')
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (root / "a-file").write_text("")
    tokenizer, cpu = make_tiny_tokenizer(), torch.device("cpu")
    pair = (LoadedModel(make_tiny_llama(0), tokenizer, "tiny-target", torch.float32, cpu),
            LoadedModel(make_tiny_llama(1, num_layers=1), tokenizer, "tiny-draft", torch.float32, cpu))
    return Env(root, folders["target"], folders["draft"], folders["other"], folders["nan"],
               str(root / "bad.gguf"), pair)


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    """A fresh model cache: a failed GGUF conversion must leave nothing in it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("EXACTSPEC_CACHE", str(cache))
    return cache


# --------------------------------------------------------------------------- the API side


def api_generate(env: Env, **overrides) -> None:
    """speculative_generate on the tiny pair with one argument overridden."""
    target, draft = env.pair
    args = dict(draft=draft, input_ids=torch.tensor([[1, 5, 9]]), gamma=4, max_new_tokens=4,
                seed=0) | overrides
    es.speculative_generate(target, args.pop("draft"), args.pop("input_ids"), **args)


def api_other_vocab(env: Env) -> None:
    other = LoadedModel(make_tiny_llama(1, num_layers=1), make_tiny_tokenizer(prefix="v"), "other",
                        torch.float32, torch.device("cpu"))
    api_generate(env, draft=TLIDrafter(other))  # string-level drafts, the default, serve any pair


def api_nan_logits(env: Env) -> None:
    target = make_tiny_llama(0)
    target.lm_head.weight.data[5] = math.nan
    es.autoregressive_generate(target, torch.tensor([[1, 5, 9]]), max_new_tokens=4)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    """One row: the CLI argv (with {target}, {draft}, {root}, ... from Env) and the regex its
    error line must match; the API call and the regex its ValueError must match (None: no API
    counterpart, the input exists only on the command line)."""

    name: str
    argv: list[str]
    cli_message: str
    api: Callable[[Env], None] | None = None
    api_message: str | None = None


GEN = ["generate", "w1 w2", "--target", "{target}", "--no-chat", "--max-new-tokens", "4"]
WITH_DRAFT = GEN + ["--draft", "{draft}"]
PLAIN = GEN + ["--draft", "none"]

CASES = [
    Case("gamma below range", WITH_DRAFT + ["--gamma", "0"], r"--gamma must be in \[1, 32\], got 0",
         lambda e: api_generate(e, gamma=0), r"gamma must be an integer in \[1, 32\].*, got 0"),
    Case("gamma above range", WITH_DRAFT + ["--gamma", "33"], r"--gamma must be in \[1, 32\], got 33",
         lambda e: api_generate(e, gamma=33), r"gamma must be an integer in \[1, 32\].*, got 33"),
    Case("negative temperature", WITH_DRAFT + ["--temperature", "-0.5"],
         r"--temperature must be >= 0, got -0.5",
         lambda e: api_generate(e, temperature=-0.5), r"temperature must be a finite number >= 0, got -0.5"),
    Case("NaN temperature", WITH_DRAFT + ["--temperature", "nan"],
         r"--temperature must be a finite number, got nan",
         lambda e: api_generate(e, temperature=math.nan), r"temperature must be a finite number >= 0, got nan"),
    Case("top-k 0", WITH_DRAFT + ["--top-k", "0"], r"--top-k must be >= 1, got 0",
         lambda e: api_generate(e, top_k=0), r"top_k must be an integer >= 1 or None, got 0"),
    Case("top-p above 1", WITH_DRAFT + ["--top-p", "1.5"], r"--top-p must be in \(0, 1\], got 1.5",
         lambda e: api_generate(e, top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    Case("top-p 0", WITH_DRAFT + ["--top-p", "0"], r"--top-p must be in \(0, 1\], got 0",
         lambda e: api_generate(e, top_p=0.0), r"top_p must be in \(0, 1\], got 0"),
    Case("empty prompt", ["generate", "   "] + GEN[2:] + ["--draft", "{draft}"], r"the prompt is empty",
         lambda e: api_generate(e, input_ids=torch.zeros(1, 0, dtype=torch.long)),
         r"the prompt is empty: input_ids has shape \(1, 0\)"),
    Case("prompt + budget past the context", WITH_DRAFT + ["--max-new-tokens", "500"],
         r"prompt \+ max_new_tokens = \d+ tokens exceeds the context window of .* \(128 tokens\)",
         lambda e: api_generate(e, max_new_tokens=500),
         r"prompt \+ max_new_tokens = 503 tokens exceeds the context window of .* \(128 tokens\)"),
    Case("draft of another vocabulary through the intersection", GEN + ["--draft", "tli:{other}"],
         r"--draft: target .* different vocabularies .*token id 3 is 'w0' in the target .*vocabulary but 'v0'",
         api_other_vocab, r"different vocabularies .*token id 3 is 'w0' .* but 'v0'"),
    Case("missing model path", GEN[:2] + ["--target", "{root}/no-such-model", "--draft", "none"],
         r"--target: unknown model '.*no-such-model': .*no such file or folder",
         lambda e: load_model(f"{e.root}/no-such-model"), r"unknown model '.*no-such-model'"),
    Case("missing draft path", GEN + ["--draft", "{root}/no-such-draft"],
         r"--draft: unknown model '.*no-such-draft': .*no such file or folder",
         lambda e: api_generate(e, draft=f"{e.root}/no-such-draft"), r"unknown model '.*no-such-draft'"),
    Case("corrupt GGUF file", GEN[:2] + ["--target", "{bad_gguf}", "--draft", "none"],
         r"--target: cannot read the GGUF file '.*bad\.gguf': ",
         lambda e: load_model(e.bad_gguf), r"cannot read the GGUF file '.*bad\.gguf': "),
    Case("--prompts file missing", PLAIN[:1] + PLAIN[2:] + ["--prompts", "{root}/missing.jsonl"],
         r"--prompts .*missing\.jsonl: cannot read the file: No such file or directory"),
    Case("--prompts is a folder", PLAIN[:1] + PLAIN[2:] + ["--prompts", "{root}"],
         r"--prompts .*: cannot read the file: Is a directory"),
    Case("--prompts not UTF-8", PLAIN[:1] + PLAIN[2:] + ["--prompts", "{root}/latin1.jsonl"],
         r"--prompts .*latin1\.jsonl: cannot read the file: 'utf-8' codec can't decode"),
    Case("--prompts line not JSON", PLAIN[:1] + PLAIN[2:] + ["--prompts", "{root}/not-json.jsonl"],
         r"--prompts .*not-json\.jsonl line 1: not valid JSON"),
    Case("--prompts line without a prompt", PLAIN[:1] + PLAIN[2:] + ["--prompts", "{root}/no-prompt.jsonl"],
         r'--prompts .*no-prompt\.jsonl line 1: expected an object with a non-empty "prompt" string'),
    Case("--json into a missing folder",
         ["bench", "--target", "{target}", "--draft", "ngram", "--json", "{root}/no-dir/out.json"],
         r"--json: the folder '.*no-dir' does not exist"),
    Case("--json under a file", ["bench", "--target", "{target}", "--draft", "ngram", "--json",
                                 "{root}/a-file/out.json"],
         r"--json: '.*a-file' is not a folder"),
    Case("--out under a file", ["figures", "--out", "{root}/a-file/figures"],
         r"--out: cannot write figures to .*a-file/figures"),
    Case("NaN logits from a model", GEN[:2] + ["--target", "{nan}", "--no-chat", "--max-new-tokens",
                                                "4", "--draft", "none"],
         r"model '.*nan' produced NaN or \+inf logits at position \d+",
         api_nan_logits, r"model .* produced NaN or \+inf logits at position 2"),
]
CASE_IDS = [case.name for case in CASES]


# --------------------------------------------------------------------------- running a row


def snapshot(*folders: Path) -> set[str]:
    """Every file under the folders (a file left behind shows up as a new entry; an empty cache
    folder created on the way does not count)."""
    return {str(p) for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file()}


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def check_one_line(err: str, command: str, pattern: str) -> None:
    """No traceback; the last stderr line is the one error line, and it matches."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith(f"exactspec {command}:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cli_bad_input_is_one_line(case, env, model_cache, capsys):
    before = snapshot(env.root, model_cache)
    code, out, err = run_cli(capsys, env.fill(case.argv))
    assert code == 2 and out == ""
    check_one_line(err, case.argv[0], case.cli_message)
    assert snapshot(env.root, model_cache) == before  # nothing half-written left behind


API_CASES = [case for case in CASES if case.api is not None]


@pytest.mark.parametrize("case", API_CASES, ids=[case.name for case in API_CASES])
def test_api_bad_input_raises_value_error(case, env, model_cache):
    before = snapshot(env.root, model_cache)
    with pytest.raises(ValueError, match=case.api_message):
        case.api(env)
    assert snapshot(env.root, model_cache) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root can write anywhere")
def test_cli_read_only_output_folder(env, tmp_path, capsys):
    """A folder without write permission: refused by name before any model loads."""
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    code, out, err = run_cli(capsys, env.fill(["bench", "--target", "{target}", "--draft", "ngram",
                                               "--json", str(folder / "out.json")]))
    assert code == 2 and out == "" and not any(folder.iterdir())
    check_one_line(err, "bench", r"--json: the folder '.*read-only' is not writable")


# --------------------------------------------------------------------------- Ctrl-C


def test_cli_ctrl_c_mid_generation(env, capsys, monkeypatch):
    """A KeyboardInterrupt while tokens stream (here raised by the stream printer after the first
    round): exit 130, one line, no traceback."""
    from exactspec.cli import generate

    rounds = []

    def interrupt(self, row, new_ids):
        rounds.append(new_ids)
        if len(rounds) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(generate.TextStream, "__call__", interrupt)
    # ≥ 7 rounds; seeded, so the tiny model cannot end the text early by drawing its EOS
    argv = WITH_DRAFT + ["--gamma", "2", "--max-new-tokens", "20", "--stream", "--seed", "0"]
    code, _, err = run_cli(capsys, env.fill(argv))
    assert code == 130 and len(rounds) == 2
    check_one_line(err, "generate", r"^exactspec generate: interrupted$")


def test_api_ctrl_c_propagates_and_leaves_no_state(env):
    """on_tokens raising KeyboardInterrupt stops the generation with that very exception; the
    same call afterwards gives the output of an uninterrupted run (no state leaks)."""
    target, draft = env.pair
    ids = torch.tensor([[1, 5, 9]])
    settings = dict(gamma=3, max_new_tokens=12, seed=4, eos_token_id=[])

    def interrupt(row, new_ids):
        raise KeyboardInterrupt

    before = es.speculative_generate(target, draft, ids, **settings).sequences
    with pytest.raises(KeyboardInterrupt):
        es.speculative_generate(target, draft, ids, on_tokens=interrupt, **settings)
    after = es.speculative_generate(target, draft, ids, **settings).sequences
    assert torch.equal(before, after)


# --------------------------------------------------------------------------- the table


def test_reliability_table_lists_every_case():
    """The table lives in docs/reliability.md: every row of CASES (and Ctrl-C) is named there."""
    text = RELIABILITY.read_text(encoding="utf-8")
    for name in CASE_IDS + ["Ctrl-C mid-generation"]:
        assert f"| {name} |" in text, f"docs/reliability.md's table lacks the row {name!r}"
