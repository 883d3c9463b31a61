"""The model as graphs of kernel dispatches and the loop that generates tokens with them: the
device engine and the numpy reference engine, the weights on the device, sampling, token
constraints, and the prefix cache with its disk tier.

Below it: `lily.kernels`, `lily.device`, `lily.checkpoint`. Above it: `lily.chat`, `lily.api`.
This file stays light: `lily.kernels.sampling` imports `lily.engine.sampling` and
`lily.engine.constraint`, which a heavier package import would turn into a cycle.
"""

from lily.engine.constraint import NoAllowedTokenError, TokenConstraint, mask_from_tokens
from lily.engine.sampling import SamplingParams, adjusted_logits

__all__ = [
    "NoAllowedTokenError",
    "SamplingParams",
    "TokenConstraint",
    "adjusted_logits",
    "mask_from_tokens",
]
