"""How far a converted model is from the original: max |Δ|, relative error, KL on sample inputs, over
every floating output the forward returns (logits, hidden states, encoder states, pooled outputs,
embeddings, caches, nested tuples), each judged on its own scale.

Not compared, and named in the report: tuples of intermediate hidden states (`hidden_states`,
`encoder_hidden_states`, ... returned when asked for). They are the residual stream itself, which an exact
conversion centres by design; every output read through a norm or a layer is compared.

One job a module: the report (`result`), the walk over what a forward returns (`outputs`), the original's
outputs recorded before its weights change, in memory or spilled to disk (`reference`), the comparison
(`comparison`), batches split into rows and outputs into fp64 blocks (`rows`), and the KL (`kl`).
A lazy facade.
"""
from normswap.facade import lazy

PUBLIC = {
    "Parity": "normswap.parity.result", "scope": "normswap.parity.result", "grouped": "normswap.parity.result",
    "json_safe": "normswap.parity.result",
    "tensors": "normswap.parity.outputs", "tensors_in": "normswap.parity.outputs",
    "floating_outputs": "normswap.parity.outputs", "main_output": "normswap.parity.outputs",
    "Reference": "normswap.parity.reference", "reference_outputs": "normswap.parity.reference",
    "reading": "normswap.parity.reference",
    "compare": "normswap.parity.comparison", "compare_to": "normswap.parity.comparison",
    "by_rows": "normswap.parity.rows",
    "token_kl": "normswap.parity.kl", "nonnegative": "normswap.parity.kl",
}
__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy(__name__, PUBLIC)
