"""Frontend: nn.Module -> Program (capture, layer map, HF adapters; the torch.compile backend is tkcc.backend).

    from tkcc.frontend import capture, capture_model, greedy
    prog = capture_model("llama-tiny", max_cache_len=128)      # phases prefill, decode
    tokens = greedy(prog, prompt_ids, new_tokens=16)
    prog = capture(my_module, example_inputs=(x,))              # phase forward

See docs/frontend.md for the input conventions of each phase.
"""
from tkcc.frontend.capture import capture, capture_model, reset_state
from tkcc.frontend.generate import greedy, greedy_steps
from tkcc.frontend.program import Program

__all__ = ["Program", "capture", "capture_model", "greedy", "greedy_steps", "reset_state"]
