"""The training floor: what the PPO learner and the offline stages (sft, rm, dpo) both train with.

``parallel``: the ranks, their process group and the few collectives besides DeepSpeed's own.
``deepspeed_engine``: a model in its DeepSpeed engine, the gradient guard, snapshots and swaps of its weights.
``optimizer_step``: one guarded optimizer step (NaN or inf gradients skipped and counted) and its gradient norm.
``micro_batches``: a rank's rows dealt and cut into micro-batches, as many on every rank.
``schedule``: the learning rate's warm-up and decay, a factor per step.
``checkpoints``: HF model directories and a run's whole state, each written whole or not at all.
``signals``: SIGTERM / SIGHUP noted, so training stops where its state is whole (``Preempted``).
``lora``: LoRA adapters on a model, and its tensors with them merged.
``vision_tower``: a model that sees: its image encoder kept frozen, and named for LoRA to leave alone.
``blank_image``: the image a rank whose micro-batch shows none runs with, so ZeRO's collectives meet.
"""
