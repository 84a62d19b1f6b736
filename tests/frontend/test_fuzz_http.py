"""Schema-driven fuzz of the HTTP API: the frontend app (real routes, validation, chat template,
tokenizer, detokenizer, SSE) in front of the scripted engine, which answers at once and is never
unavailable, so no body, however broken, may get a 5xx (see tests/http_fuzz.py for the contract).

Bodies come from the official request schemas, the served subset of them, and mutations that break
them (tests/openapi_strategies.py). The default run is derandomized (the same examples every run)
and bounded; `make test-slow` runs the same properties with ten times the examples, random each run.
"""
from __future__ import annotations

import json
import string
import urllib.parse

import pytest
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from services.frontend.app import create_app
from services.frontend.errors import error_middleware, invalid_request
from tests.frontend.fakes import MODEL_NAME, FakeEngineClient, make_tokenizer, serving_model
from tests.http_fuzz import check_reply, fuzz_target
from tests.openai_schema import validate
from tests.openapi_strategies import CHAT, MUTATIONS, POST_ROUTES, mutated_bodies, official_bodies, served_bodies

MAX_TOKENS = 6
# Bytes of one character split over several tokens, so streams cut characters across chunks.
REPLY = "Hi 😀 wörld 日本"
# Each mutation is a family of its own, so that every one is tried on every route.
FAMILIES = ("official", "served", *(f"mutated: {how}" for how in MUTATIONS))
NUM_EXAMPLES = {"official": 100, "served": 120, **{f"mutated: {how}": 40 for how in MUTATIONS}}
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngineClient(make_tokenizer(), REPLY)
    with fuzz_target(app=create_app(engine, serving_model(engine.tokenizer))) as target:
        yield target, engine


def bodies(family: str, path: str, vocab_size: int):
    if family == "official":
        return official_bodies(path, MODEL_NAME)
    if family == "served":
        return served_bodies(path, MODEL_NAME, vocab_size, MAX_TOKENS)
    return mutated_bodies(path, MODEL_NAME, vocab_size, MAX_TOKENS, family.removeprefix("mutated: "))


def fuzz(target, strategy, num_examples: int, derandomize: bool = True, phases=tuple(Phase)) -> None:
    @settings(max_examples=num_examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=SUPPRESSED, phases=phases)
    @given(body=strategy)
    def run(body):
        check_reply(body, target.post(body))

    run()
    assert target.request("GET", "/health").status == 200  # still serving after all that


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_post_routes(fake, family, path):
    target, engine = fake
    fuzz(target, bodies(family, path, engine.info.vocab_size), NUM_EXAMPLES[family])


def test_served_bodies_reach_the_engine(fake):
    """The served family is worth its examples: most of its chat bodies are answered, not refused."""
    target, engine = fake
    statuses = []

    @settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=SUPPRESSED)
    @given(body=bodies("served", CHAT, engine.info.vocab_size))
    def run(body):
        reply = target.post(body)
        check_reply(body, reply)
        statuses.append(reply.status)

    run()
    assert statuses.count(200) >= len(statuses) // 2, statuses


PATH_TEXT = st.text(string.ascii_letters + string.digits + "/-._~%?&=#:;@!$'()*+,", max_size=30) | st.text(max_size=8)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]), tail=PATH_TEXT)
def test_fuzz_routes(fake, method, tail):
    """Any method on any path: a known route's answer, or an OpenAI error object (404, 405)."""
    target, _ = fake
    for path in ("/" + urllib.parse.quote(tail, safe="/"), "/v1/models/" + urllib.parse.quote(tail, safe="")):
        reply = target.request(method, path)
        assert reply.status < 500, (method, path, reply)
        if reply.status == 200 and method == "GET" and path.startswith("/v1/models/"):
            validate(reply.json(), "Model")
        elif reply.status >= 400:
            validate(reply.json(), "ErrorResponse")


async def _naive_handler(request: web.Request) -> web.Response:
    """A handler that checks nothing: Python's parser, then the text handed on as UTF-8."""
    body = json.loads(await request.read())
    json.dumps(body, ensure_ascii=False).encode()  # as a tokenizer would take the text
    raise invalid_request("refused")


@pytest.mark.parametrize("how", ["deep nesting", "odd unicode"])
def test_the_fuzz_finds_what_crashes_a_naive_parser(how):
    """Nesting past the parser's recursion limit and lone surrogates reach the handler: a server that
    does not refuse them fails the run with a 500 (each alone, so each mutation is shown to bite)."""
    app = web.Application(middlewares=[error_middleware])
    app.router.add_post(CHAT, _naive_handler)
    with fuzz_target(app=app) as target:
        with pytest.raises((AssertionError, ExceptionGroup)) as failure:
            fuzz(target, bodies(f"mutated: {how}", CHAT, 320), NUM_EXAMPLES[f"mutated: {how}"],
                 phases=[Phase.generate])  # the first failure is proof enough: no shrinking
    errors = failure.value.exceptions if isinstance(failure.value, ExceptionGroup) else [failure.value]
    assert any("server error" in str(e) for e in errors), failure.value


@pytest.mark.slow
@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_post_routes_long(fake, family, path):
    target, engine = fake
    fuzz(target, bodies(family, path, engine.info.vocab_size), 10 * NUM_EXAMPLES[family], derandomize=False)
