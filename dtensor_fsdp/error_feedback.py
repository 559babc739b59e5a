"""Error feedback for quantized reduce-scatters (``CommPrecisionPolicy.error_feedback``).

Each quantized parameter keeps the quantization error of its last reduce-scatter and
adds it to the next one's input, so what encoding drops in one step is sent in the
next.
"""

import torch

from .param import FSDPParam


class ErrorFeedback:
    """Per quantized param, its (W, padded chunk numel) fp32 quantization error of the
    last reduce-scatter."""

    def __init__(self) -> None:
        self._residuals: dict[FSDPParam, torch.Tensor] = {}

    def clear(self) -> None:
        self._residuals.clear()

    def residuals(
        self, params: list[FSDPParam], is_quantized: list[bool], world_size: int
    ) -> list[torch.Tensor | None]:
        """Per param, its residual (zeros the first time), or None if it is exact."""
        residuals: list[torch.Tensor | None] = []
        for fsdp_param, quantized in zip(params, is_quantized, strict=True):
            if not quantized:
                residuals.append(None)
                continue
            if fsdp_param not in self._residuals:
                # Row r: the error of this rank's contribution to rank r's shard.
                self._residuals[fsdp_param] = torch.zeros(
                    (world_size, fsdp_param.padded_shard_numel),
                    dtype=torch.float32,
                    device=fsdp_param.compute_device,
                )
            residuals.append(self._residuals[fsdp_param])
        return residuals
