"""Weight sync: how the learner's weights of a policy version reach the rollout's engines.

``buckets``: a version as checksummed buckets in shared-memory slots (the manifest, the writer,
the reader); ``stream``: checking each bucket while the version is being written; ``tcp``: the
learner's weight server, for rollouts on other hosts.
"""
