"""The worker service: device, weights, KV cache tensors, persistent batch, attention, sampler.

server.py (gRPC WorkerService) -> worker.py (device, loading, KV sizing) -> model_runner.py (one
step: input_batch.py + block_table.py -> models/ on layers/ and attention/ -> sampler.py).
"""
