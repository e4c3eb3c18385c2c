"""A tensor-parallel target across the processes that `torchrun` starts: ranks decode in lockstep.

Transformers' own tensor parallelism shards the target (``DistributedConfig(tp_size=N)``: the
attention heads and MLP columns split over N ranks, an all-reduce after each block, the logits
whole on every rank). Everything else is replicated: each rank holds the whole draft and runs
the whole round loop on the same committed tokens. The ranks stay in step because

1. **one random stream**: every rank seeds its generator with the same seed (rank 0's fresh one
   when none is given, broadcast: `agree_seed`), so the same p, q and uniforms give the same
   tokens on every rank;
2. **one set of choices**: what depends on a rank's own clock (γ "auto" chooses from timings) is
   rank 0's choice, broadcast before the round (`from_leader`); what depends only on committed
   tokens (which drafter proposes, EOS, budgets) is the same everywhere by rule 1;
3. **checked, not assumed**: at the end of each generation an all-gather of every row's
   committed tokens must find them identical on every rank (`check_same`), and each round too
   when ``EXACTSPEC_TP_CHECK=round`` (a debug mode: one more collective per round). A mismatch
   raises RuntimeError naming the rank and the row. Ranks that diverged may go on to run
   different numbers of target passes, whose collectives then never match (a hang, not an
   error): the per-round check stops them at the first round that differs.

Only rank 0 prints or serves; the others follow it (`exactspec.serve.lockstep`).
Collectives of the target run on the default process group (gloo on CPU, NCCL on GPUs); the
small messages above (seeds, γ, tokens, a server's requests) go over a gloo group with a long
timeout, since a follower of a server may wait for hours between requests.
"""
from __future__ import annotations

import atexit
import copy
import functools
import os
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist

CHECK_ENV = "EXACTSPEC_TP_CHECK"  # "round": check the committed tokens after every round
_CONTROL_TIMEOUT = timedelta(days=365)  # a server's followers wait for the next request
_TARGET_TIMEOUT = timedelta(hours=2)  # a rank loading a large shard may lag the others
_EXIT_TIMEOUT = timedelta(minutes=1)  # how long a rank waits for the others at exit


def world() -> tuple[int, int]:
    """(rank, number of ranks) of this process; (0, 1) when torch.distributed is not in use."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_leader() -> bool:
    """Whether this process prints and serves: rank 0, or the only process."""
    return world()[0] == 0


def launched() -> bool:
    """Whether torchrun (or a launcher like it) started this process: RANK and WORLD_SIZE are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init() -> torch.device:
    """Join the process group torchrun set up (gloo on CPU, NCCL when CUDA is present) and return
    this rank's device (cuda:LOCAL_RANK, or the CPU). Idempotent. Raises ValueError when the
    process was not started by torchrun."""
    if not launched():
        raise ValueError("tensor parallelism needs one process per rank started by torchrun, "
                         "e.g. `torchrun --standalone --nproc-per-node 2 -m exactspec COMMAND "
                         "--tp ...` (RANK and WORLD_SIZE are not set)")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=_TARGET_TIMEOUT)
        atexit.register(_leave)
    _control()  # made now, by every rank in the same order (making a group is a collective)
    return device


@functools.cache
def _control():
    """The gloo group for control messages, one per process: the process group's own, kept with
    it by torch.distributed (made by `init`)."""
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


def _leave() -> None:
    """At exit: wait (a minute at most) for every rank, then close the process groups. A rank
    that exits while another still talks to it over gloo can make that one abort ("terminate
    called without an active exception")."""
    if dist.is_initialized():
        try:
            dist.monitored_barrier(group=_control(), timeout=_EXIT_TIMEOUT)
        except RuntimeError:  # a rank that failed or is gone: leave anyway
            pass
        finally:
            dist.destroy_process_group()


def check_heads(config, tp_size: int) -> None:
    """Refuse a split the model cannot take: its attention heads and key/value heads must divide
    evenly over the ranks (ValueError naming the counts)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(count, int) and count % tp_size:
            raise ValueError(f"tp: the model's {name} = {count} does not split over {tp_size} "
                             f"ranks; use a number of ranks that divides {heads} and {kv_heads}")


def tp_arguments(source: str, local_only: bool) -> dict:
    """`from_pretrained` arguments that shard the model over every rank (after `init`)."""
    try:
        import accelerate  # noqa: F401  (Transformers' tensor parallelism needs it)
    except ModuleNotFoundError:
        raise ValueError("tp: Transformers' tensor parallelism needs the accelerate package: "
                         "pip install accelerate") from None
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    tp_size = world()[1]
    check_heads(AutoConfig.from_pretrained(source, local_files_only=local_only), tp_size)
    return {"distributed_config": DistributedConfig(tp_size=tp_size)}


def is_sharded(model) -> bool:
    """Whether `model` is split over ranks by tensor parallelism."""
    return (getattr(model, "tp_size", None) or 1) > 1


def local_copy(model, dtype: torch.dtype):
    """A whole copy of `model` in `dtype` on this rank (the default draft: the target's own
    weights in bfloat16). A sharded model is gathered (a collective: every rank calls it at the
    same point); a deep copy of it would share its process groups and hang."""
    if not is_sharded(model):
        return copy.deepcopy(model).to(dtype)
    from transformers import AutoModelForCausalLM

    state = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).to(dtype)
             for name, t in model.state_dict().items()}
    config = copy.deepcopy(model.config)
    config.__dict__.pop("distributed_config", None)  # a whole model: nothing to shard
    whole = AutoModelForCausalLM.from_config(config, dtype=dtype)
    whole.load_state_dict(state, strict=False)
    whole.tie_weights()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return whole.to(device).eval().requires_grad_(False)


# --------------------------------------------------------------------------- lockstep


def _broadcast(value):
    """Rank 0's `value` on every rank."""
    message = [value]
    dist.broadcast_object_list(message, src=0, group=_control())
    return message[0]


def agree_seed(seed: int | None) -> int | None:
    """The seed every rank uses: `seed` as given, or, under tensor parallelism with no seed, a
    fresh one drawn on rank 0 (every rank must draw the same uniforms)."""
    if seed is not None or world()[1] == 1:
        return seed
    return _broadcast(secrets.randbits(63) if is_leader() else None)


def from_leader(value):
    """Rank 0's choice (γ from rank 0's timings) on every rank; `value` itself on one process."""
    return value if world()[1] == 1 else _broadcast(value)


def send(message) -> None:
    """Rank 0: a message every follower receives with `receive` (a server's next step)."""
    if world()[1] > 1:
        _broadcast(message)


def receive():
    """A follower: rank 0's next message (blocks until rank 0 sends one)."""
    return _broadcast(None)


def check_same(rows: list[list[int]], where: str) -> None:
    """Every rank committed the same tokens: all-gather each row's tokens and compare with rank
    0's; RuntimeError naming the rank and the row that differ. A no-op on one process."""
    if world()[1] == 1:
        return
    gathered = [None] * world()[1]
    dist.all_gather_object(gathered, [list(row) for row in rows], group=_control())
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs != gathered[0]:
            row = next((i for i, (a, b) in enumerate(zip(gathered[0], theirs)) if a != b), None)
            raise RuntimeError(f"tensor-parallel ranks diverged at {where}: rank {rank} committed "
                               f"other tokens than rank 0" + (f" in row {row}" if row is not None
                                                               else f" ({len(theirs)} rows)"))


def check_round(rows: list[list[int]], round_index: int) -> None:
    """`check_same` after a round, when EXACTSPEC_TP_CHECK=round (the debug mode)."""
    if world()[1] > 1 and os.environ.get(CHECK_ENV, "").strip().lower() == "round":
        check_same(rows, f"round {round_index}")
