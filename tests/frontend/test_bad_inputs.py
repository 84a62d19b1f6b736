"""Every row of the bad-input table in docs/api.md, against the scripted engine: documented status,
OpenAI error object naming the field (gRPC: status code and `(param: ...)`), nothing reaches the engine."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.frontend.bad_inputs import GRPC_CASES, HTTP_CASES, doc_cases, param_of_grpc_details
from tests.frontend.fakes import FakeEngineClient, app_client, make_tokenizer
from tests.frontend.test_grpc_service import grpc_stub
from tests.openai_schema import validate

DOC_CASES = doc_cases()


def test_every_documented_case_has_a_test_and_back():
    assert set(DOC_CASES) == set(HTTP_CASES) | set(GRPC_CASES)
    assert not set(HTTP_CASES) & set(GRPC_CASES)


@pytest.mark.parametrize("case", sorted(HTTP_CASES))
def test_http_bad_input(case):
    path, body = HTTP_CASES[case]
    expected = DOC_CASES[case]

    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with app_client(engine) as client:
            if isinstance(body, bytes):
                response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
            else:
                response = await client.post(path, json=body)
            return response.status, await response.json(), engine

    status, payload, engine = asyncio.run(scenario())
    assert str(status) == expected.status, payload
    validate(payload, "ErrorResponse")
    assert payload["error"]["param"] == expected.param
    assert payload["error"]["code"] == expected.code
    assert payload["error"]["message"]
    assert engine.requests == []  # refused before reaching the engine


@pytest.mark.parametrize("case", sorted(GRPC_CASES))
def test_grpc_bad_input(case):
    method, request = GRPC_CASES[case]
    expected = DOC_CASES[case]

    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with grpc_stub(engine) as stub:
            call = getattr(stub, method)(request)
            try:
                if method == "Generate":
                    return [r async for r in call], engine
                return await call, engine
            except grpc.aio.AioRpcError as err:
                return err, engine

    err, engine = asyncio.run(scenario())
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code().name == expected.status, err.details()
    assert param_of_grpc_details(err.details()) == expected.param
    assert engine.requests == []
