"""The aiohttp application: OpenAI routes, /tokenize, /detokenize, /health, /version, /stats, and JSON
errors for everything else; API keys and the body limit guard every route before its handler runs."""
from __future__ import annotations

import dataclasses
import time
from importlib import metadata
from typing import Any

from aiohttp import web

from services.frontend.api_keys import ApiKeys, api_key_middleware
from services.frontend.engine_protocol import EngineClientProtocol
from services.frontend.errors import error_middleware, model_not_found, service_unavailable
from services.frontend.observability import FrontendObserver
from services.frontend.public_edge import EdgeConfig
from services.frontend.request_limits import body_limit_middleware
from services.frontend.serving_chat import OpenAIServingChat
from services.frontend.serving_completion import OpenAIServingCompletion
from services.frontend.serving_engine import OpenAIServing, ServerState, ServingModel
from services.frontend.serving_tokenization import OpenAIServingTokenization

SERVING_KEY = web.AppKey("serving", OpenAIServing)
CHAT_KEY = web.AppKey("serving_chat", OpenAIServingChat)
COMPLETION_KEY = web.AppKey("serving_completion", OpenAIServingCompletion)
TOKENIZATION_KEY = web.AppKey("serving_tokenization", OpenAIServingTokenization)
CREATED_KEY = web.AppKey("created", int)


def spindle_version() -> str:
    try:
        return metadata.version("spindle")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def create_app(engine_client: EngineClientProtocol, model: ServingModel, state: ServerState | None = None,
               observer: FrontendObserver | None = None, edge: EdgeConfig = EdgeConfig(),
               stream_interval: int = 1) -> web.Application:
    """Builds the HTTP app around an engine client (real or fake) and the served model; `observer`
    records metrics and spans of each request (none: nothing is recorded); `edge` holds the API keys
    and the body limit; streamed responses get their tokens every `stream_interval`."""
    state = state or ServerState()
    # Keys first: an anonymous client learns nothing, not even the limits.
    guards = [api_key_middleware(ApiKeys(edge.api_keys), edge.protect_metrics)] if edge.api_keys else []
    guards.append(body_limit_middleware(edge.max_request_body_bytes))
    # client_max_size: request.read() stops at the same limit for bodies without Content-Length.
    app = web.Application(middlewares=[error_middleware, *guards], client_max_size=edge.max_request_body_bytes)
    app[SERVING_KEY] = OpenAIServing(engine_client, model, state, observer, stream_interval)
    app[CHAT_KEY] = OpenAIServingChat(engine_client, model, state, observer, stream_interval)
    app[COMPLETION_KEY] = OpenAIServingCompletion(engine_client, model, state, observer, stream_interval)
    app[TOKENIZATION_KEY] = OpenAIServingTokenization(engine_client, model, state, observer, stream_interval)
    app[CREATED_KEY] = int(time.time())
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/stats", stats)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    return app


async def health(request: web.Request) -> web.Response:
    """200 while the engine is ready and the server is not draining; 503 otherwise."""
    serving = request.app[SERVING_KEY]
    if serving.is_ready:
        return web.json_response({"status": "ok"})
    status = "draining" if serving.state.is_draining else "engine not ready"
    return web.json_response({"status": status}, status=503, headers={"Retry-After": "5"})


async def stats(request: web.Request) -> web.Response:
    """The engine's scheduler stats (running, waiting, KV blocks), straight from the scheduler, and
    the device, dtype and attention backend the engine reported when the frontend connected."""
    serving = request.app[SERVING_KEY]
    try:
        scheduler_stats, is_worker_alive = await serving.engine_client.get_stats()
    except Exception as exc:  # the scheduler is unreachable: report it rather than fail
        raise service_unavailable(f"cannot reach the scheduler: {exc}") from exc
    info = serving.engine_client.info
    # What the engine runs on, so an operator (or a test) sees a fallback to the PyTorch attention.
    engine = {} if info is None else {"device": info.device, "dtype": info.dtype,
                                      "attention_backend": info.attention_backend}
    return web.json_response({**dataclasses.asdict(scheduler_stats), "is_worker_alive": is_worker_alive, **engine})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": spindle_version()})


def _model_card(request: web.Request) -> dict[str, Any]:
    serving = request.app[SERVING_KEY]
    card: dict[str, Any] = {
        "id": serving.model.name,
        "object": "model",
        "created": request.app[CREATED_KEY],
        "owned_by": "spindle",
    }
    if serving.engine_client.is_ready:
        card["max_model_len"] = serving.max_model_len
    return card


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def retrieve_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name != request.app[SERVING_KEY].model.name:
        raise model_not_found(name)
    return web.json_response(_model_card(request))


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await request.app[CHAT_KEY].create_chat_completion(request)


async def create_completion(request: web.Request) -> web.StreamResponse:
    return await request.app[COMPLETION_KEY].create_completion(request)


async def tokenize(request: web.Request) -> web.Response:
    return await request.app[TOKENIZATION_KEY].create_tokenize(request)


async def detokenize(request: web.Request) -> web.Response:
    return await request.app[TOKENIZATION_KEY].create_detokenize(request)
