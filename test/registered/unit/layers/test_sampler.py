"""Sampler and SamplingParams: greedy, seeded determinism independent of the batch,
top-k / top-p / min-p truncation, logprobs, and parameter validation."""

import math

import pytest
import torch

from sglang.srt.layers.sampler import Sampler, truncated_probs
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

VOCAB = 50


def logits_rows(n, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def info(params, seeds=None, steps=None):
    return SamplingBatchInfo.from_params(params, VOCAB, "cpu", seeds, steps)


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = logits_rows(3)
    out = Sampler()(logits, info([SamplingParams(temperature=0)] * 3), return_logprob=True, top_logprobs_nums=[2, 0, 4])
    assert out.next_token_ids == logits.argmax(-1).tolist()
    logprobs = torch.log_softmax(logits, -1)
    assert out.next_token_logprobs == pytest.approx(logprobs.max(-1).values.tolist(), abs=1e-6)
    assert [len(t) for t in out.top_logprobs] == [2, 0, 4]
    ids, values = zip(*out.top_logprobs[2])
    assert list(ids) == logprobs[2].topk(4).indices.tolist()
    assert list(values) == sorted(values, reverse=True)


def test_top_k_one_is_greedy_even_with_temperature():
    logits = logits_rows(2, seed=1)
    out = Sampler()(logits, info([SamplingParams(temperature=5.0, top_k=1)] * 2, seeds=[1, 2]))
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_independent_of_batch_composition():
    logits = logits_rows(4, seed=2)
    params = [SamplingParams(temperature=1.3, top_p=0.9, sampling_seed=s) for s in (7, 8, 9, 10)]
    batch = Sampler()(logits, info(params, steps=[3, 3, 5, 0])).next_token_ids
    alone = [Sampler()(logits[i : i + 1], info([params[i]], steps=[[3, 3, 5, 0][i]])).next_token_ids[0] for i in range(4)]
    assert batch == alone
    mixed = Sampler()(logits[[2, 0]], info([SamplingParams(temperature=0), params[0]], steps=[0, 3])).next_token_ids
    assert mixed == [logits[2].argmax().item(), batch[0]]


def test_seed_and_step_change_the_draw():
    logits = torch.zeros(1, VOCAB)  # uniform: draws are pure noise
    draws = {Sampler()(logits, info([SamplingParams()], seeds=[s], steps=[t])).next_token_ids[0]
             for s in range(5) for t in range(5)}
    assert len(draws) > 10


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs).unsqueeze(0)
    counts = torch.zeros(VOCAB)
    for step in range(1500):
        counts[Sampler()(logits, info([SamplingParams()], seeds=[0], steps=[step])).next_token_ids[0]] += 1
    freq = counts / counts.sum()
    assert counts[3:].sum() == 0
    torch.testing.assert_close(freq[:3], probs[:3], atol=0.05, rtol=0)


@pytest.mark.parametrize(
    "params,allowed",
    [
        (SamplingParams(top_k=3), 3),
        (SamplingParams(top_p=0.6), None),
        (SamplingParams(min_p=0.5), None),
    ],
)
def test_truncation_masks(params, allowed):
    logits = logits_rows(1, seed=3)
    probs = torch.softmax(logits[0], -1)
    kept = truncated_probs(logits, info([params]))[0] > 0
    order = probs.argsort(descending=True)
    if params.top_k > 0:
        expected = set(order[:allowed].tolist())
    elif params.top_p < 1:
        cum = probs[order].cumsum(0)
        expected = set(order[: int((cum < params.top_p).sum()) + 1].tolist())
    else:
        expected = set(torch.nonzero(probs >= params.min_p * probs.max()).flatten().tolist())
    assert set(torch.nonzero(kept).flatten().tolist()) == expected
    draws = {Sampler()(logits, info([params], seeds=[s])).next_token_ids[0] for s in range(200)}
    assert draws <= expected and len(draws) > 1


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_from_dict_rejects_unknown_keys():
    assert SamplingParams.from_dict({"temperature": 0, "stop": "x"}).stop == ["x"]
    with pytest.raises(ValueError, match=r"unknown sampling params \['bogus'\]"):
        SamplingParams.from_dict({"bogus": 1})


def test_batch_info_rejects_mismatched_seeds():
    with pytest.raises(ValueError, match="one entry per request"):
        info([SamplingParams()] * 2, seeds=[1])
    assert math.isclose(info([SamplingParams(temperature=0.5)]).temperatures.item(), 0.5)
