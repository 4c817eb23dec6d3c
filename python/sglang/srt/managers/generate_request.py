"""GenerateReqInput: the body of ``POST /generate``, with upstream sglang's field set.

Honoured: ``text`` / ``input_ids``, ``sampling_params``, ``stream``, ``return_logprob``,
``top_logprobs_num``, ``return_text_in_logprobs``, ``rid``, ``logprob_start_len`` (-1: output
tokens only), ``no_logs`` (request contents are never logged), ``model``, ``stream_options``,
``session_id`` / ``conversation_id`` / ``routing_key`` (labels without effect here),
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (PD serving: the router sets them;
a server in null mode ignores them, as upstream's does). Every other
upstream field is accepted at its default and refused otherwise (``UNSUPPORTED``). Problems raise
``BadRequestError`` (HTTP 400) naming the field; nothing reaches the scheduler unless well-formed.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from sglang.srt.managers.request_schema import BadRequestError, RequestModel, Unsupported, parse_request
from sglang.srt.sampling.sampling_params import TOP_LOGPROBS_MAX, SamplingParams

__all__ = ["BadRequestError", "GenerateReqInput", "check_bootstrap_fields", "check_priority", "check_token_ids",
           "parse_sampling_params"]

BATCH = "batch requests (a list of prompts) are not supported; send one prompt per request"
_MM = "multimodal inputs are not supported (text-only models)"
_PD = "not implemented by this server's PD serving"
MAX_BOOTSTRAP_ROOM = 1 << 63  # rooms are signed 64-bit on the wire
_DP = "this server has a single data-parallel rank (0)"
_INTERNAL = "an internal field of upstream's tokenizer manager"


def check_token_ids(name: str, ids) -> list[int]:
    if not isinstance(ids, list):
        raise BadRequestError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise BadRequestError(f"{name} must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequestError(f"{name} must hold integers only")
    return ids


def check_bootstrap_fields(host, port, room) -> None:
    """Types and ranges of the PD bootstrap fields (each may be None); BadRequestError naming the field."""
    if isinstance(host, list) or isinstance(port, list) or isinstance(room, list):
        raise BadRequestError(BATCH)
    if host is not None and not host:
        raise BadRequestError("bootstrap_host must not be empty")
    if port is not None and not 1 <= port <= 65535:
        raise BadRequestError(f"bootstrap_port must be in [1, 65535], got {port}")
    if room is not None and not 0 <= room < MAX_BOOTSTRAP_ROOM:
        raise BadRequestError(f"bootstrap_room must be in [0, 2**63), got {room}")


def check_priority(priority) -> None:
    """``priority`` (None or a signed 64-bit integer, as upstream): it orders eviction under
    ``--radix-eviction-policy priority`` (a request's prefix is kept over lower ones'); it does
    not reorder scheduling."""
    if priority is None:
        return
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise BadRequestError(f"priority must be an integer, got {type(priority).__name__}")
    if not -(1 << 63) <= priority < (1 << 63):
        raise BadRequestError(f"priority must be a signed 64-bit integer, got {priority}")


def parse_sampling_params(params: dict) -> SamplingParams:
    try:
        return SamplingParams.from_dict(params)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(str(exc)) from None


class GenerateReqInput(RequestModel):
    # honoured
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[list] = None
    sampling_params: Optional[Union[dict, list]] = None
    stream: bool = False
    return_logprob: Optional[Union[bool, list]] = None
    logprob_start_len: Optional[Union[int, list]] = None
    top_logprobs_num: Optional[Union[int, list]] = None
    return_text_in_logprobs: bool = False
    rid: Optional[Union[str, list]] = None
    no_logs: bool = False
    log_metrics: bool = True
    model: Optional[str] = None  # sent by sglang-router; the server has one model
    stream_options: Optional[dict] = None  # sent by benchmark clients; meta_info always carries usage
    session_id: Optional[str] = None
    conversation_id: Optional[str] = None
    routing_key: Optional[str] = None
    # accepted at their default only
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: bool = False
    video_config: Optional[dict] = None
    token_ids_logprob: Optional[list] = None
    return_sampling_mask: Optional[Union[bool, list]] = None
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    return_hidden_states: Union[bool, str, list] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    modalities: Optional[list] = None
    session_params: Optional[dict] = None
    lora_path: Optional[Union[str, list]] = None
    lora_id: Optional[Union[str, list]] = None
    custom_logit_processor: Optional[Union[str, list]] = None
    positional_embed_overrides: Any = None
    bootstrap_host: Optional[Union[str, list]] = None  # honoured (PD serving)
    bootstrap_port: Optional[Union[int, list]] = None
    bootstrap_room: Optional[Union[int, list]] = None
    bootstrap_pair_key: Optional[Union[str, list]] = None
    decode_tp_size: Optional[Union[int, list]] = None
    routed_dp_rank: Optional[int] = None
    data_parallel_rank: Optional[int] = None
    disagg_prefill_dp_rank: Optional[int] = None
    kv_router_hint: Optional[dict] = None
    http_worker_ipc: Optional[str] = None
    background: bool = False
    require_reasoning: bool = False
    max_thinking_tokens: Optional[int] = None
    priority: Optional[int] = None
    extra_key: Optional[Union[str, list]] = None
    cache_salt: Optional[Union[str, list]] = None
    custom_labels: Optional[dict] = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    external_trace_header: Optional[dict] = None
    received_time: Optional[float] = None
    need_wait_for_mm_inputs: Optional[bool] = None
    num_items_assigned: Optional[dict] = None
    encoder_urls: Optional[list] = None
    max_dynamic_patch: Optional[int] = None
    min_dynamic_patch: Optional[int] = None
    image_max_dynamic_patch: Optional[int] = None
    video_max_dynamic_patch: Optional[int] = None
    images_config: Optional[dict] = None
    multi_item_delimiter_indices: Optional[list] = None

    UNSUPPORTED = {
        "log_metrics": Unsupported("every request is counted in /metrics"),
        **{name: Unsupported(_MM) for name in (
            "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
            "use_audio_in_video", "video_config", "modalities", "need_wait_for_mm_inputs", "num_items_assigned",
            "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
            "video_max_dynamic_patch", "images_config", "multi_item_delimiter_indices", "positional_embed_overrides")},
        "token_ids_logprob": Unsupported("logprobs of chosen token ids are not implemented"),
        "return_sampling_mask": Unsupported("sampling masks are not returned"),
        "return_flat_raw_top_logprobs": Unsupported("top logprobs come as nested lists only"),
        "return_flat_raw_top_logprobs_b64": Unsupported("top logprobs come as nested lists only"),
        "return_hidden_states": Unsupported("hidden states are not returned"),
        "return_routed_experts": Unsupported("no mixture-of-experts routing is recorded"),
        "routed_experts_start_len": Unsupported("no mixture-of-experts routing is recorded"),
        "return_indexer_topk": Unsupported("no indexer top-k is recorded"),
        "session_params": Unsupported("sessions are not implemented"),
        "lora_path": Unsupported("LoRA adapters are not supported"),
        "lora_id": Unsupported("LoRA adapters are not supported"),
        "custom_logit_processor": Unsupported("custom logit processors are not implemented"),
        **{name: Unsupported(_PD) for name in (
            "bootstrap_pair_key", "decode_tp_size")},
        **{name: Unsupported(_DP, also=(0,)) for name in (
            "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")},
        "kv_router_hint": Unsupported("KV router hints are not implemented"),
        "http_worker_ipc": Unsupported(_INTERNAL),
        "received_time": Unsupported(_INTERNAL),
        "background": Unsupported("background responses are not implemented"),
        "require_reasoning": Unsupported("reasoning controls are not implemented"),
        "max_thinking_tokens": Unsupported("reasoning controls are not implemented"),
        "extra_key": Unsupported("per-request cache namespaces are not implemented yet"),
        "cache_salt": Unsupported("per-request cache namespaces are not implemented yet"),
        "custom_labels": Unsupported("custom metric labels are not enabled"),
        "return_bytes": Unsupported("image generation is not supported"),
        "return_entropy": Unsupported("entropies are not returned"),
        "return_prompt_token_ids": Unsupported("prompt token ids are not returned"),
        "external_trace_header": Unsupported("request tracing is not implemented"),
    }

    @classmethod
    def from_json(cls, body) -> "GenerateReqInput":
        return parse_request(cls, body, "/generate")

    def check_values(self) -> None:
        batch = [isinstance(v, list) for v in (self.text, self.rid, self.sampling_params, self.return_logprob,
                                                self.logprob_start_len, self.top_logprobs_num)]
        if any(batch) or (isinstance(self.input_ids, list) and self.input_ids and isinstance(self.input_ids[0], list)):
            raise BadRequestError(BATCH)
        if (self.text is None) == (self.input_ids is None):
            raise BadRequestError("give exactly one of 'text' and 'input_ids'")
        if self.text is not None and not self.text:
            raise BadRequestError("text must not be empty")
        if self.input_ids is not None:
            check_token_ids("input_ids", self.input_ids)
        self.sampling_params = {} if self.sampling_params is None else self.sampling_params
        self.return_logprob = bool(self.return_logprob)
        self.top_logprobs_num = self.top_logprobs_num or 0
        if not 0 <= self.top_logprobs_num <= TOP_LOGPROBS_MAX:
            raise BadRequestError(f"top_logprobs_num must be in [0, {TOP_LOGPROBS_MAX}] (the limit, as OpenAI's), "
                                  f"got {self.top_logprobs_num}")
        if self.logprob_start_len not in (None, -1) and self.return_logprob:
            raise BadRequestError(f"logprob_start_len={self.logprob_start_len} is not supported by this server: "
                                  "prompt logprobs are not computed; use -1 (output tokens only)")
        self.logprob_start_len = -1 if self.logprob_start_len is None else self.logprob_start_len
        check_bootstrap_fields(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        check_priority(self.priority)

    def parsed_sampling_params(self) -> SamplingParams:
        return parse_sampling_params(self.sampling_params)
