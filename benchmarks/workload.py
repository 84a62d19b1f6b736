"""The fixed, seeded chat workload every server in a run gets, request for request.

Each request is one chat: a user message of 20–400 tokens (uniform) asking for 32–256 output tokens
(uniform); a share of requests (25% by default) also carries one common system prompt of about 300
tokens, as agents and RAG front-ends do, so prefix caching has something to find. Texts are English
words drawn by a seeded generator and cut to the exact token count with the served model's
tokenizer, so the same seed gives the same prompts on every machine.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

WORDS = (
    "the of and to in is was for that on as with by he it at from his an are were which be this has "
    "also or had not first one their its new after but who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "river water light garden music market engine number system island winter summer morning "
    "history science language village station report letter window mountain forest animal "
    "question answer problem example picture kitchen teacher student doctor family country "
    "journey evening bridge harbour library museum theatre council company season railway road "
    "painting festival castle valley desert ocean planet energy signal network machine memory "
    "simple careful bright quiet ancient modern famous useful strange gentle heavy narrow early "
    "build carry follow explain describe remember consider develop measure improve protect "
    "because although while before since until unless whether however therefore instead"
).split()

SYSTEM_INSTRUCTION = (
    "You are a careful assistant for a regional library. Answer briefly and politely. "
    "Reference notes follow. "
)


@dataclass(frozen=True)
class ChatRequest:
    index: int
    messages: list[dict]
    max_tokens: int
    prompt_tokens: int  # after the chat template, counted with the model's tokenizer
    has_system_prompt: bool

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    seed: int = 0
    min_prompt_tokens: int = 20
    max_prompt_tokens: int = 400
    min_output_tokens: int = 32
    max_output_tokens: int = 256
    system_prompt_share: float = 0.25
    system_prompt_tokens: int = 300


def text_of_tokens(tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Seeded English-like text that is exactly `num_tokens` tokens long (encoded on its own)."""
    words = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(num_tokens))
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        if len(ids) >= num_tokens:
            return tokenizer.decode(ids[:num_tokens]).strip()


def count_prompt_tokens(tokenizer, messages: list[dict]) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


def build_workload(spec: WorkloadSpec, tokenizer) -> list[ChatRequest]:
    rng = random.Random(spec.seed)
    system_text = SYSTEM_INSTRUCTION + text_of_tokens(tokenizer, random.Random(spec.seed + 1), spec.system_prompt_tokens)
    requests = []
    for i in range(spec.num_requests):
        num_user_tokens = rng.randint(spec.min_prompt_tokens, spec.max_prompt_tokens)
        max_tokens = rng.randint(spec.min_output_tokens, spec.max_output_tokens)
        has_system = rng.random() < spec.system_prompt_share
        user_text = "Summarise these notes: " + text_of_tokens(tokenizer, rng, num_user_tokens)
        messages = ([{"role": "system", "content": system_text}] if has_system else []) + [
            {"role": "user", "content": user_text}]
        requests.append(ChatRequest(i, messages, max_tokens, count_prompt_tokens(tokenizer, messages), has_system))
    return requests


def shared_prefix_requests(tokenizer, num_requests: int, prefix_tokens: int = 1000, seed: int = 7,
                           suffix_tokens: int = 16, max_tokens: int = 4) -> list[ChatRequest]:
    """Requests whose prompts share one `prefix_tokens`-token system prompt and differ after it."""
    rng = random.Random(seed)
    prefix = text_of_tokens(tokenizer, random.Random(seed + 1), prefix_tokens)
    requests = []
    for i in range(num_requests):
        messages = [{"role": "system", "content": prefix},
                    {"role": "user", "content": f"Question {i}: " + text_of_tokens(tokenizer, rng, suffix_tokens)}]
        requests.append(ChatRequest(i, messages, max_tokens, count_prompt_tokens(tokenizer, messages), True))
    return requests


def load_default_tokenizer():
    from transformers import AutoTokenizer

    from services.common.model_files import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None, None).path))
