"""Does Transformers' assisted generation for two vocabularies keep the target's law when it samples?

The pair is `tests/test_cross_vocab.py`'s (two tiny BPE tokenizers sharing 8 of 14 tokens, tiny
random models; the draft's embeddings padded by 2 rows, since Transformers tells the tokenizers
apart by the models' vocabulary sizes). Each of N calls of `generate(do_sample=True,
temperature=1, top_k=0, assistant_model=, tokenizer=, assistant_tokenizer=)` (Transformers runs its
`UniversalSpeculativeDecodingGenerator`) starts from a fresh copy of the draft and an empty
translator cache, and the first 2 new tokens are counted against the target's exact joint law
(chi-square); `plain` runs the same harness without the assistant as the control.

    python scripts/hf_usd_exactness.py 20000 assisted plain
"""
from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import chi_square_pvalue, make_tiny_llama  # noqa: E402
from test_cross_vocab import D_TOK, PROMPT, T_TOK, VD, VT, loaded_pair  # noqa: E402

from exactspec.sampling import SamplingConfig  # noqa: E402


def target_joint(target) -> dict:
    sampling = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        first = sampling.probs(target.model(torch.tensor([PROMPT])).logits[:, -1].double())[0]  # [V]
        after = torch.tensor([PROMPT + [y] for y in range(VT)])  # [V, L+1]
        second = sampling.probs(target.model(after).logits[:, -1].double())  # [V, V]
    return {(x, y): first[x].item() * second[x, y].item() for x, y in itertools.product(range(VT), repeat=2)}


def counts(target, draft, n: int, assisted: bool) -> dict:
    from transformers.generation.candidate_generator import AssistantVocabTranslatorCache

    seen = {}
    for seed in range(n):
        torch.manual_seed(seed)
        settings = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=2, min_new_tokens=2,
                        pad_token_id=T_TOK.eos_token_id, eos_token_id=None)
        if assisted:
            AssistantVocabTranslatorCache._cache.clear()  # each call from scratch
            settings.update(assistant_model=copy.deepcopy(draft), tokenizer=T_TOK,
                            assistant_tokenizer=D_TOK, num_assistant_tokens=3)
        out = target.model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                    **settings)
        key = tuple(out[0, len(PROMPT): len(PROMPT) + 2].tolist())
        seen[key] = seen.get(key, 0) + 1
    return seen


def main(argv: list[str]) -> int:
    n, modes = int(argv[0]) if argv else 20000, argv[1:] or ["assisted", "plain"]
    torch.set_num_threads(1)
    target, _ = loaded_pair()
    draft = make_tiny_llama(1, vocab_size=VD + 2, num_layers=1)
    joint = target_joint(target)
    for mode in modes:
        seen = counts(target, draft, n, mode == "assisted")
        first = {}
        for (x, _), c in seen.items():
            first[x] = first.get(x, 0) + c
        marginal = {x: sum(w for (a, _), w in joint.items() if a == x) for x in range(VT)}
        print(f"{mode}: {n} generations, chi-square p of the first 2 tokens {chi_square_pvalue(seen, joint):.3g}, "
              f"of the first token {chi_square_pvalue(first, marginal):.3g}")
        for x in sorted(marginal, key=lambda x: -abs(first.get(x, 0) / n - marginal[x]))[:3]:
            print(f"  first token {T_TOK.convert_ids_to_tokens(x)!r}: {first.get(x, 0) / n:.4f} seen, "
                  f"{marginal[x]:.4f} under the target")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
