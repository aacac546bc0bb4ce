"""The learner's side of the colocated mode on a GPU (``placement.mode: colocate``): between its
shifts the learner moves the optimizer's state to host memory (``training.deepspeed_engine.
offload_optimizer``) so that the engine generates in it, and back before its next step.

For each ZeRO stage given: two DeepSpeed engines from the same weights take the same AdamW steps on
the same data; one offloads after every step and reloads before the next. Printed: the GPU memory
allocated before and after each offload (what the engine may use meanwhile), the time of an offload
and of a reload, and the largest weight difference between the two engines after the steps, which
must be 0: the offload moves the state, it does not change it. Then the offloaded engine's
checkpoint, saved with its state on the host as the colocated learner saves it, is resumed into a
new engine that offloads at once, and one more step of it must equal the kept engine's.

    python bench/colocate_gpu.py --stages 0,1 --steps 3

Needs a GPU (on the CPU there is nothing to free). The model is built from a config (Qwen2's
architecture, ~120M parameters at the defaults) in bf16, as a learner trains one."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=vocab,
                         max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def engine_of(stage: int, args):
    from training.deepspeed_engine import deepspeed_engine

    learner = SimpleNamespace(zero_stage=stage, grad_clip=1.0, weight_decay=0.0, gradient_checkpointing=False)
    return deepspeed_engine(model(args.hidden, args.layers, args.vocab).cuda(), 1e-4, learner, "bfloat16", args.batch)


def train(engine, steps: range, offload: bool, args) -> list[dict]:
    """Steps ``steps`` (each on its own seeded batch) of ``engine``; with ``offload`` the state is
    reloaded before each and offloaded after it, as the colocated learner does. Per step: the memory
    and times of the offload and reload."""
    import torch

    from training.deepspeed_engine import offload_optimizer, reload_optimizer

    figures = []
    for step in steps:
        reloaded_at = time.perf_counter()
        if offload:
            reload_optimizer(engine)
        torch.cuda.synchronize()
        reload_s = time.perf_counter() - reloaded_at
        generator = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=generator).cuda()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        offloaded_at = time.perf_counter()
        if offload:
            offload_optimizer(engine)
        torch.cuda.synchronize()
        figures.append({"allocated_before": before, "allocated_after": torch.cuda.memory_allocated(),
                        "offload_s": time.perf_counter() - offloaded_at, "reload_s": reload_s})
    return figures


def weights(engine) -> list:
    return [p.detach().float().cpu() for p in engine.module.parameters()]


def largest_gap(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def compare(stage: int, args, directory: str) -> None:
    """Kept on the GPU against offloaded between steps; then the offloaded engine's checkpoint,
    saved with its state on the host (as the colocated learner saves), resumed into a new engine
    that offloads at once, and one more step on both."""
    import torch

    from training.deepspeed_engine import offload_optimizer

    kept = engine_of(stage, args)
    train(kept, range(args.steps), False, args)
    offloaded = engine_of(stage, args)
    figures = train(offloaded, range(args.steps), True, args)
    gap = largest_gap(weights(kept), weights(offloaded))
    for step, figure in enumerate(figures, 1):
        print(f"ZeRO-{stage} step {step}: GPU memory allocated {figure['allocated_before'] / 2**20:,.0f} MiB "
              f"-> {figure['allocated_after'] / 2**20:,.0f} MiB after the offload "
              f"({figure['offload_s'] * 1000:.0f} ms); reload before it {figure['reload_s'] * 1000:.0f} ms")
    print(f"ZeRO-{stage}: largest weight difference after {args.steps} steps, offloaded vs kept: {gap:g} "
          f"(limit 0) -> {'ok' if gap == 0 else 'DIFFERENT'}")
    offloaded.save_checkpoint(os.path.join(directory, f"zero{stage}"), tag="state")
    del offloaded
    torch.cuda.empty_cache()
    resumed = engine_of(stage, args)
    resumed.load_checkpoint(os.path.join(directory, f"zero{stage}"), tag="state")
    offload_optimizer(resumed)
    train(resumed, range(args.steps, args.steps + 1), True, args)
    train(kept, range(args.steps, args.steps + 1), False, args)
    gap = largest_gap(weights(kept), weights(resumed))
    print(f"ZeRO-{stage}: saved with the state offloaded, resumed and offloaded, one more step: largest weight "
          f"difference to the kept engine {gap:g} (limit 0) -> {'ok' if gap == 0 else 'DIFFERENT'}")
    del kept, resumed
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="0,1")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/colocate_gpu.py needs a GPU: on the CPU the learner offloads nothing")
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")})
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    directory = tempfile.mkdtemp(prefix="tether-colocate-gpu-")
    for stage in (int(s) for s in args.stages.split(",")):
        compare(stage, args, directory)


if __name__ == "__main__":
    main()
