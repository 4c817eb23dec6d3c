"""Request bodies as upstream's clients send them: every field of upstream sglang's
``GenerateReqInput``, ``CompletionRequest``, ``ChatCompletionRequest`` and ``SamplingParams`` at
upstream's default (written down from upstream's source, independently of our schemas), and the
bodies that sglang-router 0.3.2 and upstream's benchmarks actually send (captured on the wire)."""

SAMPLING_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None, "sampling_seed": None,
}

GENERATE_DEFAULTS = {
    "rid": None, "session_id": None, "input_embeds": None, "image_data": None, "video_data": None,
    "audio_data": None, "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
    "token_ids_logprob": None, "return_sampling_mask": None, "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False, "stream": False,
    "log_metrics": True, "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None, "session_params": None,
    "lora_path": None, "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None, "disagg_prefill_dp_rank": None,
    "kv_router_hint": None, "routing_key": None, "conversation_id": None, "http_worker_ipc": None,
    "background": False, "require_reasoning": False, "max_thinking_tokens": None, "priority": None,
    "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False, "return_entropy": False,
    "return_prompt_token_ids": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None, "video_max_dynamic_patch": None,
    "images_config": None, "multi_item_delimiter_indices": None, "cache_salt": None,
}

_OPENAI_COMMON = {
    "model": "default", "frequency_penalty": 0.0, "logit_bias": None, "n": 1, "presence_penalty": 0.0,
    "seed": None, "stop": None, "stream": False, "stream_options": None, "user": None,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_cached_tokens_details": False, "return_token_ids": False, "min_tokens": 0, "regex": None,
    "ebnf": None, "stop_token_ids": None, "stop_regex": None, "no_stop_trim": False, "ignore_eos": False,
    "skip_special_tokens": True, "lora_path": None, "session_id": None, "session_params": None,
    "response_format": None, "custom_params": None, "custom_logit_processor": None, "images_config": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "routed_dp_rank": None,
    "disagg_prefill_dp_rank": None, "data_parallel_rank": None, "rid": None, "extra_key": None,
    "cache_salt": None, "ngram_corpus_id": None, "priority": None,
}

COMPLETION_DEFAULTS = {
    **_OPENAI_COMMON, "best_of": None, "echo": False, "logprobs": None, "max_tokens": 16, "suffix": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "json_schema": None, "repetition_penalty": 1.0,
    "custom_labels": None,
}

CHAT_DEFAULTS = {
    **_OPENAI_COMMON, "logprobs": False, "top_logprobs": None, "max_tokens": None, "max_completion_tokens": None,
    "temperature": None, "top_p": None, "tools": None, "tool_choice": "auto", "parallel_tool_calls": True,
    "return_prompt_token_ids": False, "return_meta_info": False, "reasoning_effort": None, "task": None,
    "top_k": None, "min_p": None, "repetition_penalty": None, "continue_final_message": False,
    "separate_reasoning": True, "stream_reasoning": True, "chat_template_kwargs": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "use_audio_in_video": False, "input_ids": None,
}

# what sglang-router 0.3.2 forwarded for {"text"/"prompt"/"messages", max tokens} (captured)
ROUTER_GENERATE = {"text": "hi", "model": None, "sampling_params": {"max_new_tokens": 2},
                   "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}
ROUTER_COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True,
                     "stream_options": {"include_usage": True}, "echo": False, "no_stop_trim": False,
                     "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT = {"messages": [{"role": "user", "content": "hi"}], "model": "unknown", "logprobs": False,
               "max_completion_tokens": 2, "stream": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False}
# upstream's benchmark/hicache/bench_multiturn.py and bench_serving payloads
BENCH_MULTITURN = {"text": "hi", "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
                   "stream": True, "lora_path": "", "return_logprob": False, "logprob_start_len": -1}
BENCH_SERVING = {"text": "hi", "sampling_params": {"max_new_tokens": 8}, "stream": True, "lora_path": None,
                 "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1,
                 "image_data": None, "stream_options": {"include_usage": True}}


def full_generate(**body) -> dict:
    return {**GENERATE_DEFAULTS, "sampling_params": dict(SAMPLING_DEFAULTS), **body}


def full_completion(**body) -> dict:
    return {**COMPLETION_DEFAULTS, **body}


def full_chat(**body) -> dict:
    return {**CHAT_DEFAULTS, **body}
