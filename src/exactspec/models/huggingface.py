"""Hugging Face models through Transformers: a folder or a hub id loaded with its tokenizer, the
weights on one device, in tensor-parallel shards (`tp`) or over devices by accelerate's device
map; and Transformers' own progress bars and warnings off where they would only be noise.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@contextlib.contextmanager
def quiet_transformers(*, progress: bool = False, warnings: bool = False):
    """Transformers' per-weight progress bars (`progress`) and its warnings (`warnings`: only
    errors are logged) off inside the block, each restored to what it was afterwards."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if warnings:
        hf_logging.set_verbosity_error()
    if progress:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if progress and bars:
            hf_logging.enable_progress_bar()
        if warnings:
            hf_logging.set_verbosity(level)


def has_tokenizer(folder: Path) -> bool:
    """Whether a model folder holds tokenizer files."""
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def load_hf(source: str, torch_dtype: torch.dtype, *, local_only: bool, tokenizer: bool = True,
            placement: dict | None = None):
    """Model and tokenizer from a folder or hub id; `placement` adds `from_pretrained` arguments
    that place the weights (`placement_arguments`: tensor-parallel shards, or an accelerate
    device map)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = dict(placement or {})
    if "distributed_config" in placement:  # built here: it reads the model's config
        from exactspec.distributed import tp_arguments

        placement = tp_arguments(source, local_only)
    temporary = None
    if "device_map" in placement and placement["offload_folder"] is None:
        temporary = placement["offload_folder"] = tempfile.mkdtemp(prefix="exactspec-offload-")
    try:
        with quiet_transformers(progress=True):
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


def placement_arguments(device, tp: bool, device_map, max_memory, offload_folder) -> dict:
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
