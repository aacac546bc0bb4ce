"""Weight sync: how the learner's weights of a policy version reach the rollout's engines.

``buckets``: a version as checksummed buckets in shared-memory slots (the manifest, the writer,
the reader); ``stream``: checking each bucket while the version is being written; ``tcp``: the
learner's weight server, for rollouts on other hosts; ``lora``: what a version of a LoRA run is
(its adapters, or the merged model) and which of the two a run moves.
"""
