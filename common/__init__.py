"""What every role shares and no role owns, one module a concern:

``config``: the run's one config, typed and validated, with the errors that name the key.
``runlog``: logging, the metrics files (``RUN_DIR/metrics/<role>.jsonl``) and the start-up timeline.
``model_dirs``: where each model is (a directory or a hub id), resolved alike by every role, without torch.
``models``: every model loaded in one place (policy, reference, critic, reward model); whether two share tokens.
``lengths``: how long a sequence may be (the policy's positions, the KV cache on vLLM's CPU build).
``prompts``: the data file's rows, how a row becomes the tokens generated from, and the prompt stream's order.
``verifiers_data``: verifiers environments' loading and datasets, for every process that reads prompt rows.
``functions``: user code named in the config as ``"module:function"``, loaded in one place (``load_function``).
``distributions``: the sampled distribution's math (logprobs, entropy), as the scorer and the learner compute it.
``sequences``: how samples become model inputs, identically in the scorer and the learner.
``images``: images as encoded bytes: read from a row or an environment's parts, packed for the wire, decoded.
``processors``: a model that sees: its processor loaded and probed, and image placeholders expanded into tokens.
``image_prompts``: prompts and chats that show images, through the processor's chat template.

``config``, ``runlog`` and ``prompts`` stay light (the buffer imports them); the modules that
need torch import it themselves.
"""
