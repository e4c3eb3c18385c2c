"""GGUF files as float32 Hugging Face folders: dequantized once, tensor by tensor, and cached.

The cache lives under `cache_root` (``$EXACTSPEC_CACHE``, else ``$XDG_CACHE_HOME/exactspec``, else
``~/.cache/exactspec``). Every dtype loads from the same float32 conversion. An entry is written
into a temporary folder and renamed into place, so a crash never leaves a half-written one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from exactspec.models.huggingface import quiet_transformers

logger = logging.getLogger(__name__)

# Bumped whenever the cached conversion's layout or contents change.
CACHE_FORMAT = "v1"


def cache_root() -> Path:
    """Where converted models are cached: $EXACTSPEC_CACHE, else $XDG_CACHE_HOME/exactspec,
    else ~/.cache/exactspec."""
    if os.environ.get("EXACTSPEC_CACHE"):
        return Path(os.environ["EXACTSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "exactspec"


def gguf_cache_key(path: Path) -> str:
    """A cache entry's name for a GGUF file: its stem, and a hash of its path, size and mtime."""
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:64]
    return f"gguf-{slug}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}-{CACHE_FORMAT}"


@contextlib.contextmanager
def gguf_errors(gguf_path: Path):
    """A damaged or foreign file can make the GGUF reader raise almost anything (struct.error,
    KeyError, ValueError, ...): turn it into one ValueError naming the file (the clear-errors
    rule), the reader's own exception chained."""
    try:
        yield
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(f"cannot read the GGUF file {str(gguf_path)!r}: {reason}") from err


_STREAM_BYTES = 64 << 20  # float32 bytes dequantized at a time while converting a GGUF


def convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Dequantize a GGUF file into a float32 Hugging Face folder at `dest` (model + tokenizer).

    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` would do the same, but it
    insists on the `accelerate` package and holds every dequantized tensor at once (the memory
    measured: docs/design.md, "Moved from comments"). Here the model is made with its weights
    uninitialized and filled tensor by tensor, a few rows at a time (`_stream_gguf_weights`), with
    transformers' own GGUF name map and tensor processors; it is saved in shards of at most 1 GB.
    Checked bit-identical to transformers' own loader.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    folder, file = str(gguf_path.parent), gguf_path.name
    with gguf_errors(gguf_path):
        config = AutoConfig.from_pretrained(folder, gguf_file=file, local_files_only=True)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        written = _stream_gguf_weights(gguf_path, model)
    tied = set()
    output = model.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) and output is not None:
        tied = {n for n, p in model.named_parameters(remove_duplicate=False) if p is output.weight}
    missing = set(model.state_dict()) - written - tied
    if missing:
        raise ValueError(f"GGUF file {str(gguf_path)!r} does not match its architecture "
                         f"{config.model_type!r}: missing weights {sorted(missing)[:5]}")
    model.tie_weights()
    with gguf_errors(gguf_path):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    with quiet_transformers(progress=True):
        model.save_pretrained(dest, max_shard_size="1GB")
    tokenizer.save_pretrained(dest)


def _stream_gguf_weights(gguf_path: Path, model) -> set[str]:
    """Fill `model`'s weights from a GGUF file, one tensor at a time; the names written.

    A tensor's quantized rows are read from the file (not through the reader's memory map, whose
    pages would stay resident) and dequantized `_STREAM_BYTES` of float32 at a time, straight
    into the parameter; only a tensor that transformers' processor rewrites as a whole (llama's
    q and k head order) is dequantized whole. Names the model does not have are skipped, as
    transformers' loader skips them.
    """
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    reader = GGUFReader(str(gguf_path))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    if type(processor).process not in (TensorProcessor.process,
                                       TENSOR_PROCESSORS["llama"].process):
        raise ValueError(f"GGUF architecture {architecture!r} is converted by transformers with "
                         f"a tensor processor this loader does not stream")
    names = get_gguf_hf_weights_map(model, processor)
    state = model.state_dict()
    written = set()
    with open(gguf_path, "rb") as f:
        for tensor in reader.tensors:
            name = names.get(tensor.name)
            if name is None or name not in state:
                continue
            dest = state[name]
            whole = type(processor).process is not TensorProcessor.process and \
                (".attn_q." in tensor.name or ".attn_k." in tensor.name)
            for rows, raw in _read_tensor_rows(f, tensor, None if whole else dest):
                weights = dequantize(raw, tensor.tensor_type)  # [rows, ...] float32
                if whole:
                    weights = processor.process(weights=weights, name=tensor.name).weights
                if tuple(weights.shape) != tuple(dest[rows].shape):
                    raise ValueError(f"GGUF tensor {tensor.name!r} has shape {tuple(weights.shape)}, "
                                     f"the model's {name!r} {tuple(dest.shape)}")
                dest[rows].copy_(torch.from_numpy(weights))
            written.add(name)
    return written


def _read_tensor_rows(f, tensor, dest):
    """(rows, raw rows) of a GGUF tensor read from the open file `f`, rows a slice of the first
    dimension: all at once when `dest` is None or the tensor has one dimension, else enough rows
    for `_STREAM_BYTES` of float32 in `dest`."""
    import numpy as np

    data = tensor.data  # a memory map: only its shape and dtype are read here
    if data.ndim < 2:
        f.seek(tensor.data_offset)
        yield slice(None), np.fromfile(f, dtype=data.dtype, count=data.size).reshape(data.shape)
        return
    rows, row_items = data.shape[0], data.size // data.shape[0]
    step = rows if dest is None else max(1, _STREAM_BYTES // (4 * dest[0].numel()))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        f.seek(tensor.data_offset + start * row_items * data.itemsize)
        raw = np.fromfile(f, dtype=data.dtype, count=(stop - start) * row_items)
        yield slice(start, stop), raw.reshape(stop - start, *data.shape[1:])


def cached_conversion(gguf_path: Path, key: str, meta: dict) -> Path:
    """The cache folder holding the float32 conversion of `gguf_path`, converting it if needed.

    The conversion is written into a temporary sibling folder, then renamed into place: the
    rename is the commit, so a folder named `key` is always complete.
    """
    root = cache_root() / "models"
    final = root / key
    if (final / "config.json").is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
    except OSError as err:
        raise OSError(f"cannot write the model cache at {str(root)!r} ({err.strerror or err}); "
                      f"set EXACTSPEC_CACHE to a writable folder") from err
    try:
        logger.info("converting %s into %s (once; later loads use the cache)", gguf_path, final)
        convert_gguf(gguf_path, tmp)
        (tmp / "exactspec-cache.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            # Another process finished the same conversion first; keep its copy.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def gguf_meta(gguf_path: Path, **extra) -> dict:
    """What a cache entry records of its source (written beside it as exactspec-cache.json)."""
    import transformers

    return {"source": str(gguf_path), "size": gguf_path.stat().st_size,
            "transformers": transformers.__version__, "format": CACHE_FORMAT, **extra}


def gguf_tokenizer(gguf_path: Path):
    """The tokenizer written in a GGUF file, converted by transformers once and cached under
    cache_root()/tokenizers, committed by a rename."""
    from transformers import AutoTokenizer

    root = cache_root() / "tokenizers"
    final = root / gguf_cache_key(gguf_path)
    if not (final / "tokenizer_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            with gguf_errors(gguf_path):
                tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                          local_files_only=True)
            tokenizer.save_pretrained(tmp)
            with contextlib.suppress(OSError):  # another process may have written it first
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(final), local_files_only=True)
