"""The checkpoint: finding it (a local directory, a Hugging Face repo, the demo), downloading it,
validating it against the model's shapes, and mapping its tensors into memory.

Depends on nothing else in Lily but `lily.errors`; everything above reads the model from here.
"""

from lily.checkpoint.loader import Checkpoint, load_checkpoint, resolve_model

__all__ = ["Checkpoint", "load_checkpoint", "resolve_model"]
