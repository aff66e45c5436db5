"""The token-id pipeline: training data as ids on disk and the batches a trainer cuts from them.

corpus        the on-disk format and its reader (TokenCorpus)
render        conversations -> ids and the spans of their turns, cut into samples
build         a corpus from its sources (hamburger_jax.data.source_specs), written atomically
boundaries    group starts of corpus samples from the base's probabilities (the boundary pass)
online_batch  samples with their group starts packed into rows
answers       the base's own greedy answers to corpus prompts, as corpus samples
"""
