"""The offline stages of InstructGPT besides PPO, and DPO: supervised fine-tuning (sft), the reward
model (rm), DPO (dpo), each a `run(config)` on its section of the config over the stages' shared
loop (``loop``, on the training floor ``training`` as the learner is), and the pipeline that chains
them into PPO."""
