"""α = Σ min(p, q) against the coupled agreement P(race_q = race_p), llama.cpp draft vs the
float32 bundled target, T = 0.8, on the positions of plain-decoded texts (4 built-in prompts)."""
import statistics, torch, exactspec as es
from exactspec.models import load_model, encode_prompt
from exactspec.drafters import make_drafter
from exactspec.bench.config import BUILTIN_PROMPTS
from exactspec.noise import exponentials, race
from exactspec.sampling import SamplingConfig
torch.set_num_threads(2)
target = load_model("smollm2-135m-instruct")
cfg = SamplingConfig(0.8)
alphas, coupled = [], []
for prompt in BUILTIN_PROMPTS:
    ids = encode_prompt(target, prompt.text)
    out = es.autoregressive_generate(target, ids, max_new_tokens=48, temperature=0.8, seed=0, eos_token_id=[])
    seq = out.sequences[0]
    with torch.no_grad():
        logits = target.model(seq.unsqueeze(0)).logits[0]  # [L, V]
    d = make_drafter("llamacpp", target=target); V = d.bind(target, len(seq) + 1)
    d.start(ids, torch.ones_like(ids, dtype=torch.bool), V)
    d._feed([ids[0, :-1].tolist()])
    for t in range(ids.size(1) - 1, len(seq) - 1):
        q = cfg.probs(d._feed([[int(seq[t])]])[0])
        p = cfg.probs(logits[t, :V])
        alphas.append(torch.minimum(p, q).sum().item())
        agree = sum(int(race(p, e)) == int(race(q, e)) for e in (exponentials(s, t, V) for s in range(200)))
        coupled.append(agree / 200)
print(f"{len(alphas)} positions: mean α = Σ min(p, q) {statistics.fmean(alphas):.4f}, "
      f"coupled agreement {statistics.fmean(coupled):.4f} (200 noise draws per position)")
