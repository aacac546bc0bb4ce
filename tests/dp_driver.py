"""Run under torchrun by tests/test_learner_ranks.py: two PPO steps of the real learner pieces
(DeepSpeed engines, ``ppo_step``, ``publish_weights``) on fixed samples, with as many ranks as
torchrun started; rank 0 writes the published weights of the last version to ``--out``.

    python -m torch.distributed.run --nproc-per-node 2 tests/dp_driver.py --assets A.json --zero 3 --out w.pt
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# 8 prompts, the behavior logprobs a little off the reference's (a stale version), so the off-policy weights act
PROMPTS = ["even 1 2 3 :", "odd 4 4 4 :", "even 9 0 1 :", "odd 5 5 2 :", "even 7 7 :", "odd 1 :", "even 2 2 2 2 :",
           "odd 3 8 :"]
# --parts: the first parts of the first three episodes, whose programs rewrote their context: 11 rows, 8 episodes
FIRST_PARTS = ["odd 6 :", "even 3 3 :", "odd 2 9 9 :"]


def as_parts(samples: list) -> list:
    """The samples with FIRST_PARTS' as the first parts of the episodes of the first three (each
    episode of its own prompt), those parts' rows after the others."""
    for i, s in enumerate(samples):
        first = i >= len(PROMPTS)
        owner = i - len(PROMPTS) if first else i
        s.prompt_index, s.episode_index = owner, 0
        s.part_index, s.episode_parts = (0, 2) if first else (1 if owner < len(FIRST_PARTS) else 0,
                                                              2 if owner < len(FIRST_PARTS) else 1)
    return samples


def watch_gathers() -> list[int]:
    """Record the bytes of full parameters each ZeRO-3 gather brings together (empty otherwise)."""
    import deepspeed

    sizes: list[int] = []
    original = deepspeed.zero.GatheredParameters

    def recording(params, *args, **kwargs):
        sizes.append(sum(p.ds_numel * p.element_size() for p in params if hasattr(p, "ds_numel")))
        return original(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = recording
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", required=True, help="JSON of the tiny assets' paths")
    parser.add_argument("--zero", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--loss-aggregation", default="token-mean")
    parser.add_argument("--override", action="append", default=[], help="a config override, KEY=VALUE")
    parser.add_argument("--parts", action="store_true", help="three episodes in two parts (FIRST_PARTS)")
    parser.add_argument("--vision", action="store_true", help="the policy sees images (tests.helpers."
                                                              "scored_vision_samples; its critic on its towers)")
    args = parser.parse_args()

    import torch

    import learner.step
    from common.config import load_config
    from common.models import load_causal_lm, load_critic
    from common.sequences import collate
    from learner.publish import publish_weights
    from learner.step import ppo_step
    from tests.helpers import policy_samples, scored_vision_samples
    from training import parallel
    from training.blank_image import blank_image
    from training.deepspeed_engine import make_deepspeed_engine
    from training.parallel import init_distributed
    from weight_sync.buckets import ShmWeightWriter, read_manifest

    with open(args.assets) as file:
        assets = json.load(file)
    world = int(os.environ.get("WORLD_SIZE", 1))
    run_dir = tempfile.mkdtemp(prefix="tether-dp-")
    config = load_config(None, [f"learner.zero_stage={args.zero}", "learner.batch_size=8", "learner.minibatch_size=4",
                                "learner.actor_lr=1e-3", "learner.critic_lr=1e-3", f"learner.ranks={world}",
                                f"learner.loss_aggregation={args.loss_aggregation}", "learner.ppo_epochs=2",
                                *args.override],
                         base={"run_dir": run_dir, "models": {"policy": assets["policy"], "reward": assets["reward"]},
                               "data": {"prompts": assets["prompts"]}})
    torch.manual_seed(0)
    init_distributed(config)
    processor = None
    if args.vision:
        samples, processor = scored_vision_samples(Path(tempfile.mkdtemp(prefix="tether-dp-images-")), assets["policy"],
                                                   behavior_offset=-0.05)
    else:
        samples = policy_samples(assets, PROMPTS + FIRST_PARTS * args.parts, behavior_offset=-0.05)
    if args.parts:
        samples = as_parts(samples)
    actor = make_deepspeed_engine(load_causal_lm(assets["policy"]), config.learner.actor_lr, config)
    critic_model = load_critic(assets["policy" if args.vision else "reward"])
    critic = make_deepspeed_engine(critic_model, config.learner.critic_lr, config)
    batch = collate(samples, processor.tokenizer.pad_token_id if processor else 0, processor, blank_image(processor))
    losses, passes, plan, blanks, as_run = [], [], learner.step.micro_batches_of, [], learner.step.as_ranks_run

    def blanked(part):  # each forward of this rank: 1 where it ran with the blank image's row
        ran = as_run(part)
        blanks.append(int(ran is not part))
        return ran

    learner.step.as_ranks_run = blanked

    def counting(rows, *rest):  # the micro-batches each minibatch of this rank was cut into
        parts = plan(rows, *rest)
        passes.append(len(parts))
        return parts

    learner.step.micro_batches_of = counting
    for version in range(2):
        stats = ppo_step(actor, critic, samples, batch, config, policy_version=version, kl_coef=0.05)
        losses.append(stats["policy_loss"])
    writer = ShmWeightWriter(os.path.join(run_dir, "shm"), bucket_bytes=1 << 16) if parallel.is_main() else None
    # forwards where one rank had the blank image's row and another an image: the passes the blank is for
    # (every forward is collective, so the ranks made as many)
    ran = [torch.tensor(blanks)] * world
    if world > 1 and args.vision:
        ran = [torch.empty_like(ran[0]) for _ in range(world)]
        torch.distributed.all_gather(ran, torch.tensor(blanks))
    mismatched = (torch.stack(ran).min(0).values != torch.stack(ran).max(0).values).sum()
    gathered = watch_gathers()
    manifest = publish_weights(actor, 2, writer, bucket_bytes=1 << 16)
    if parallel.is_main():
        with read_manifest(manifest) as tensors:
            critic_state = {k: v.detach().clone() for k, v in critic.module.state_dict().items()} if args.zero != 3 else {}
            torch.save({"actor": {k: v.clone() for k, v in tensors.items()}, "critic": critic_state,
                        "buckets": len(manifest.buckets), "losses": losses, "world": world,
                        "passes": passes, "mismatched_passes": int(mismatched),
                        "most_bytes_gathered": max(gathered, default=0),
                        "model_bytes": sum(p.ds_numel * 4 if hasattr(p, "ds_numel") else p.numel() * 4
                                           for p in actor.module.parameters())}, args.out)
        writer.close(remove=True)
    parallel.barrier()


if __name__ == "__main__":
    main()
