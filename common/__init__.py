"""What every role shares and no role owns: the run's config, its logs and metrics files
(``runlog``), where models are found (``models``), the prompts and the prompt stream's order
(``prompts``), the sampled distribution's math (``distributions``) and how samples become model
inputs (``sequences``), user code named in the config (``functions``).

``config``, ``runlog`` and ``prompts`` stay light (the buffer imports them); the modules that
need torch import it themselves.
"""
