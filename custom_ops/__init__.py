"""`import custom_ops` registers every `torch.ops.dspark.*` op: schemas, fake impls and CPU references."""

from custom_ops import _library, multi_linear  # noqa: F401  (_library defines the dspark namespace first)
