"""`import custom_ops` registers every `torch.ops.dspark.*` op: schemas, fake impls and CPU references."""

from custom_ops import (  # noqa: F401  (_library defines the dspark namespace first)
    _library,
    dsv4_compress,
    dsv4_compress_online,
    dsv4_compress_plan,
    multi_linear,
)
