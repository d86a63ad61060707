"""The same decode workload through HF transformers on CPU (the `parity` extra), for a side-by-side ratio.

One `generate` call over all prompts at once (they have equal lengths, so no padding), greedy or
sampling as the requests do (HF's own sampler and random numbers: the same work, other tokens), and
forced to produce exactly max_tokens each. A logits processor stamps the time after every forward,
so decode throughput excludes the prefill exactly as it does for the engine.
"""
from __future__ import annotations

import time

from .workloads import BenchRequest


def hf_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_decode(model_dir, requests: list[BenchRequest]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    lengths = {len(r.prompt_ids) for r in requests}
    max_tokens = {r.max_tokens for r in requests}
    samplers = {tuple(sorted((k, v) for k, v in (r.sampling or {}).items() if k != "seed")) for r in requests}
    assert len(lengths) == len(max_tokens) == len(samplers) == 1, \
        "hf_decode takes equal prompt lengths, max_tokens and samplers"
    sampler = dict(samplers.pop())
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    input_ids = torch.tensor([r.prompt_ids for r in requests])
    new_tokens = max_tokens.pop()
    started = time.perf_counter()
    with torch.inference_mode():
        torch.manual_seed(0)
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=bool(sampler), **sampler,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       logits_processor=LogitsProcessorList([Stamp()]),
                       pad_token_id=0)  # nothing is padded; generate only wants some id
    wall = time.perf_counter() - started
    decode_s = stamps[-1] - stamps[0]
    decode_tokens = len(requests) * (len(stamps) - 1)
    return {"batch": len(requests), "wall_s": wall, "prefill_s": stamps[0] - started, "decode_s": decode_s,
            "decode_tokens": decode_tokens, "decode_tok_s": decode_tokens / decode_s if decode_s else float("nan"),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "sampling": sampler or "greedy"}
