"""vLLM's engine gRPC protocol (`vllm.grpc.engine.VllmEngine`, from the `smg-grpc-proto` stubs) on
the frontend's serving path: `codec` (protobuf <-> the frontend's dataclasses), `responses` (the
serving path's deltas as chunks and completes), `tokenizer_bundle` (GetTokenizer's ZIP) and
`servicer` (the RPCs)."""
