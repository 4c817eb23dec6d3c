"""What the model-vs-HF unit tests share: the HF reference model (fp32, eager attention), its greedy
``generate`` with the raw logits of every step, giving the tensors HF initializes to zeros values
that matter, a ``ModelRunner`` for a checkpoint, and our engine stepped greedily on one prompt.

Both sides decode the same way: greedy on the raw logits, EOS an ordinary token (``eos_token_id``
None; the served workloads ignore EOS too), so token lists compare position by position.
"""

from __future__ import annotations

import torch

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_config import ModelRunnerConfig
from sglang.test.engine_utils import Driver


def load_hf(path: str, eager: bool = True):
    """The HF reference model of a checkpoint: fp32, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": "eager"} if eager else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy ``generate``: (the ``new_tokens`` generated ids, the raw logits of each step (V,))."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def randomize_zero_inits(path: str, scales: dict[str, float], seed: int = 1) -> None:
    """Give the tensors HF initializes to zeros values that matter, and save the checkpoint in
    place: every parameter or buffer whose name ends with a key of ``scales`` becomes
    ``scale * randn``, and a hash routing table (``...tid2eid``) random expert ids. Draws follow
    ``named_parameters()`` then ``named_buffers()`` order from one ``seed``ed generator."""
    model = load_hf(path, eager=False)
    gen = torch.Generator().manual_seed(seed)
    suffixes = tuple(scales)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, model.config.n_routed_experts, tensor.shape, generator=gen))
            elif name.endswith(suffixes):
                scale = next(scales[s] for s in suffixes if name.endswith(s))
                tensor.copy_(scale * torch.randn(tensor.shape, generator=gen))
    model.save_pretrained(path)


def make_runner(path: str, page_size: int = 4, device: str = "cpu", max_total_tokens: int = 4096,
                max_running_requests: int = 8, **kw) -> ModelRunner:
    """A ``ModelRunner`` over ``path``; ``kw`` goes to ``ModelRunnerConfig`` (dtype, load_format...)."""
    return ModelRunner(ModelRunnerConfig(path, device=device, page_size=page_size, max_total_tokens=max_total_tokens,
                                         max_running_requests=max_running_requests, **kw))


def greedy_steps(runner: ModelRunner, prompt: list[int], new_tokens: int,
                 chunk: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Our engine on one request: the prompt prefilled (in chunks of ``chunk`` tokens when given),
    then ``new_tokens - 1`` greedy decodes. Returns (the ``new_tokens`` argmax ids, the next-token
    logits (V,) after the prefill and after each decode)."""
    driver = Driver(runner)
    req = driver.new_req(prompt)
    done = 0
    while done < len(prompt):
        n = min(chunk or len(prompt), len(prompt) - done)
        out = driver.extend([req], [n])
        done += n
    tokens, logits = [], []
    for step in range(new_tokens):
        row = out.next_token_logits[0]
        logits.append(row.clone())
        tokens.append(int(row.argmax()))
        req.token_ids.append(tokens[-1])
        if step + 1 < new_tokens:
            out = driver.decode([req])
    driver.release(req)
    return tokens, logits


# DeepSeek-V4 tensors HF initializes to zeros (compressor position biases, attention sinks, router
# correction bias, mHC bases; ``tid2eid`` is randomized too): scales for ``randomize_zero_inits``.
DSV4_ZERO_INITS = {name: 0.5 for name in ("position_bias", "sinks", "e_score_correction_bias", "hc.base", "hc_base")}
