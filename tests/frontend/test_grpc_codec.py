"""The public gRPC API's own messages: separate from the internal protos, wire-compatible with the
shape clients already use, and converted to the frontend's dataclasses by `grpc_codec` alone."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool

from services.common import messages as m
from services.common.pb import generate_pb2 as pb
from services.frontend import grpc_codec, grpc_service
from services.frontend.errors import APIError
from services.frontend.protocol import CompletionRequest
from services.frontend.serving_engine import TextDelta

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
GENERATE_PROTO = "spindle/v1/generate.proto"
Params = pb.GenerateRequest.SamplingParams
Response = pb.GenerateResponse


# --- separation ----------------------------------------------------------------------------------
def internal_protos() -> set[str]:
    """Every proto of the services but the public one, as import paths."""
    return {str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "spindle" / "v1").glob("*.proto")} - {GENERATE_PROTO}


def internal_imports(proto_text: str) -> list[str]:
    imports = re.findall(r'^\s*import\s+(?:public\s+|weak\s+)?"([^"]+)"\s*;', proto_text, flags=re.MULTILINE)
    return [name for name in imports if name in internal_protos()]


def internal_dependencies(file: descriptor.FileDescriptor) -> list[str]:
    return [d.name for d in file.dependencies if d.name in internal_protos()]


INTERNAL_MODULES = ("services.common.codec", "services.common.worker_codec", "engine_core_pb2", "worker_pb2")


def internal_module_uses(source: str) -> list[str]:
    """Names of internal codecs or stubs a module imports, in any import spelling."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if any(n == i or n.endswith("." + i) for i in INTERNAL_MODULES)]
    return found


def test_internal_protos_are_the_ones_to_keep_out():
    assert {"spindle/v1/engine_core.proto", "spindle/v1/worker.proto"} <= internal_protos()


def test_generate_proto_imports_no_internal_proto():
    assert internal_imports((PROTO_DIR / GENERATE_PROTO).read_text()) == []
    assert internal_dependencies(pb.DESCRIPTOR) == []
    assert [d.name for d in pb.DESCRIPTOR.dependencies] == []


def test_every_field_type_is_the_public_files_own():
    def types_of(message):
        for field in message.fields:
            for t in (field.message_type, field.enum_type):
                if t is not None:
                    yield t
        for nested in message.nested_types:
            yield from types_of(nested)

    outside = [t.full_name for msg in pb.DESCRIPTOR.message_types_by_name.values() for t in types_of(msg)
               if t.file is not pb.DESCRIPTOR]
    assert outside == []


def test_separation_checks_catch_an_internal_import():
    # The public proto as it was: importing engine_core.proto for its messages.
    assert internal_imports('syntax = "proto3";\nimport "spindle/v1/engine_core.proto";\n') == [
        "spindle/v1/engine_core.proto"]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto(name="spindle/v1/engine_core.proto", package="internal"))
    pool.Add(descriptor_pb2.FileDescriptorProto(name="old_generate.proto", package="old",
                                                dependency=["spindle/v1/engine_core.proto"]))
    assert internal_dependencies(pool.FindFileByName("old_generate.proto")) == ["spindle/v1/engine_core.proto"]


@pytest.mark.parametrize("module", [grpc_service, grpc_codec])
def test_public_modules_use_no_internal_codec_or_stubs(module):
    assert internal_module_uses(Path(module.__file__).read_text()) == []


def test_module_check_catches_internal_imports():
    source = ("from services.common.pb import engine_core_pb2, generate_pb2\n"
              "from services.common.codec import sampling_params_from_pb\nimport services.common.codec\n")
    assert internal_module_uses(source) == ["services.common.pb.engine_core_pb2", "services.common.codec",
                                            "services.common.codec"]


# --- wire compatibility --------------------------------------------------------------------------
# Bytes a client built on the previous generate.proto sent and received (then SamplingParams, TokenIds,
# TokenLogprobs, TopLogprob and FinishReason were engine_core.proto's), every field set.
OLD_REQUEST = bytes.fromhex(
    "0a0272311a050a0305ac0222450802150000003f1d0000403f20ffffffffffffffffff012d0000003e30073d0000803e4500"
    "0000bf4d0000c03f5207082a150000c8c2580960016a020304700178028001002a010a30ffffffffffffffffff013a016d4001")
OLD_RESPONSE = bytes.fromhex("0a027231120248691a020506200228033002381040014a100d000080be10011a07080515000080be4a00")


def test_old_clients_requests_read_the_same():
    expected = pb.GenerateRequest(
        request_id="r1", token_ids=pb.GenerateRequest.TokenIds(token_ids=[5, 300]), stop=["\n"], priority=-1,
        model="m", include_stop_str_in_output=True, sampling_params=Params(
            n=2, temperature=0.5, top_p=0.75, top_k=-1, min_p=0.125, seed=7, presence_penalty=0.25,
            frequency_penalty=-0.5, repetition_penalty=1.5, logit_bias={42: -100.0}, max_tokens=9, min_tokens=1,
            stop_token_ids=[3, 4], ignore_eos=True, logprobs=2, prompt_logprobs=0))
    assert pb.GenerateRequest.FromString(OLD_REQUEST) == expected
    assert expected.SerializeToString(deterministic=True) == OLD_REQUEST


def test_old_clients_read_responses_the_same():
    response = Response(
        request_id="r1", text="Hi", token_ids=[5, 6], finish_reason=Response.FINISH_REASON_LENGTH,
        num_prompt_tokens=3, num_completion_tokens=2, num_cached_tokens=16, index=1,
        logprobs=[Response.TokenLogprobs(logprob=-0.25, rank=1,
                                         top_logprobs=[Response.TopLogprob(token_id=5, logprob=-0.25)]),
                  Response.TokenLogprobs()])
    assert response.SerializeToString(deterministic=True) == OLD_RESPONSE


def test_finish_reasons_keep_their_numbers():
    assert dict(Response.FinishReason.items()) == {
        "FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1, "FINISH_REASON_LENGTH": 2}
    response = descriptor_pb2.DescriptorProto()
    Response.DESCRIPTOR.CopyToProto(response)
    enum = next(e for e in response.enum_type if e.name == "FinishReason")
    # The internal ABORT and ERROR numbers stay unused (an enum's reserved range includes its end).
    assert [(r.start, r.end) for r in enum.reserved_range] == [(3, 3), (4, 4)]
    assert list(enum.reserved_name) == ["FINISH_REASON_ABORT", "FINISH_REASON_ERROR"]


# --- conversion ----------------------------------------------------------------------------------
def test_unset_sampling_params_take_every_default():
    assert grpc_codec.sampling_params_from_pb(Params()) == m.SamplingParams(
        n=1, temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_tokens=0)


def test_sampling_params_keep_set_values_and_presence():
    params = grpc_codec.sampling_params_from_pb(Params(
        n=3, temperature=0.5, top_p=0.75, top_k=-1, seed=0, logprobs=0, logit_bias={7: 1.5},
        stop_token_ids=[3], repetition_penalty=1.25, max_tokens=4, min_tokens=2, ignore_eos=True))
    assert params == m.SamplingParams(n=3, temperature=0.5, top_p=0.75, top_k=0, seed=0, logprobs=0,
                                      logit_bias={7: 1.5}, stop_token_ids=(3,), repetition_penalty=1.25,
                                      max_tokens=4, min_tokens=2, ignore_eos=True)


def test_generate_request_becomes_a_completion_request():
    request = grpc_codec.generate_request_from_pb(pb.GenerateRequest(
        request_id="ignored", text="Hi", stop=["."], priority=2, model="m", include_stop_str_in_output=True,
        sampling_params=Params(max_tokens=5)))
    assert isinstance(request, CompletionRequest) and request.prompt == "Hi"
    options = request.options
    assert (options.model, options.max_tokens, options.max_tokens_param, options.stop, options.priority,
            options.include_stop_str_in_output) == ("m", 5, "max_tokens", (".",), 2, True)
    by_ids = grpc_codec.generate_request_from_pb(pb.GenerateRequest(token_ids=pb.GenerateRequest.TokenIds(
        token_ids=[4, 5])))
    assert (by_ids.prompt, by_ids.options.model, by_ids.options.max_tokens) == ([4, 5], None, None)


def test_structured_outputs_read_as_the_http_field():
    from services.common.structured_outputs import StructuredOutputsParams as P

    SO = pb.StructuredOutputs
    cases = [
        (SO(regex="[0-9]+"), P("regex", "[0-9]+"), "structured_outputs.regex"),
        (SO(json='{"type": "object"}', any_whitespace=True), P("json", '{"type": "object"}', any_whitespace=True),
         "structured_outputs.json"),
        (SO(choice=SO.Choices(choices=["a", "b"])), P("choice", '["a", "b"]'), "structured_outputs.choice"),
        (SO(json_object=True), P("json_object"), "structured_outputs.json_object"),
        (SO(grammar='root ::= "x"'), P("grammar", 'root ::= "x"'), "structured_outputs.grammar"),
    ]
    for so, params, param in cases:
        options = grpc_codec.generate_request_from_pb(pb.GenerateRequest(text="x", structured_outputs=so)).options
        assert (options.sampling_params.structured_outputs, options.constraint_param) == (params, param)
    unset = grpc_codec.generate_request_from_pb(pb.GenerateRequest(text="x")).options
    assert unset.sampling_params.structured_outputs is None


@pytest.mark.parametrize("request_, param", [
    (pb.GenerateRequest(text="x", structured_outputs=pb.StructuredOutputs()), "structured_outputs"),
    (pb.GenerateRequest(text="x", structured_outputs=pb.StructuredOutputs(json="[1]")), "structured_outputs.json"),
    (pb.GenerateRequest(text="x", structured_outputs=pb.StructuredOutputs(choice=pb.StructuredOutputs.Choices())),
     "structured_outputs.choice"),
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text=""), "text"),
    (pb.GenerateRequest(text="x", stop=["a", ""]), "stop"),
    (pb.GenerateRequest(text="x", sampling_params=Params(max_tokens=-1)), "max_tokens"),
    (pb.GenerateRequest(text="x", sampling_params=Params(top_k=-2)), "top_k"),
])
def test_bad_generate_requests_name_the_field(request_, param):
    with pytest.raises(APIError) as info:
        grpc_codec.generate_request_from_pb(request_)
    assert (info.value.status, info.value.param) == (400, param)


def test_responses_carry_the_public_reason_and_logprobs():
    lp = m.TokenLogprobs(logprob=-0.5, rank=2, top_logprobs=[(9, -0.25), (5, -0.5)])
    delta = TextDelta("ab", [5, 6], "length", num_cached_tokens=16, logprobs=[lp, None])
    response = grpc_codec.generate_response_to_pb("r", 1, delta, num_prompt_tokens=3, num_completion_tokens=2)
    assert response == Response(
        request_id="r", text="ab", token_ids=[5, 6], finish_reason=Response.FINISH_REASON_LENGTH,
        num_prompt_tokens=3, num_completion_tokens=2, num_cached_tokens=16, index=1,
        logprobs=[Response.TokenLogprobs(logprob=-0.5, rank=2, top_logprobs=[
            Response.TopLogprob(token_id=9, logprob=-0.25), Response.TopLogprob(token_id=5, logprob=-0.5)]),
            Response.TokenLogprobs()])
    assert [grpc_codec.finish_reason_to_pb(r) for r in (None, "stop", "length")] == [
        Response.FINISH_REASON_UNSPECIFIED, Response.FINISH_REASON_STOP, Response.FINISH_REASON_LENGTH]
