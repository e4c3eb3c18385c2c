"""The FastAPI application: OpenAI's /v1/models, /v1/completions and /v1/chat/completions, plus
/health and /metrics. Handlers check and encode a request, hand it to the `Scheduler` (the
engine thread) and turn its token events into a response or a server-sent-event stream."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from exactspec.batching import RowSettings
from exactspec.noise import choice_seed
from exactspec.serve.drafts import drafter_factory
from exactspec.serve.metrics import ServerMetrics
from exactspec.serve.protocol import ApiError, Params, parse_request
from exactspec.serve.reply import Reply
from exactspec.serve.scheduler import Job, QueueFull, Scheduler
from exactspec.serve.tool_calls import chat_prompt
from exactspec.serve.tools import tool_constraint

log = logging.getLogger("exactspec.serve")
DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 512}  # OpenAI's completions default is 16


@dataclass
class ServeConfig:
    """What `exactspec serve` serves: model specs (or loaded models), drafting and limits."""

    target: object = "smollm2-135m-instruct"
    # "auto" (prompt lookup, else a bfloat16 copy of the target), "auto:SPEC", a model spec,
    # "ngram", "none"/None, or a loaded model
    draft: object = "auto"
    gamma: int | str = "auto"  # a request's integer `gamma` keeps its own fixed γ
    verify: str = "block"
    max_batch: int = 8
    max_queue: int = 64
    model_name: str | None = None  # the id clients use; default: the target spec as given
    tp: bool = False  # the target split over torchrun's ranks: rank 0 serves (serve.lockstep)
    prompt_cache: bool = False  # a llama.cpp target resumes what the last batch left (load_model)


class ServerState:
    """Loads the models in a background thread (so /health answers 503 meanwhile), then runs
    the scheduler."""

    def __init__(self, config: ServeConfig):
        self.config, self.metrics = config, ServerMetrics()
        self.scheduler: Scheduler | None = None
        self.target, self.context = None, None
        self.error: str | None = None
        self.model_name = config.model_name or (config.target if isinstance(config.target, str)
                                                else getattr(config.target, "name", "target"))
        self.created = int(time.time())

    def load(self) -> None:
        from exactspec.models import context_length, eos_token_ids, load_model

        try:
            config = self.config
            target = config.target
            if isinstance(target, str):
                target = load_model(target, tp=config.tp, prompt_cache=config.prompt_cache)
            make_drafter = drafter_factory(config.draft, target)
            make_drafter()  # a bad spec fails now, not at the first request
            self.target, self.context = target, context_length(target)
            scheduler_type = Scheduler
            if config.tp:  # the other ranks follow this one's batches
                from exactspec.serve.lockstep import LeaderScheduler as scheduler_type
            self.scheduler = scheduler_type(target, make_drafter, eos_ids=eos_token_ids(target), max_batch=config.max_batch,
                                       max_queue=config.max_queue, context=self.context,
                                       metrics=self.metrics)
            self.scheduler.start()
        except Exception as err:  # /health reports it; the process keeps answering
            log.exception("loading the models failed")
            self.error = f"{type(err).__name__}: {err}"

    def ready(self) -> Scheduler:
        if self.scheduler is None:
            why = f"loading the models failed: {self.error}" if self.error else "the models are still loading"
            raise ApiError(503, why, type="service_unavailable")
        return self.scheduler


def create_app(config: ServeConfig, *, load_in_background: bool = True) -> FastAPI:
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loader = threading.Thread(target=state.load, name="exactspec-load", daemon=True)
        loader.start()
        if not load_in_background:
            await asyncio.to_thread(loader.join)
        yield
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.stop)

    app = FastAPI(title="exactspec", lifespan=lifespan)
    app.state.exactspec = state
    _add_error_handlers(app, state)
    _add_routes(app, state)
    return app


def _error_response(err: ApiError, state: ServerState) -> JSONResponse:
    state.metrics.rejected.labels(status=str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return _error_response(err, state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(err.status_code, str(err.detail), type=kind), state)

    @app.exception_handler(Exception)
    async def server_error(request, err: Exception):
        log.exception("request failed")
        return _error_response(ApiError(500, f"internal error: {type(err).__name__}: {err}",
                                        type="server_error"), state)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        state.ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "created": state.created, "owned_by": "exactspec"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, state, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, state, "chat")


async def _serve(request: Request, state: ServerState, kind: str):
    scheduler = state.ready()
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    params = parse_request(body, kind)
    if params.model is not None and params.model != state.model_name:
        raise ApiError(404, f"the model {params.model!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model", type="invalid_request_error",
                       code="model_not_found")
    prompt = _encode(state, params)
    if params.n > max(1, scheduler.max_queue):
        raise ApiError(400, f"n must be at most the server's queue length {scheduler.max_queue}, "
                            f"got {params.n}", param="n")
    settings, events = _settings(state, params, len(prompt)), asyncio.Queue()
    jobs = [Job(prompt, _choice_settings(settings, params, i), asyncio.get_running_loop(),
                events, index=i) for i in range(params.n)]
    try:
        scheduler.submit(*jobs)
    except QueueFull as err:
        raise ApiError(429, str(err), type="rate_limit_error", code="queue_full") from None
    reply = Reply(state, params, jobs, events)
    if params.stream:
        return StreamingResponse(reply.stream(), media_type="text/event-stream")
    return await reply.whole(request)


def _encode(state: ServerState, params: Params) -> list[int]:
    tokenizer = state.target.tokenizer
    if params.kind == "chat":
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        messages, tools = chat_prompt(tokenizer, params.messages, params.tools)  # tools: serve.tool_calls
        encoded = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                return_tensors="pt")
        ids = encoded if not hasattr(encoded, "keys") else encoded["input_ids"]
        return ids[0].tolist()
    if isinstance(params.prompt, list):
        vocab = state.target.vocab_size
        bad = [t for t in params.prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt token ids must be in [0, {vocab}), got {bad[0]}", param="prompt")
        return list(params.prompt)
    from exactspec.models import encode_prompt

    return encode_prompt(state.target, params.prompt, chat=False)[0].tolist()


def _settings(state: ServerState, params: Params, prompt_tokens: int) -> RowSettings:
    context = state.context
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[params.kind]
        if context is not None:
            max_tokens = max(1, min(max_tokens, context - prompt_tokens))
    if context is not None and prompt_tokens + max_tokens > context:
        field = "messages" if params.kind == "chat" else "prompt"
        raise ApiError(400, f"this model's maximum context length is {context} tokens, but "
                            f"{prompt_tokens + max_tokens} were requested ({prompt_tokens} in the "
                            f"{field}, {max_tokens} to generate)", param=field,
                       code="context_length_exceeded")
    constraint = params.constraint
    if constraint is not None:
        _check_constrainable(state, "response_format")
    elif params.tools is not None:  # the reply follows the tools' grammar (serve.tools)
        constraint = tool_constraint(params.tools, state.target.tokenizer, _check_constrainable(state, "tools"))
    if params.logit_bias and params.logit_bias[-1][0] >= state.target.vocab_size:
        raise ApiError(400, f"logit_bias token ids must be in [0, {state.target.vocab_size}), got "
                            f"{params.logit_bias[-1][0]}", param="logit_bias")
    gamma = state.config.gamma if params.gamma is None else params.gamma
    return RowSettings(max_new_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
                       top_p=params.top_p, seed=params.seed, gamma=gamma, verify=_rule(state, params),
                       constraint=constraint, frequency_penalty=params.frequency_penalty,
                       presence_penalty=params.presence_penalty,
                       repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
                       min_p=params.min_p, logprobs=params.logprobs)


def _choice_settings(settings: RowSettings, params: Params, index: int) -> RowSettings:
    """Choice `index`'s row: the request's settings with its own stream — seeded
    `choice_seed(seed, index)` when the request has a seed (so under the coupled rule each choice
    is plain decoding with that seed), else a random seed of its own (the batch draws one)."""
    if params.seed is None:
        return settings
    return replace(settings, seed=choice_seed(params.seed, index))


def _check_constrainable(state: ServerState, param: str):
    """llguidance's view of the model's tokenizer (made once, then kept for every constrained
    request); a 400 naming `param` when llguidance cannot read it."""
    from exactspec.constraints import matcher_tokenizer
    from exactspec.models import eos_token_ids, usable_vocab
    from exactspec.models.loaded import memory_of

    try:
        return matcher_tokenizer(state.target.tokenizer, usable_vocab(state.target),
                                 set(eos_token_ids(state.target)), memory_of(state.target))
    except (ValueError, ImportError) as err:
        raise ApiError(400, f"{param} is not available for this model: {err}", param=param) from None


def _rule(state: ServerState, params: Params) -> str:
    """The request's verification rule: as asked; else "coupled" when it has a seed (its text is
    then plain decoding's with that seed, whatever shares its batch and whatever γ the
    controller picks); else the server's, the fastest for unseeded requests."""
    if params.verify is not None:
        return params.verify
    return "coupled" if params.seed is not None else state.config.verify
