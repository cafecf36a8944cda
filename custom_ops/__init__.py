"""`import custom_ops` registers every `torch.ops.dspark.*` op: schemas, fake impls and CPU references."""

from custom_ops import _library  # noqa: F401  (defines the dspark namespace first)
