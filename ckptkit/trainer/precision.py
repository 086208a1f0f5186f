"""Mixed precision: the compute dtypes, and fp16's dynamic loss scaler (checkpointed in
``info.loss_scaler``).

bf16 and fp16 compute with a copy of the fp32 master weights (see `zero.Unit`); bf16 needs no
loss scaling. fp16 multiplies the loss by a scale before backward and divides the gradients by
it; a step whose gradients overflow (inf or nan on any rank) is skipped and the scale halved,
and after ``growth_interval`` steps without overflow it doubles, as torch's GradScaler does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0  # steps since the last overflow or growth
    skipped_steps: int = 0

    def update(self, overflow: bool) -> None:
        """After a step: back off on overflow, else grow every `growth_interval` steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state(self) -> dict[str, Any]:
        """What a checkpoint records (``info.loss_scaler``)."""
        return {"type": "dynamic", **asdict(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LossScaler:
        return cls(**{k: v for k, v in state.items() if k != "type"})
