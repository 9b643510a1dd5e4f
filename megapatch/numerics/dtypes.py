"""The activation dtypes whose sums and GEMM outputs megapatch keeps in FP32."""

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
