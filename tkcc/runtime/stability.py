"""Is the reference stable at these inputs? Judge a tolerance-mode candidate only where it is.

A model whose output is discontinuous in its arithmetic (an MoE router on
near-tied logits: random-weight OLMoE on an H200) moves a token to another
expert when a sum is rounded differently in its last bit, and its logits then
move by 10-100% of their scale (16 layers on an H200; one flip alone, on CPU in
fp32 at olmoe-16l's shapes: 1-2% of their norm). A correct candidate with another summation
order does that at some inputs, so an elementwise bound fails it there (seen:
23 of 39 candidates of a campaign, the empty plan among them). Such an input
says nothing about the candidate: the reference itself jumps there. So before
judging a candidate at an input in tolerance mode, the reference is run once
more on the same input with its state (the KV cache) perturbed by one bf16
rounding step (relative 2^-8, random signs), once with the signs flipped
(antithetic: a near tie is pushed across by one of the two); if that moves its
output past the bound, the input is not judged and a fresh one is drawn. This
runs only where a candidate has exceeded the bound, so a passing candidate
pays nothing for it. A wrong kernel or
wiring is still caught on the inputs where the reference is stable; the greedy
check on golden prompts is unchanged.
"""
from __future__ import annotations

import torch

PERTURB_REL = 2.0 ** -8  # one rounding step of bf16, relative
MAX_DRAWS = 3  # inputs drawn per bucket before the bucket is left unjudged


def perturb_state(buffers: list[torch.Tensor], seed: int, rel: float = PERTURB_REL, flip: bool = False) -> None:
    """Multiply every floating buffer by (1 +- rel), signs drawn from ``seed`` (negated with ``flip``), in place.

    The signs are drawn on the buffer's own device: drawn on the host, a long cache's (olmoe-16l at 8k: 545 M
    values) took seconds a perturbation, four per check of a candidate past the bound."""
    gens: dict = {}
    with torch.no_grad():
        for b in buffers:
            if b.is_floating_point() and b.numel():
                g = gens.get(b.device)
                if g is None:
                    g = gens[b.device] = torch.Generator(device=b.device).manual_seed(seed)
                bits = torch.randint(0, 2, b.shape, generator=g, device=b.device, dtype=torch.int8)
                sign = bits.to(torch.float32).mul_(2).sub_(1)
                b.copy_((b.float() * sign.mul_(-rel if flip else rel).add_(1)).to(b.dtype))


def unstable_error(run_reference, inputs: tuple, guard, ref: list[torch.Tensor], scaled, seed: int,
                   ref_state: list[torch.Tensor] | None = None) -> float | None:
    """The reference's own scaled error under a one-rounding-step perturbation of its state when that exceeds
    ``scaled.bound`` (the input is near a discontinuity: do not judge a candidate here), else None.
    ``ref_state``: the cache the reference left at these inputs; the cache it leaves perturbed is held to it
    too (a token routed to another expert in one layer moves the K/V every later layer writes, which is what
    a candidate's cache is compared on). Leaves the state restored."""
    from tkcc.runtime.validation import clone_all, scaled_error, tensors_of

    if not guard.buffers:
        return None
    worst = 0.0
    for flip in (False, True):
        guard.restore()
        perturb_state(guard.buffers, seed, flip=flip)
        with torch.no_grad():
            again = tensors_of(run_reference(*clone_all(inputs)))
        pairs = list(zip(ref, again))
        if ref_state is not None:
            pairs += list(zip(ref_state, guard.current()))
        for r, o in pairs:
            if r.is_floating_point() and r.numel():
                worst = max(worst, scaled_error(r, o)[2])
    guard.restore()
    return worst if worst > scaled.bound else None
