"""An offloaded target: accelerate places what fits in `max_memory` and offloads the rest (to
disk here: the CPU is the only device), loading each layer's weights as it runs. The engine
sends inputs to the device map's first device and takes the logits back there, so greedy output
is token-identical to the model held whole."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama, make_tiny_tokenizer

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 4]]


@pytest.fixture
def saved(tmp_path):
    """The tiny target's folder (2 layers), saved with its tokenizer."""
    pytest.importorskip("accelerate", reason="device_map needs the accelerate package")
    make_tiny_llama(0, num_layers=2).save_pretrained(tmp_path / "target")
    make_tiny_tokenizer().save_pretrained(tmp_path / "target")
    return tmp_path / "target"


def test_offloaded_target_decodes_like_the_whole_model(saved, tmp_path):
    """max_memory of 60 kB holds the embeddings (4 kB) but not the layers (~36 kB each): they
    and the output layer go to disk. Greedy plain and speculative output equal the whole
    model's greedy decoding token for token."""
    from exactspec import autoregressive_generate, load_model, speculative_generate
    from exactspec.engine import pad_prompts

    offload = tmp_path / "offload"
    target = load_model(saved, device_map="auto", max_memory={"cpu": 60_000},
                        offload_folder=offload)
    placed = set(target.model.hf_device_map.values())
    assert "disk" in placed, target.model.hf_device_map
    assert any(p.device.type == "meta" for p in target.model.parameters())  # really offloaded
    assert target.device == torch.device("cpu")
    whole = load_model(saved)  # also the draft: its greedy drafts are all kept
    ids, mask = pad_prompts([torch.tensor(p) for p in PROMPTS])
    greedy = dict(attention_mask=mask, max_new_tokens=12, temperature=0)
    expected = [s.tolist() for s in autoregressive_generate(whole, ids, **greedy).sequences]
    assert [s.tolist() for s in autoregressive_generate(target, ids, **greedy).sequences] == expected
    out = speculative_generate(target, whole, ids, gamma=3, **greedy)
    assert [s.tolist() for s in out.sequences] == expected
    assert out.stats.accepted_drafts > 0  # the offloaded target scored blocks of γ + 1


def test_offload_folder_defaults_to_a_temporary_one_removed_with_the_model(saved):
    import gc

    from exactspec import load_model

    target = load_model(saved, device_map="auto", max_memory={"cpu": 60_000})
    folder = _offload_folder_of(target.model)
    assert folder is not None and folder.name.startswith("exactspec-offload-") and folder.is_dir()
    del target
    gc.collect()
    assert not folder.exists()


def _offload_folder_of(model):
    """The folder accelerate reads the offloaded weights from (its index file's folder)."""
    from pathlib import Path

    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        weights = getattr(hook, "weights_map", None)
        dataset = getattr(weights, "dataset", None)
        folder = getattr(dataset, "save_folder", None)
        if folder:
            return Path(folder)
    return None


def test_placement_arguments_are_checked(saved):
    from exactspec import load_model

    with pytest.raises(ValueError, match="max_memory and offload_folder need a device_map"):
        load_model(saved, max_memory={"cpu": 60_000})
    with pytest.raises(ValueError, match="device='cpu' cannot be given with device_map='auto'"):
        load_model(saved, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="device_map must be 'auto', .* or a dict, got 'everywhere'"):
        load_model(saved, device_map="everywhere")
