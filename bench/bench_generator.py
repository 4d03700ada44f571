"""Torch-backend sampling throughput: batched across tasks vs one prompt at a time, same run.

    python bench/bench_generator.py [--prompts 64] [--group 8] [--max-tokens 32]

Samples `group` completions for each of `prompts` prompts with the default
(~0.7M-parameter) policy, first all in one batch per call as the generator
does, then one prompt per call. Prints tokens/s for both and the ratio. Not a test.
"""
from __future__ import annotations

import argparse
import time


import torch  # noqa: E402

from crucible.ml.policy.backends import create_backend  # noqa: E402
from crucible.ml.policy.model import count_to_str  # noqa: E402
from crucible.ml.policy.sampling import SamplingParams  # noqa: E402


def tokens_per_second(backend, prompts: list[str], group: int, params: SamplingParams, per_call: int) -> float:
    started = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), per_call):
        for completions in backend.sample(prompts[i:i + per_call], group, params):
            tokens += sum(len(c.token_ids) for c in completions)
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    backend = create_backend("torch", seed=0)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=1)
    prompts = [f"Q{i}: what is {i} + {2 * i}? A:" for i in range(args.prompts)]
    print(f"policy {count_to_str(backend.model.num_parameters())} parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.prompts} prompts x {args.group} samples, "
          f"up to {args.max_tokens} tokens")
    backend.sample(prompts[:2], 2, params)  # warm-up
    batched = tokens_per_second(backend, prompts, args.group, params, per_call=len(prompts))
    single = tokens_per_second(backend, prompts[: max(4, args.prompts // 8)], args.group, params, per_call=1)
    print(f"batched across tasks : {batched:9.0f} tokens/s")
    print(f"one task per call    : {single:9.0f} tokens/s")
    print(f"ratio                : {batched / single:.1f}x")


if __name__ == "__main__":
    main()
