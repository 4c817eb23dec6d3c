"""Pipeline parallelism pieces that need no second process: upstream's layer partition, which
checkpoint tensors a stage loads, what a stage of a Qwen3 model builds, the L3 namespace per
stage, and the --pp-size combinations refused at startup. The served path (tokens equal to
--tp-size 1 and HF, HiCache tiers per stage) is test/registered/hicache/test_pipeline_parallel_nightly.py."""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.pipeline import PipelineStage, PPMissingLayer, get_pp_indices
from sglang.srt.mem_cache.memory_pool.base import ShardMode
from sglang.srt.mem_cache.storage.keys import StorageNamespace
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@pytest.mark.parametrize("layers, pp, ranges", [
    (2, 1, [(0, 2)]),
    (2, 2, [(0, 1), (1, 2)]),
    (3, 2, [(0, 1), (1, 3)]),  # the remainder goes to the last stages
    (7, 3, [(0, 2), (2, 4), (4, 7)]),
    (5, 4, [(0, 1), (1, 2), (2, 3), (3, 5)]),
    (8, 3, [(0, 2), (2, 5), (5, 8)]),
])
def test_partition_is_upstreams_rule(layers, pp, ranges):
    assert [get_pp_indices(layers, r, pp) for r in range(pp)] == ranges


def test_partition_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"--pp-size 3 exceeds the model's 2 layers; allowed: 1 to 2"):
        get_pp_indices(2, 0, 3)
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, pp_size=2\)"):
        get_pp_indices(4, 2, 2)


def test_stage_owns_its_layers_embedding_and_head():
    first, last = PipelineStage(0, 2, 0, 1), PipelineStage(1, 2, 1, 3)
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.2.self_attn.q_proj.weight",
             "model.norm.weight", "lm_head.weight", "model.layers.10.input_layernorm.weight"]
    assert [first.owns_weight(n, tied_embeddings=False) for n in names] == [True, True, False, False, False, False]
    assert [last.owns_weight(n, tied_embeddings=False) for n in names] == [False, False, True, True, True, False]
    # tied: the last stage's head is the embedding, so it loads that tensor too
    assert last.owns_weight("model.embed_tokens.weight", tied_embeddings=True)


@pytest.fixture
def pp_stage(request):
    """Pretend to be rank ``request.param`` of a 2-stage pipeline (no process group needed to build)."""
    saved = parallel_state._PP
    parallel_state._PP = parallel_state.GroupCoordinator(request.param, 2, ranks=(0, 1))
    yield request.param
    parallel_state._PP = saved


@pytest.mark.parametrize("pp_stage", [0, 1], indirect=True)
def test_qwen3_stage_builds_and_loads_only_its_part(pp_stage):
    from sglang.srt.model_executor.weight_utils import dummy_weights_iterator
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    raw = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True}
    hf = SimpleNamespace(**Qwen3ForCausalLM.complete_hf_config(raw))
    model = Qwen3ForCausalLM(hf)
    model.load_weights(dummy_weights_iterator(Qwen3ForCausalLM.hf_weight_shapes(hf), 0))  # no missing/unexpected
    layers = {n.split(".")[2] for n, _ in model.named_parameters() if n.startswith("model.layers.")}
    if pp_stage == 0:
        assert layers == {"0"} and isinstance(model.model.norm, PPMissingLayer)
        assert isinstance(model.lm_head, PPMissingLayer)
    else:
        assert layers == {"1", "2"} and model.lm_head is model.model.embed_tokens
        # attention layers number from 0 on every stage: its KV pool holds only its layers
        assert [layer.self_attn.attn.layer_id for layer in model.model.layers[1:]] == [0, 1]


_DEEPSEEK_RAW = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "vocab_size": 100, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                 "v_head_dim": 8, "q_lora_rank": None, "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "n_shared_experts": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1}


@pytest.mark.parametrize("pp_stage", [0, 1], indirect=True)
def test_deepseek_v2_stage_builds_its_dense_or_moe_layers_and_mla_pool(pp_stage):
    from sglang.srt.layers.moe import DeepseekMoE
    from sglang.srt.model_executor.weight_utils import dummy_weights_iterator
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    hf = SimpleNamespace(**DeepseekV2ForCausalLM.complete_hf_config(_DEEPSEEK_RAW))
    model = DeepseekV2ForCausalLM(hf)
    model.load_weights(dummy_weights_iterator(DeepseekV2ForCausalLM.hf_weight_shapes(hf), 0))
    start, end = get_pp_indices(3, pp_stage, 2)
    built = model.model.layers[start:end]
    # layer 0 is dense (first_k_dense_replace=1), the others MoE, by their global index
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in built] == [i >= 1 for i in range(start, end)]
    assert [layer.self_attn.attn.layer_id for layer in built] == list(range(end - start))
    assert isinstance(model.model.embed_tokens, PPMissingLayer) == (pp_stage == 1)
    assert isinstance(model.lm_head, PPMissingLayer) == (pp_stage == 0)
    # the stage's MLA pool holds its layers only
    stage_hf = DeepseekV2ForCausalLM.pipeline_stage_hf_config(hf, start, end)
    layout = DeepseekV2ForCausalLM.kv_pool_layout(stage_hf, 2, torch.float32)
    assert layout.anchor.args["layer_num"] == end - start


def test_qwen3_next_stage_pools_and_refused_split():
    from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM

    raw = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100, "full_attention_interval": 2}
    hf = SimpleNamespace(**Qwen3NextForCausalLM.complete_hf_config(raw))
    stage = Qwen3NextForCausalLM.pipeline_stage_hf_config(hf, 2, 4)
    assert (stage.num_hidden_layers, stage.layer_types) == (2, ["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"layers \[0, 1\) has no full_attention layer"):
        Qwen3NextForCausalLM.pipeline_stage_hf_config(hf, 0, 1)


def _namespace(pp_rank: int, pp_size: int, shard: ShardMode = ShardMode.SHARDED) -> bytes:
    config = SimpleNamespace(model_name="m@0123", tp_rank=0, tp_size=1, pp_rank=pp_rank, pp_size=pp_size,
                             attn_cp_rank=0, attn_cp_size=1, namespace_salt="", dp_rank=0)
    pool = SimpleNamespace(page_size=4)
    return StorageNamespace.for_pool(config, pool, "kv", "file", shard=shard, page_format="layer_first",
                                     kv_dtype="float32").digest()


def test_storage_namespace_per_stage_and_split():
    # each stage its own objects; another split (pp 1, pp 3) never reads them
    names = {_namespace(0, 2), _namespace(1, 2), _namespace(0, 1), _namespace(0, 3), _namespace(1, 3)}
    assert len(names) == 5
    # MLA (replicated over TP): the stages still hold different layers, so pp stays in the name
    assert _namespace(0, 2, ShardMode.REPLICATED) != _namespace(1, 2, ShardMode.REPLICATED)


@pytest.mark.parametrize("flags, words", [
    ({"pp_size": 0}, "--pp-size 0 is invalid"),
    ({"pp_size": 2, "disaggregation_mode": "prefill"}, "--pp-size 2 is not supported with --disaggregation-mode"),
    ({"pp_size": 2, "enable_hierarchical_cache": True, "hicache_size": 1.0}, "use --hicache-ratio"),
])
def test_refused_combinations_name_the_flags(flags, words):
    with pytest.raises(ValueError, match=words):
        ServerArgs(model_path="/nonexistent", **flags)
