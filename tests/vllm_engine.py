"""Run vLLM's offline engine once, on the CPU, and print what it generated as JSON (tests/test_vllm.py).

Runs in the vLLM environment scripts/setup.sh makes (build/vllm-env: vLLM's CPU build with the
transformers it requires, mtprobe and torch from the project's environment), one engine per process:

    build/vllm-env/bin/python tests/vllm_engine.py MODEL_FOLDER PROMPTS_JSON [CONFIG_JSON] [MAX_TOKENS]

CONFIG_JSON is an mtprobe configuration's ``to_dict()`` (none: vLLM without speculation). Prints one JSON
object: ``tokens`` (one list per prompt), ``accepted`` and ``drafted`` (vLLM's speculative-decoding
counters; 0 without speculation).
"""

import json
import os
import sys

# The engine core in this process (the proposer's errors surface here) with a small KV cache (GiB).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams

    from mtprobe.vllm import speculative_config

    folder, prompts = sys.argv[1], json.loads(sys.argv[2])
    config = json.loads(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    spec = speculative_config(config) if config else None
    llm = LLM(
        model=folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        speculative_config=spec,
        disable_log_stats=False,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    counters = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "accepted": counters.get("vllm:spec_decode_num_accepted_tokens", 0),
                "drafted": counters.get("vllm:spec_decode_num_draft_tokens", 0),
            }
        )
    )


if __name__ == "__main__":
    main()
