"""Defaults the command line shows in its help as well as the library uses, in a module that imports nothing
(``tkcc --help`` does not load torch)."""

# tkcc.compile's budget when none is given. On a GPU the loop must build, screen, confirm and ship the fused
# decode step of olmoe-16l (its fast tier took 18 s, its confirmation an estimated 36 s after a 29 s start-up:
# 120 s left it 4.5 s short on an H200); the whole call takes 153-165 s, within the 3 minutes issue 17 allows
DEFAULT_BUDGET_S = {"cuda": 150.0, "cpu": 30.0}
