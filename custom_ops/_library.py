"""The single `torch.library` handle of the `dspark` namespace; every op module defines its schema through it."""

import torch

LIB = torch.library.Library("dspark", "DEF")
