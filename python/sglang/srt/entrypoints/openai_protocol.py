"""OpenAI request bodies as pydantic models, with upstream sglang's field sets.

``CompletionRequest`` and ``ChatCompletionRequest`` take every field of upstream's models of the
same names (``entrypoints/openai/protocol.py`` there). Fields this engine honours behave as
upstream; the others are accepted at their default value and refused otherwise
(``UNSUPPORTED``, with the reason). ``openai_convert.py`` turns a request into a
``GenerateReqInput``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from sglang.srt.managers.request_schema import RequestModel, Unsupported
from sglang.srt.sampling.sampling_params import TOP_LOGPROBS_MAX as MAX_TOP_LOGPROBS  # OpenAI's limit (upstream's)
CHAT_ROLES = ("system", "user", "assistant", "tool", "function", "developer")
_DP = "this server has a single data-parallel rank (0)"
_GRAMMAR = "constrained decoding is not implemented"
_PENALTY = "penalties are not implemented"


class StreamOptions(RequestModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _OpenAIBase(RequestModel):
    """Fields that completions and chat share."""

    model: str = ""
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    n: int = 1
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    return_hidden_states: Union[bool, str] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_cached_tokens_details: bool = False  # cached_tokens_details is always in usage here
    return_token_ids: bool = False
    min_tokens: int = 0
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    lora_path: Optional[Union[str, list]] = None
    session_id: Optional[str] = None
    session_params: Optional[dict] = None
    response_format: Optional[dict] = None
    custom_params: Optional[dict] = None
    custom_logit_processor: Optional[Union[str, list]] = None
    images_config: Optional[dict] = None
    bootstrap_host: Optional[Union[str, list]] = None  # PD serving: set by the router, see generate_request.py
    bootstrap_port: Optional[Union[int, list]] = None
    bootstrap_room: Optional[Union[int, list]] = None
    routed_dp_rank: Optional[int] = None
    disagg_prefill_dp_rank: Optional[int] = None
    data_parallel_rank: Optional[int] = None
    rid: Optional[Union[str, list]] = None
    extra_key: Optional[Union[str, list]] = None
    cache_salt: Optional[Union[str, list]] = None
    ngram_corpus_id: Optional[Union[str, list]] = None
    priority: Optional[int] = None

    UNSUPPORTED = {
        "frequency_penalty": Unsupported(_PENALTY),
        "presence_penalty": Unsupported(_PENALTY),
        "logit_bias": Unsupported("logit bias is not implemented"),
        "n": Unsupported("the limit is 1 choice per request (send n requests)"),
        "return_hidden_states": Unsupported("hidden states are not returned"),
        "return_routed_experts": Unsupported("no mixture-of-experts routing is recorded"),
        "routed_experts_start_len": Unsupported("no mixture-of-experts routing is recorded"),
        "return_token_ids": Unsupported("token ids are not returned in choices"),
        "min_tokens": Unsupported("a minimum output length is not implemented"),
        "regex": Unsupported(_GRAMMAR),
        "ebnf": Unsupported(_GRAMMAR),
        "stop_regex": Unsupported("regular-expression stops are not implemented"),
        "no_stop_trim": Unsupported("a matched stop string is always trimmed from the output"),
        "lora_path": Unsupported("LoRA adapters are not supported"),
        "session_params": Unsupported("sessions are not implemented"),
        "custom_params": Unsupported("custom logit processors are not implemented"),
        "custom_logit_processor": Unsupported("custom logit processors are not implemented"),
        "images_config": Unsupported("multimodal inputs are not supported (text-only models)"),
        "routed_dp_rank": Unsupported(_DP, also=(0,)),
        "disagg_prefill_dp_rank": Unsupported(_DP, also=(0,)),
        "data_parallel_rank": Unsupported(_DP, also=(0,)),
        "extra_key": Unsupported("per-request cache namespaces are not implemented yet"),
        "cache_salt": Unsupported("per-request cache namespaces are not implemented yet"),
        "ngram_corpus_id": Unsupported("n-gram speculative decoding is not implemented"),
    }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_OpenAIBase):
    prompt: Union[str, list]
    best_of: Optional[int] = None
    echo: bool = False
    logprobs: Optional[int] = None
    max_tokens: int = 16
    suffix: Optional[str] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    json_schema: Optional[str] = None
    repetition_penalty: float = 1.0
    custom_labels: Optional[dict] = None

    UNSUPPORTED = {
        **_OpenAIBase.UNSUPPORTED,
        "best_of": Unsupported("one choice per request", also=(1,)),
        "echo": Unsupported("the prompt is not echoed"),
        "suffix": Unsupported("insertion (suffix) is not implemented"),
        "json_schema": Unsupported(_GRAMMAR),
        "repetition_penalty": Unsupported(_PENALTY),
        "custom_labels": Unsupported("custom metric labels are not enabled"),
    }


class ContentPart(RequestModel):
    type: str
    text: Optional[str] = None
    thinking: Optional[str] = None
    image_url: Any = None
    video_url: Any = None
    audio_url: Any = None
    name: Optional[str] = None
    modalities: Optional[str] = None


class ChatMessage(RequestModel):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list] = None
    tools: Optional[list] = None

    UNSUPPORTED = {
        "tool_call_id": Unsupported("tool calling is not implemented"),
        "tool_calls": Unsupported("tool calling is not implemented"),
        "tools": Unsupported("tool calling is not implemented"),
        "reasoning_content": Unsupported("reasoning content is not rendered into prompts"),
    }

    def check_values(self) -> None:
        if self.role.lower() not in CHAT_ROLES:
            raise ValueError(f"message role {self.role!r} is not allowed; choose one of: {', '.join(CHAT_ROLES)}")
        self.role = self.role.lower()


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    tools: Optional[list] = None
    tool_choice: Union[str, dict] = "auto"
    parallel_tool_calls: bool = True  # without tools it changes nothing
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    reasoning_effort: Optional[Union[str, float]] = None
    reasoning: Optional[dict] = None
    task: Optional[str] = None
    continue_final_message: bool = False
    separate_reasoning: bool = True  # no reasoning parser here: as upstream without one, no effect
    stream_reasoning: bool = True
    chat_template_kwargs: Optional[dict] = None
    max_dynamic_patch: Optional[int] = None
    min_dynamic_patch: Optional[int] = None
    use_audio_in_video: bool = False
    input_ids: Optional[list[int]] = None  # honoured: the prompt, bypassing the chat template

    UNSUPPORTED = {
        **_OpenAIBase.UNSUPPORTED,
        "repetition_penalty": Unsupported(_PENALTY, also=(1.0,)),
        "tools": Unsupported("tool calling is not implemented"),
        "tool_choice": Unsupported("tool calling is not implemented", also=("none",)),
        "return_prompt_token_ids": Unsupported("prompt token ids are not returned"),
        "return_meta_info": Unsupported("meta info is not returned in choices"),
        "reasoning_effort": Unsupported("reasoning controls are not implemented"),
        "reasoning": Unsupported("reasoning controls are not implemented"),
        "task": Unsupported("quick-instruction tasks are not implemented"),
        "continue_final_message": Unsupported("continuing the final assistant message is not implemented"),
        "chat_template_kwargs": Unsupported("chat template arguments are not implemented"),
        "max_dynamic_patch": Unsupported("multimodal inputs are not supported (text-only models)"),
        "min_dynamic_patch": Unsupported("multimodal inputs are not supported (text-only models)"),
        "use_audio_in_video": Unsupported("multimodal inputs are not supported (text-only models)"),
    }

    def check_values(self) -> None:
        if not self.messages:
            raise ValueError("messages is required and must not be empty")
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
