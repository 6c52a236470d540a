"""Frontend: nn.Module -> Program (capture, layer map, HF adapters, torch.compile backend)."""
from tkcc.frontend.program import Program

__all__ = ["Program"]
