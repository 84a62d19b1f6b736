"""Starts llama-cpp-python's OpenAI server with `use_extra_bufts=False` (run by the llama-cpp peer venv).

On this CPU (AVX2, no AMX) llama.cpp's "extra buffer types" (the AMX/repacking path) die with an
illegal instruction at the first decode; loading without them works. The server's settings do not
expose the flag, so this launcher sets it on the model parameters llama-cpp-python builds, then
serves as `python -m llama_cpp.server` would. It imports nothing from the project.

    python llama_cpp_launcher.py --model M.gguf --port 8080 [--n-ctx 8192] [--n-threads N]
"""
from __future__ import annotations

import argparse
import inspect

import llama_cpp
import uvicorn
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings


def disable_extra_buffer_types() -> str:
    """Makes every model load use use_extra_bufts=False; returns how it was done."""
    if "use_extra_bufts" in inspect.signature(llama_cpp.Llama.__init__).parameters:
        original_init = llama_cpp.Llama.__init__

        def init(self, *args, **kwargs):
            kwargs["use_extra_bufts"] = False
            original_init(self, *args, **kwargs)

        llama_cpp.Llama.__init__ = init
        return "Llama(use_extra_bufts=False)"
    default_params = llama_cpp.llama_model_default_params
    if not any(name == "use_extra_bufts" for name, *_ in default_params().__class__._fields_):
        return "not available in this llama-cpp-python (left as is)"

    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    llama_cpp.llama_cpp.llama_model_default_params = params
    return "llama_model_params.use_extra_bufts = False"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--alias", default="SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-threads", type=int, help="default: llama-cpp-python's (half the CPUs)")
    args = parser.parse_args()
    how = disable_extra_buffer_types()
    print(f"llama_cpp {llama_cpp.__version__}: extra buffer types off via {how}", flush=True)
    threads = {"n_threads": args.n_threads, "n_threads_batch": args.n_threads} if args.n_threads else {}
    # interrupt_requests=False: a new request waits for the running one instead of cutting it off
    # (the server runs one request at a time either way).
    app = create_app(
        server_settings=ServerSettings(host=args.host, port=args.port, interrupt_requests=False),
        model_settings=[ModelSettings(model=args.model, model_alias=args.alias, n_ctx=args.n_ctx, verbose=False,
                                      **threads)],
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
